"""`meshlm plan`: which layout fits a model on a cluster, how fast it runs, and proof against measured runs.

options.py   its options: the job in meshlm train's config keys, the cluster and layouts in its own, old spellings
presets.py   the models it knows by name
spec.py      the model, counted on the meta device from its transformers config
cluster.py   nodes, GPUs (meshlm/hardware.py's table), links; size/bandwidth/FLOP/s parsing
job.py       the job as the planner prices it (its view of a train Config), and the train keys of a layout
memory.py    bytes per GPU: model states (ZeRO paper), activations (Korthikanti et al., adjusted to
             what transformers' modules keep), temporary buffers, CPU memory under offload
comm.py      collectives per step per GPU and their time over the links they cross
advisor.py   candidate layouts (each a meshlm Layout), step time / tokens/s / MFU, ranking
reasons.py   the recommendation in words
inputs.py    the options turned into model, cluster, job and candidates; the memory picture
validate.py  `meshlm plan --validate`: run the layouts that fit here, predicted vs measured by the
             trainer's probe (train/probe.py, `--measure-step`)
cli.py       the run, the terminal table and --json
"""
