"""`meshlm plan`: which layout fits a model on a cluster, how fast it runs, and proof against measured runs.

spec.py      the inputs: model (counted on the meta device), cluster, job; size/bandwidth parsing
memory.py    bytes per GPU: model states (ZeRO paper), activations (Korthikanti et al., adjusted to
             what transformers' modules keep), temporary buffers, CPU memory under offload
comm.py      collectives per step per GPU and their time over the links they cross
advisor.py   candidate layouts (each a meshlm Layout), step time / tokens/s / MFU, ranking, the
             recommendation and its command
inputs.py    the options turned into model, cluster, job and candidates; the memory picture
validate.py  `meshlm plan --validate`: run the layouts that fit here, predicted vs measured by the
             trainer's probe (train/probe.py, `--measure-step`)
cli.py       options, the terminal table and --json
"""
