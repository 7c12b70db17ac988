"""The recommendation in words, beside the search (plan/advisor.py): why the winning layout shards, splits
tensors or sequences, or crosses nodes the way it does."""

from __future__ import annotations

from meshlm.plan.cluster import LINKS, Cluster
from meshlm.plan.job import Job
from meshlm.plan.spec import ModelSpec

GiB = 2**30
# the estimates are plan/advisor.py's Estimate, unnamed here: the search imports its words, not the reverse


def _best(ests, pred):
    pool = [e for e in ests if pred(e)]
    return min(pool, key=lambda e: e.step_s) if pool else None


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _nothing_fits(job: Job, ests: list) -> str:
    """The leanest layout and what stops it: its training peak, its start-up peak (parameters allocated before
    the first step), or the CPU memory its offloaded states need."""
    e = min(ests, key=lambda x: (not x.cpu_fits, max(x.memory.gpu_total, x.startup)))
    fixes = "add GPUs or nodes, lower --micro-batch-size or --seq-length" + (
        ", or use --mixed-precision bf16" if job.precision != "bf16" else ""
    )
    if not e.cpu_fits:
        return f"nothing fits: the leanest layout ({e.candidate.name}) {e.notes[-1]}; {fixes}"
    if e.startup > e.memory.gpu_total:
        need = f"{gib(e.startup)} per GPU to start (its parameters as allocated plus one full tensor being drawn)"
    else:
        need = f"{gib(e.memory.gpu_total)} per GPU"
    return (
        f"nothing fits: the leanest layout ({e.candidate.name}) needs {need}, "
        f"{gib(max(e.memory.gpu_total, e.startup) - e.budget)} more than the {gib(e.budget)} usable; {fixes}"
    )


def recommend(spec: ModelSpec, job: Job, cluster: Cluster, ests: list, ranked: list) -> list[str]:
    """The decision guide in words: fits on one GPU -> DDP (or ZeRO if faster); else ZeRO/FSDP, then CPU offload;
    a block too big for a GPU -> TP; slow links between nodes -> hybrid sharding or PP across them; FSDP
    traffic dominating -> TP inside the node."""
    if not ests:
        return ["no layout splits the global batch: make it a multiple of micro-batch x data-parallel ranks"]
    if not ranked:
        return [_nothing_fits(job, ests)]
    win, out = ranked[0], []
    lay = win.candidate
    out += _sharding_reasons(ests, win)
    out += _tensor_parallel_reasons(spec, job, cluster, ests, win)
    out += _context_parallel_reasons(job, ests, win)
    if cluster.nodes > 1:
        ratio = cluster.intra[0] / cluster.inter[0]
        if lay.strategy == "hsdp" or lay.pp > 1:
            what = (
                (
                    f"hybrid sharding keeps the all-gathers inside groups of {lay.shard} GPUs and only all-reduces "
                    f"a 1/{lay.shard} gradient shard across nodes"
                )
                if lay.strategy == "hsdp"
                else "pipeline stages across nodes send only activations over the slow link"
            )
            out.append(f"{cluster.nodes} nodes with an inter-node link {ratio:.0f}x slower than inside a node: {what}")
    if lay.ac:
        out.append(
            f"activations: {gib(win.memory.act.per_layer)} per block per micro-batch without checkpointing, "
            f"{gib(win.memory.act.per_layer_ckpt)} with it; full checkpointing is needed to fit and costs one "
            f"extra forward (~1/3 more compute)"
        )
    if lay.pp > 1:
        out.append(
            f"pipeline bubble {win.bubble:.0%} with {win.micro_batches} micro-batches over {lay.pp} stages (1F1B)"
        )
    if job.optimizer == "sgd":
        out.append("meshlm train uses AdamW: its states are 8 bytes per parameter instead of SGD's 4")
    return out


