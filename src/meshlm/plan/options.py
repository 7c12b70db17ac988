"""`meshlm plan`'s options: the job in `meshlm train`'s config keys (built from config.py's fields), the
cluster and the choice of layouts in plan's own, and the old spellings as aliases that print the new one."""

from __future__ import annotations

import argparse
import sys

from meshlm.config import STRATEGIES, Config, flat_keys, set_key
from meshlm.errors import MeshlmError
from meshlm.hardware import GPUS
from meshlm.options import add_config_option
from meshlm.plan.cluster import LINKS
from meshlm.plan.presets import MOE_PRESETS, PRESETS, TINY

# The strategies the planner models: dp (nn.DataParallel) and layer-split are single-process, and
# fsdp is zero3 under another name.
PLANNED = tuple(s for s in STRATEGIES if s not in ("auto", "dp", "fsdp", "layer-split"))


# The train keys whose value the planner prices, with plan's help where its default or meaning differs from
# train's (None: the field's own help). Every other config key is refused by name: its value would be ignored.
MODEL_KEYS = {
    "model_name": f"a preset ({', '.join([TINY, *PRESETS, *MOE_PRESETS])}), a local directory or a hub id "
    f"[default: {TINY}, meshlm's built-in model]",
    **{f"arch.{k}": f"dimensions: {k.replace('_', ' ')} (they override the chosen model's)" for k in (
        "family", "layers", "hidden_size", "heads", "kv_heads", "intermediate_size", "max_positions")},
}  # fmt: skip
JOB_KEYS = {
    "seq_length": "tokens per sequence [default: min(2048, the model's positions)]",
    "micro_batch_size": "sequences per GPU per forward pass [default: 1]",
    "global_batch_size": "sequences per step [default: micro-batch x GPUs]",
    "mixed_precision": "bf16 (bf16 compute, fp32 master weights) or no (fp32) [default: bf16]",
    "attention": "the kernel, as meshlm train (auto, sdpa, flex, varlen: none stores the s x s scores); eager: "
    "transformers' eager attention, which does (the planner only) [default: auto]",
    "lora.r": None,
    "lora.targets": None,
    "lora.base_dtype": None,
    "lora.quantize": None,
    "chunked_loss": None,
    "activation_offload": None,
    "parallel.cp_attention": "how context-parallel ranks attend across the split: auto, ulysses, ring or allgather "
    "[default: auto]",
    "float8": None,
    "objective": None,
    "dpo.precompute_reference": None,
    "grpo.group_size": None,
    "grpo.max_new_tokens": None,
    "grpo.beta": None,
    "grpo.gather_for_generation": None,
}
DEGREE_KEYS = {f"parallel.{d}": f"only this {what} degree" for d, what in (
    ("tp", "tensor-parallel"), ("pp", "pipeline-parallel"), ("cp", "context-parallel (each sequence over N)"),
    ("ep", "expert-parallel (a mixture of experts)"))}  # fmt: skip
PRICED = {**MODEL_KEYS, **JOB_KEYS, **DEGREE_KEYS}
# Train keys whose names plan gives its own meaning: --strategy a list of strategies to plan,
# --activation-checkpointing auto (plan both), --output-dir where --validate and --plot write.
OWN = ("strategy", "activation_checkpointing", "output_dir")
# The planner's defaults where they differ from train's: a step of a real model, not the built-in smoke run.
DEFAULTS = {"mixed_precision": "bf16", "micro_batch_size": 1}
# --arch.* key: the planner's name of that dimension (plan/spec.load_model)
DIMS = {
    "arch.family": "family",
    "arch.layers": "layers",
    "arch.hidden_size": "hidden",
    "arch.heads": "heads",
    "arch.kv_heads": "kv_heads",
    "arch.intermediate_size": "mlp",
    "arch.max_positions": "max_positions",
}
# old spelling: (train key, {old value: new value})
RENAMED = {
    "--model": ("model_name", {}),
    "--tp": ("parallel.tp", {}),
    "--pp": ("parallel.pp", {}),
    "--cp": ("parallel.cp", {}),
    "--ep": ("parallel.ep", {}),
    "--precision": ("mixed_precision", {"fp32": "no"}),
    "--cp-attention": ("parallel.cp_attention", {}),
    "--family": ("arch.family", {}),
    "--layers": ("arch.layers", {}),
    "--hidden": ("arch.hidden_size", {}),
    "--heads": ("arch.heads", {}),
    "--kv-heads": ("arch.kv_heads", {}),
    "--mlp": ("arch.intermediate_size", {}),
    "--max-positions": ("arch.max_positions", {}),
}
OLD_ATTENTION = "fused"  # the old name of what train's kernels all are (no s x s scores): --attention auto


