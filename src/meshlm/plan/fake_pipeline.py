"""A pipeline schedule run over fake collectives (`meshlm plan --simulate` of pp layouts).

torch.distributed.pipelining learns, at its first step, whether each stage's input and output shapes are
given (a vote passed along the stages and read with `.item()`) and otherwise sends them from stage to
stage. Over a fake process group nothing arrives, and a fake tensor has no value to read, so the simulation
states the shapes itself (the schedule's STATIC mode, as if each PipelineStage had been given example
inputs and outputs): token ids into the first stage, the hidden states of one pipeline micro-batch between
stages, logits (or the loss a chunked head sums) out of the last; a mixture of experts' stages also pass its
routers' statistics on (parallel/aux_loss.py RouterCarry: probabilities summed per expert, and the counts).
Everything after that (receive buffers, 1F1B order, the gradients sent back) is the schedule's own. torch 2.11
checks every forward's inputs and outputs against these shapes, so they are the stages' exact ones.
"""

from __future__ import annotations

import torch

from meshlm.compat import set_stage_shapes, skip_pipeline_warmup


def state_shapes(engine, cfg, layout, spec) -> None:
    """Give every stage of a PipelineEngine its input and output shapes (one pipeline micro-batch's rows; under
    context parallel a cp rank's part of each sequence) and skip the warm-up vote."""
    bf16 = layout.sharded and layout.precision == "bf16"  # FSDP's bf16 policy: stages exchange bf16
    dtype = torch.bfloat16 if bf16 else torch.float32
    rows, seq = cfg.micro_batch_size // cfg.parallel.micro_batches, cfg.seq_length // layout.cp
    hidden, vocab = spec.hidden, spec.vocab
    hidden_states = torch.empty(rows, seq, hidden, dtype=dtype, device="meta", requires_grad=True)
    carried = ()
    if engine.routers is not None:
        n = engine.routers.experts
        carried = (
            torch.empty(n, dtype=torch.float32, device="meta", requires_grad=True),
            torch.empty(n + 1, dtype=torch.int64, device="meta"),
        )
    logits = torch.empty(rows, seq, vocab, dtype=dtype, device="meta", requires_grad=True)
    # a head computing the loss (parallel/loss.py ChunkedLossHead) returns its fp32 sum instead of logits
    loss = torch.empty((), dtype=torch.float32, device="meta", requires_grad=True)
    ids = torch.empty(rows, cfg.seq_length, dtype=torch.long, device="meta")
    ids = ids if engine.split is None else engine.split.local(ids)  # a cp rank's part, as the engine slices it
    for stage in engine.stages:
        inputs = (ids,) if stage.is_first else (hidden_states, *carried)
        outputs = hidden_states if not stage.is_last else logits if stage.loss_head is None else loss
        set_stage_shapes(stage, inputs, (outputs, *carried))
    skip_pipeline_warmup(engine.schedule)
