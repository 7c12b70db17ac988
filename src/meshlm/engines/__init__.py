"""Engines: how a step runs on a parallelized model. base.py's `Engine` (what the trainer sees) and one subclass per
way to step (ddp, zero1, fsdp, master_weights, pipeline, layer_split, dp); parallel/apply.py builds the one
`Layout.engine` names over the model the transforms in parallel/ prepared."""