def _sharding_reasons(ests: list, win) -> list[str]:
    """Whether replicated DDP fits, and if not, how the winner shards the model states (or offloads them)."""
    out, lay = [], win.candidate
    plain = lambda e: e.candidate.tp == 1 and e.candidate.pp == 1 and not e.candidate.offload  # noqa: E731
    ddp = _best(ests, lambda e: plain(e) and e.candidate.strategy in ("ddp", "single"))
    if ddp and ddp.fits:
        if lay.strategy in ("ddp", "single") and plain(win):
            out.append(
                f"the whole model fits on each GPU ({gib(ddp.memory.gpu_total)} of {gib(ddp.budget)}): "
                f"{'plain data parallel' if lay.world > 1 else 'one GPU'}; gradients are all-reduced once per "
                f"step, overlapped with backward"
            )
        else:
            out.append(
                f"DDP would fit ({gib(ddp.memory.gpu_total)}), but {lay.name} is faster "
                f"({win.step_s:.3g} s vs {ddp.step_s:.3g} s per step)"
            )
    elif ddp:
        out.append(
            f"replicated (DDP) needs {gib(ddp.memory.gpu_total)} per GPU, more than the {gib(ddp.budget)} "
            f"usable: the model states ({gib(sum(ddp.memory.states.values()))}) must be sharded"
        )
        if lay.offload:
            out.append(
                f"even fully sharded the GPUs are too small; CPU offload keeps parameters, gradients and "
                f"optimizer states in host memory ({gib(win.memory.cpu)} per rank) at the cost of PCIe copies "
                f"and a CPU optimizer step"
            )
        elif lay.strategy in ("zero1", "zero2", "zero3", "hsdp"):
            out.append(f"{lay.name} shards them over {lay.shard_ranks} ranks: {gib(win.memory.gpu_total)} per GPU")
    return out


def _tensor_parallel_reasons(spec: ModelSpec, job: Job, cluster: Cluster, ests: list, win) -> list[str]:
    """Why the winner uses TP: a block too big for one GPU, or less data-parallel traffic than without it."""
    out, lay = [], win.candidate
    unit = spec.layer_params * (2 if job.precision == "bf16" else 4) + win.memory.act.per_layer
    if lay.tp > 1 and not _best(ests, lambda e: e.fits and e.candidate.tp == 1):
        out.append(
            f"a single transformer block ({gib(unit)} with its activations) is too big for one GPU at this "
            f"size: tensor parallel over {lay.tp} GPUs of a node splits every block"
        )
    elif lay.tp > 1:
        no_tp = _best(ests, lambda e: e.fits and e.candidate.tp == 1)
        share = sum(c.seconds for c in no_tp.comm if c.group.startswith("dp")) / no_tp.step_s
        out.append(
            f"without TP the best is {no_tp.candidate.name} at {no_tp.step_s:.3g} s per step, "
            f"{share:.0%} of it in data-parallel communication; TP{lay.tp} inside the node divides that "
            f"volume by {lay.tp} and keeps its own all-reduces on {_link_name(cluster, 'intra')}"
        )
    return out


def _context_parallel_reasons(job: Job, ests: list, win) -> list[str]:
    """Why the winner splits each sequence: nothing without cp fits, or it is faster than the best that does."""
    lay = win.candidate
    if lay.cp == 1:
        return []
    per_block = gib(win.memory.act.per_layer)
    no_cp = _best(ests, lambda e: e.fits and e.candidate.cp == 1)
    leanest = min((e for e in ests if e.candidate.cp == 1), key=lambda e: e.memory.gpu_total, default=None)
    if leanest is None:
        why = f"--cp {lay.cp} asked for"
    elif no_cp is None:
        why = (
            f"no layout without context parallel fits {job.seq_length} tokens per sequence (the leanest, "
            f"{leanest.candidate.name}, needs {gib(leanest.memory.gpu_total)})"
        )
    else:
        why = f"faster than the best without it ({no_cp.candidate.name}, {no_cp.step_s:.3g} s per step)"
    return [
        f"{why}: cp{lay.cp} splits each sequence over {lay.cp} GPUs next to TP, so every block's activations are "
        f"1/{lay.cp} ({per_block} per block per micro-batch) and attention crosses them by all-to-all or "
        f"keys and values passed around a ring (parallel/context.py)"
    ]


def _link_name(cluster: Cluster, which: str) -> str:
    value = getattr(cluster, which)
    return next((k for k, v in LINKS.items() if v == value), f"{value[0] / 1e9:.0f} GB/s")