def _option(key: str) -> str:
    return "--" + key.replace("_", "-")


def note(args, old: str, new: str) -> None:
    """One line on stderr, once per spelling, naming the new spelling of an old one."""
    noted = args.__dict__.setdefault("_renamed", set())
    if old not in noted:
        noted.add(old)
        print(f"meshlm: note: {old} is now {new}", file=sys.stderr)


class Renamed(argparse.Action):
    """An old `meshlm plan` spelling: sets the train key it now is, and says so."""

    def __init__(self, option_strings, dest, values=None, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.values = values or {}

    def __call__(self, parser, namespace, value, option_string=None):
        new = self.values.get(value, value)
        if value in self.values:
            note(namespace, f"{option_string} {value}", f"{_option(self.dest)} {new}")
        else:
            note(namespace, option_string, _option(self.dest))
        setattr(namespace, self.dest, new)


def add_options(p: argparse.ArgumentParser) -> None:
    """`meshlm plan`'s options, in the groups and order --help shows them."""
    m = p.add_argument_group("model (config only: no weights are read)")
    for key, help in MODEL_KEYS.items():
        add_config_option(m, key, help)
    m.add_argument("--vocab", type=int, metavar="N", help="dimensions: vocabulary size")
    m.add_argument(
        "--params",
        metavar="COUNT",
        help="the model at exactly this many parameters (e.g. 7.5B): the "
        "blocks are scaled to hold them, activations keep the model's dimensions",
    )
    _add_cluster_options(p)
    _add_job_options(p)
    _add_output_options(p)
    _add_check_options(p)
    for old, (key, values) in RENAMED.items():
        p.add_argument(old, dest=key, action=Renamed, values=values, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for key in flat_keys():  # given, each is refused by name (train_config): the plan would not follow it
        if key not in PRICED and key not in OWN:
            add_config_option(p, key, argparse.SUPPRESS)


def _add_cluster_options(p: argparse.ArgumentParser) -> None:
    """Nodes, GPUs and the links between them."""
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes in the cluster")
    c.add_argument("--gpus-per-node", type=int, default=8, metavar="N", help="GPUs per node")
    c.add_argument(
        "--gpu",
        default="h100",
        type=str.lower,  # a node's GPUs are named in capitals (L4, H100)
        metavar="NAME",
        help=f"{', '.join(GPUS)} (any case): memory, peak FLOP/s, HBM bandwidth",
    )
    c.add_argument("--gpu-memory", metavar="SIZE", help="per GPU, e.g. 80GiB, 80GB, 80e9 (overrides --gpu)")
    c.add_argument(
        "--peak-flops", metavar="FLOPS", help="per GPU for the job's precision, e.g. 989e12 (overrides --gpu)"
    )
    c.add_argument(
        "--intra-node",
        default="",
        metavar="LINK",
        help=f"{', '.join(LINKS)} or a rate (300GB/s) [default: pcie for l40s and l4, else nvlink]",
    )
    c.add_argument("--inter-node", default="infiniband", metavar="LINK", help="as --intra-node")
    c.add_argument("--cpu-memory", default="2TiB", metavar="SIZE", help="per node, for CPU offload")
    c.add_argument(
        "--device",
        default="gpu",
        choices=("gpu", "cpu"),
        help="cpu: the ranks are CPU processes (meshlm train without GPUs); the peak is priced as their resident "
        "memory, glibc's heap keeping the activations through the optimizer step (docs/plan.md)",
    )


def _add_job_options(p: argparse.ArgumentParser) -> None:
    """What one training step does, in meshlm train's keys; the optimizer, checkpointing and margins in plan's."""
    j = p.add_argument_group("job (meshlm train's options)")
    for key, help in JOB_KEYS.items():
        add_config_option(j, key, help)
    j.add_argument("--optimizer", default="adamw", metavar="OPT", help="adamw or sgd (with momentum)")
    j.add_argument(
        "--activation-checkpointing", default="auto", choices=("auto", "none", "full"), help="auto: plan both"
    )
    j.add_argument("--margin", type=float, default=0.10, metavar="F", help="fraction of GPU memory kept free")
    j.add_argument(
        "--efficiency", type=float, default=0.5, metavar="F", help="fraction of peak FLOP/s the matmuls reach"
    )


def _add_output_options(p: argparse.ArgumentParser) -> None:
    """Which layouts to plan and how to show them."""
    f = p.add_argument_group("which layouts")
    f.add_argument("--strategy", metavar="LIST", help=f"comma-separated subset of {', '.join(PLANNED)}")
    for key, help in DEGREE_KEYS.items():
        add_config_option(f, key, help)
    f.add_argument("--dp", type=int, metavar="N", help="only this data-parallel degree")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="machine-readable output")
    o.add_argument("--top", type=int, default=10, metavar="N", help="rows in the table")
    o.add_argument("--all", action="store_true", help="every layout, those that do not fit too")
    o.add_argument(
        "--plot",
        action="store_true",
        help="draw the table's layouts as stacked bars of predicted memory "
        "per GPU by component, with the GPU memory line (and the measured values with --validate) into "
        "plan-memory.png in --output-dir or the current directory",
    )


def _add_check_options(p: argparse.ArgumentParser) -> None:
    """--simulate and --validate: the plan checked against meshlm's own code, on fake tensors or real ranks."""
    s = p.add_argument_group("simulation: run the plan with meshlm's code on fake tensors (no memory) and compare")
    s.add_argument(
        "--simulate",
        action="store_true",
        help="one step of the recommended layout (with --all: of "
        "every layout in the table) for its first, last and each pipeline stage's first rank (stages of "
        "one kind derived from the first's simulation); with "
        "--validate, every rank of each validated layout against what it measured",
    )
    v = p.add_argument_group("validation: run the layouts that fit here and compare")
    v.add_argument("--validate", action="store_true", help="train a few steps per layout on this machine's ranks")
    v.add_argument("--nproc", type=int, default=2, metavar="N", help="ranks for --validate")
    v.add_argument(
        "--steps", type=int, default=3, metavar="N", help="steps per validation run; the last one is measured"
    )
    v.add_argument(
        "--output-dir",
        default="",
        metavar="DIR",
        help="where validation runs and --plot write [default: "
        "a temporary directory for the runs, the current directory for the plot]",
    )


def given(args) -> dict[str, object]:
    """The train keys given on the command line (through their old spellings too), as given."""
    keys = flat_keys()
    return {k: v for k, v in vars(args).items() if k in keys and k not in OWN}


def train_config(args) -> tuple[Config, str]:
    """The job as meshlm train's Config (plan's defaults where train's differ; seq_length 0 when not given: the
    model's positions decide), and the attention the planner prices: fused (train's kernels) or eager."""
    keys = given(args)
    refused = next((k for k in keys if k not in PRICED), None)
    if refused:
        raise MeshlmError(
            f"{_option(refused)} is a meshlm train option the planner does not price (its plan would be the same "
            f"without it); drop it (docs/plan.md lists the train options meshlm plan reads)"
        )
    cfg = Config(seq_length=0)
    for k, v in {**DEFAULTS, **keys}.items():
        if k == "attention" and v in ("eager", OLD_ATTENTION):
            if v == OLD_ATTENTION:
                note(args, f"--attention {v}", "--attention auto")
            continue
        if k not in DIMS:  # dimensions the chosen model takes, not only the built-in one (plan/spec.load_model)
            set_key(cfg, k, v)
    return cfg, "eager" if keys.get("attention") == "eager" else "fused"


def dims(args) -> dict[str, object]:
    """The dimensions given (--arch.* and --vocab), by the planner's names (plan/spec.load_model), read as
    meshlm train reads them."""
    probe, out = Config(), {"vocab": args.vocab}
    for key, name in DIMS.items():
        if key in vars(args):
            set_key(probe, key, vars(args)[key])
            out[name] = getattr(probe.arch, key.split(".")[1])
    order = ("family", "layers", "hidden", "heads", "kv_heads", "mlp", "vocab", "max_positions")  # as a name says them
    return {k: out[k] for k in order if k in out}
