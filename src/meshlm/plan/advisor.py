"""Candidate layouts, their estimates, the ranking, the recommendation in words and the command that runs it.

Step time = compute (FLOPs / (peak x efficiency), stretched by the pipeline bubble, plus a
forward recompute under activation checkpointing) + the optimizer step + communication that
cannot hide behind compute: TP all-reduces, pipeline sends, host copies and ZeRO-1's
parameter gather are on the critical path; DDP's bucketed all-reduce and FSDP's prefetched
all-gathers / reduce-scatters overlap with compute and only their excess counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

from meshlm.config import to_args
from meshlm.layout import FSDP_STRATEGIES, Degrees, Layout, composition_error
from meshlm.plan.cluster import Cluster
from meshlm.plan.comm import Collective, collectives
from meshlm.plan.job import Job
from meshlm.plan.memory import Memory, StageShape, master_weights, memory, startup_bytes
from meshlm.plan.spec import ModelSpec

CPU_ADAM_BYTES_PER_S = 20e9  # memory traffic a CPU optimizer step sustains per rank (offload)
GiB = 2**30


@dataclass(frozen=True)
class Candidate:
    """A layout the planner estimates: meshlm's Layout (strategy and degrees) plus recompute and offload."""

    strategy: str  # single | ddp | zero1 | zero2 | zero3 | hsdp (PLANNED)
    dp: int = 1
    tp: int = 1
    pp: int = 1
    shard: int = 1  # data-parallel ranks that share one copy of the sharded states (hsdp: K; zero1/2/3: dp)
    ac: bool = False
    offload: bool = False
    cp: int = 1  # context parallel: each sequence split over cp ranks, which shard and average as dp ranks do
    ep: int = 1  # expert parallel: a mixture of experts' experts over ep of the shard's ranks (x tp)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def layout(self) -> Layout:
        """The meshlm layout that runs this candidate (zero1 replicates parameters: no dp_shard)."""
        dp_shard = self.shard if self.strategy in FSDP_STRATEGIES else 1
        d = Degrees(pp=self.pp, dp_replicate=self.dp // dp_shard, dp_shard=dp_shard, cp=self.cp, tp=self.tp, ep=self.ep)
        return Layout(self.strategy, d, offload=self.offload)

    @property
    def grad_ranks(self) -> int:
        """Ranks averaging gradients (the data-parallel ranks and their cp ranks) and those sharing one copy of
        what the strategy shards (meshlm shards over dp_shard x cp, as torchtitan)."""
        return self.dp * self.cp

    @property
    def shard_ranks(self) -> int:
        return self.shard * self.cp if self.strategy != "ddp" else 1

    @property
    def name(self) -> str:
        parts = []
        if self.strategy == "hsdp":
            parts.append(f"hsdp {self.shard}x{self.dp // self.shard}")
        elif self.grad_ranks > 1 or self.world == 1:
            parts.append(self.strategy if self.grad_ranks > 1 else "single")
        parts += [f"tp{self.tp}"] * (self.tp > 1) + [f"pp{self.pp}"] * (self.pp > 1) + [f"cp{self.cp}"] * (self.cp > 1)
        parts += [f"ep{self.ep}"] * (self.ep > 1)
        return " ".join(parts) + (" +ac" if self.ac else "") + (" +offload" if self.offload else "")


@dataclass
class Estimate:
    candidate: Candidate  # the layout estimated (Candidate.layout is meshlm's Layout)
    grad_accum: int
    micro_batches: int  # forward/backward passes per rank per step (pipeline micro-batches under PP)
    memory: Memory  # the rank with the most GPU memory
    comm: list[Collective]  # the rank with the most communication time
    budget: int  # usable GPU memory (after the margin)
    compute_s: float = 0.0
    optimizer_s: float = 0.0
    exposed_comm_s: float = 0.0
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    bubble: float = 0.0
    cpu_fits: bool = True
    startup: int = 0  # start-up peak of the fullest rank (building and materializing its part)
    notes: list[str] = field(default_factory=list)
    stages: list[tuple[Memory, list[Collective]]] = field(default_factory=list)  # every pipeline stage

    @property
    def fits(self) -> bool:
        """Both peaks fit: training's, and start-up's (a layout that cannot start never reaches step 1)."""
        return max(self.memory.gpu_total, self.startup) <= self.budget and self.cpu_fits

    @property
    def headroom(self) -> int:
        return self.budget - self.memory.gpu_total

    def to_dict(self) -> dict:
        m = self.memory
        return {
            "layout": self.candidate.name,
            **self.candidate.__dict__,
            "fits": self.fits,
            "grad_accum": self.grad_accum,
            "micro_batches": self.micro_batches,
            "gpu_bytes": m.gpu_total,
            "startup_bytes": self.startup,
            "budget_bytes": self.budget,
            "headroom_bytes": self.headroom,
            "states": m.states,
            "temp": m.temp,
            "optimizer_step_bytes": m.step,
            "activations": {
                **m.act.parts,
                "transient": m.act.transient,
                "peak": m.act.peak,
                "per_layer": m.act.per_layer,
                "per_layer_checkpointed": m.act.per_layer_ckpt,
            },
            "cpu_bytes": m.cpu,
            "comm": [c.to_dict() for c in self.comm],
            "comm_wire_bytes": sum(c.wire for c in self.comm),
            "compute_s": self.compute_s,
            "optimizer_s": self.optimizer_s,
            "exposed_comm_s": self.exposed_comm_s,
            "step_s": self.step_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "bubble": self.bubble,
            "notes": self.notes,
        }


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    spec: ModelSpec,
    cluster: Cluster,
    ac_choices=(False, True),
    tp=None,
    pp=None,
    dp=None,
    strategies=None,
    cp=None,
    seq: int = 0,
) -> list[Candidate]:
    """Every sensible layout of the cluster's GPUs: TP within a node and dividing heads, kv heads and MLP;
    context parallel within a node next to TP, dividing the sequence; PP up to the number of blocks; the
    data-parallel rest as ddp / zero1-3 / hsdp with every shard size between 1 and dp; CPU offload with the
    fully sharded ones."""
    world, out = cluster.world, []
    for t in divisors(cluster.gpus_per_node):
        if spec.heads % t or spec.kv_heads % t or spec.mlp % t or (tp and t != tp) or world % t:
            continue
        if t > 1 and (not spec.tp_attention or (spec.experts and spec.experts % t)):
            continue  # meshlm's TP of the family would leave attention whole, or split an expert
        for c in divisors(cluster.gpus_per_node // t):
            if (cp and c != cp) or world % (t * c) or (seq and seq % c):
                continue
            for p in divisors(world // (t * c)):
                d = world // (t * c * p)
                if p > spec.layers or (pp and p != pp) or (dp and d != dp):
                    continue
                out += _with_strategies(spec, d, t, p, c, ac_choices, strategies)
    return out


def _with_strategies(spec: ModelSpec, d: int, t: int, p: int, c: int, ac_choices, strategies) -> list[Candidate]:
    """The strategies of d data-parallel ranks (with c cp ranks each: they average and shard as well), and a
    mixture of experts' ep degrees under them."""
    if d * c == 1:
        kinds = [("single" if t * p == 1 else "ddp", 1)]
    else:
        kinds = [("ddp", 1), ("zero1", d), ("zero2", d), ("zero3", d)]
        kinds += [("hsdp", k) for k in divisors(d) if 1 < k < d]
    out = []
    for strategy, shard in kinds:
        if strategies and strategy not in strategies:
            continue
        # meshlm's compositions, as layout.resolve checks them: DDP cannot hold TP shards, and a
        # pipeline's stages are replicated by DDP or sharded by FSDP, not by ZeRO-1
        if composition_error(Candidate(strategy, d, t, p, shard, cp=c).layout):
            continue
        for ac in ac_choices:
            for off in (False, True) if strategy in ("zero3", "hsdp") else (False,):
                for e in expert_degrees(spec, strategy, shard, t, c, off):
                    out.append(Candidate(strategy, d, t, p, shard, ac, off, c, e))
    return out


def expert_degrees(spec: ModelSpec, strategy: str, shard: int, tp: int, cp: int, offload: bool) -> list[int]:
    """ep degrees for a mixture of experts under FSDP (1 for anything else): the divisors of the shard whose
    expert group (ep x tp) divides the experts (layout.resolve's checks: ep divides the data-parallel shard; the
    cp ranks of a sequence each dispatch their own tokens within their group and shard the experts' weights)."""
    if not spec.experts or strategy not in FSDP_STRATEGIES or offload:
        return [1]
    return [e for e in divisors(shard) if spec.experts % (e * tp) == 0]


@cache
def _stage_starts(layer_params: int, layers: int, pp: int, first: int, last: int) -> tuple[int, ...]:
    """models/stages.py's split of equal layers, once per shape: the plan asks it for every layout with pp > 1
    (hundreds on 64 GPUs), and its exact search over 94 layers and 32 stages takes a tenth of a second."""
    from meshlm.models.stages import balanced_starts

    return tuple(balanced_starts([layer_params] * layers, pp, first, last))


def stages(spec: ModelSpec, cand: Candidate, micro_batches: int) -> list[StageShape]:
    """Pipeline stages as meshlm splits them (models/stages.py: fewest parameters on the largest stage, the
    embedding counted on the first, the head on the last; 1F1B: stage i holds min(M, pp - i) micro-batches)."""
    p = cand.pp
    last = spec.head_params + (spec.vocab * spec.hidden if spec.tied else 0)  # a tied head is the embedding's
    starts = _stage_starts(spec.layer_params, spec.layers, p, spec.embed_params, last) if p > 1 else ()
    bounds = [0, *starts, spec.layers]
    return [
        StageShape(bounds[i + 1] - bounds[i], i == 0, i == p - 1, min(micro_batches, p - i), cand.tp, cand.cp, cand.ep)
        for i in range(p)
    ]


def estimate(spec: ModelSpec, job: Job, cluster: Cluster, cand: Candidate, efficiency: float = 0.5) -> Estimate | None:
    """None when the global batch does not split into micro-batches over this layout's data-parallel ranks
    (or, under PP, into at least pp pipeline micro-batches)."""
    per_pass = job.micro_batch * cand.dp
    if job.global_batch % per_pass:
        return None
    passes = job.global_batch // per_pass
    if cand.pp > 1 and passes < cand.pp:
        return None  # 1F1B needs at least pp micro-batches
    accum, micro = (passes, passes) if cand.pp == 1 else (1, passes)
    budget = int(cluster.gpu_memory * (1 - job.margin))
    per_stage = _per_stage(spec, job, cluster, cand, accum, micro, efficiency)
    worst_mem = max(per_stage, key=lambda x: x[1].gpu_total)
    slowest = max(per_stage, key=lambda x: x[3][-1])
    compute, opt, exposed, step = slowest[3]
    tokens = job.global_batch * job.seq_length
    # a mixture of experts computes with its active parameters (k of E experts per token)
    model_flops = tokens * (
        6 * (spec.active_params - spec.embed_params) + 12 * spec.layers * spec.hidden * job.seq_length
    )
    est = Estimate(
        cand,
        accum,
        micro,
        worst_mem[1],
        slowest[2],
        budget,
        compute,
        opt,
        exposed,
        step,
        tokens / step,
        model_flops / (step * cand.world * cluster.peak_flops),
        (cand.pp - 1) / (micro + cand.pp - 1) if cand.pp > 1 else 0.0,
    )
    est.stages = [(mem, comm) for _, mem, comm, _ in per_stage]
    # Random init is the larger start-up (a full tensor drawn beside this rank's part); pretrained reads slices.
    est.startup = max(
        startup_bytes(spec, st, startup_shard(job, cand, st), False, *startup_engine(job, cand, st))
        for st, _, _, _ in per_stage
    )
    if est.startup > budget:
        est.notes.append(
            f"starting needs {est.startup / GiB:.1f} GiB per rank (its fp32 part plus one full tensor "
            f"or its engine's buffers), "
            f"more than the {budget / GiB:.1f} GiB usable"
        )
    cpu_per_node = max(m.cpu for _, m, _, _ in per_stage) * cluster.gpus_per_node
    est.cpu_fits = cpu_per_node <= cluster.cpu_memory * 0.9
    if not est.cpu_fits:
        est.notes.append(
            f"offloaded states need {cpu_per_node / GiB:.0f} GiB of CPU memory per node, more than 90% "
            f"of {cluster.cpu_memory / GiB:.0f} GiB"
        )
    return est


def _per_stage(
    spec: ModelSpec, job: Job, cluster: Cluster, cand: Candidate, accum: int, micro: int, efficiency: float
) -> list:
    """(stage, memory, collectives, timing) of one rank of each pipeline stage."""
    per_stage = []
    for i, st in enumerate(stages(spec, cand, micro)):
        mem = memory(
            spec,
            job,
            st,
            cand.strategy,
            cand.grad_ranks,
            cand.shard_ranks,
            job.micro_batch,
            cand.ac,
            cand.offload,
            pipelined=cand.pp > 1,
            accumulating=accum > 1,
        )
        comm = collectives(
            spec,
            job,
            cluster,
            cand.strategy,
            cand.grad_ranks,
            cand.shard_ranks,
            cand.tp,
            cand.pp,
            st,
            i,
            micro,
            cand.offload,
        )
        per_stage.append((st, mem, comm, _timing(spec, job, cluster, cand, st, mem, comm, micro, efficiency)))
    return per_stage


def startup_shard(job: Job, cand: Candidate, st: StageShape) -> int:
    """Ranks sharing one copy of a stage's fp32 parameters while they are filled: FSDP's, except under bf16
    zero1/zero2's master-weight engine, which fills the whole (TP/PP-split) part on every rank first."""
    whole = master_weights(cand.strategy, job, st, cand.grad_ranks, cand.pp > 1, cand.offload)
    return cand.shard_ranks if cand.strategy in FSDP_STRATEGIES and not whole else 1


def startup_engine(job: Job, cand: Candidate, st: StageShape) -> tuple[str, int]:
    """What the engine allocates once the weights are filled (memory.startup_bytes's `engine`, `owners`)."""
    if master_weights(cand.strategy, job, st, cand.grad_ranks, cand.pp > 1, cand.offload):
        return "masters", cand.dp
    replicated = cand.strategy in ("ddp", "zero1") and cand.grad_ranks > 1 and not job.lora_r  # LoRA: tiny buckets
    return ("ddp" if replicated else ""), 1


def _timing(spec, job, cluster, cand, st: StageShape, mem: Memory, comm, micro: int, efficiency: float):
    tokens = micro * job.micro_batch * job.seq_length // cand.cp  # per rank per step
    attn = 12 * st.layers * spec.hidden * job.seq_length // cand.tp
    active = st.active_matmul_params(spec)  # a mixture of experts: k of E experts per token
    flops = tokens * (6 * active + attn)
    if cand.ac:  # one more forward of the blocks
        blocks = active - (spec.vocab * spec.hidden if st.last else 0)
        flops += tokens * (2 * blocks + attn // 3)
    if job.reference_forward:  # DPO: the reference's forward, without gradients
        flops += tokens * (2 * active + attn // 3)
    passes = 6 + 2 * cand.ac + 2 * job.reference_forward  # forward and backward, recomputed, DPO's reference
    float8 = tokens * passes * st.float8_params(spec, job) * st.layers  # --float8: at the float8 peak
    compute = (flops - float8) / (cluster.peak_flops * efficiency)
    compute += float8 / (cluster.float8_flops * efficiency) if float8 else 0.0
    if cand.pp > 1:
        compute *= (micro + cand.pp - 1) / micro
    states = sum(mem.states.values())
    opt = 2 * states / cluster.hbm_bw if not cand.offload else 2 * mem.cpu / CPU_ADAM_BYTES_PER_S
    hidden = sum(c.seconds for c in comm if c.overlapped)
    exposed = sum(c.seconds for c in comm if not c.overlapped) + max(0.0, hidden - compute)
    return compute, opt, exposed, compute + opt + exposed


@dataclass
class Plan:
    estimates: list[Estimate]
    ranked: list[Estimate]  # fitting, fastest first
    reasons: list[str]
    command: list[str]


def plan(spec: ModelSpec, job: Job, cluster: Cluster, layouts: list[Candidate], efficiency: float = 0.5) -> Plan:
    ests = [e for e in (estimate(spec, job, cluster, lay, efficiency) for lay in layouts) if e is not None]
    ranked = sorted((e for e in ests if e.fits), key=rank_key)
    reasons = recommend(spec, job, cluster, ests, ranked)
    return Plan(ests, ranked, reasons, command(spec, job, cluster, ranked[0]) if ranked else [])


def rank_key(e: Estimate):
    """Fastest first; among equally fast ones the simpler (no recompute, no offload, fewer mesh dimensions),
    then the one with more memory to spare."""
    lay = e.candidate
    return float(f"{e.step_s:.6g}"), lay.ac, lay.offload, lay.tp * lay.pp * lay.cp, e.memory.gpu_total


def _best(ests, pred):
    pool = [e for e in ests if pred(e)]
    return min(pool, key=lambda e: e.step_s) if pool else None


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def recommend(spec: ModelSpec, job: Job, cluster: Cluster, ests: list[Estimate], ranked: list[Estimate]) -> list[str]:
    """The decision guide in words: fits on one GPU -> DDP (or ZeRO if faster); else ZeRO/FSDP, then CPU offload;
    a block too big for a GPU -> TP; slow links between nodes -> hybrid sharding or PP across them; FSDP
    traffic dominating -> TP inside the node."""
    if not ests:
        return ["no layout splits the global batch: make it a multiple of micro-batch x data-parallel ranks"]
    if not ranked:
        e = min(ests, key=lambda x: x.memory.gpu_total)
        return [
            f"nothing fits: the leanest layout ({e.candidate.name}) needs {gib(e.memory.gpu_total)} per GPU, "
            f"{gib(-e.headroom)} more than the {gib(e.budget)} usable; add GPUs or nodes, lower "
            f"--micro-batch-size or --seq-length, or use bf16"
        ]
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


def _sharding_reasons(ests: list[Estimate], win: Estimate) -> list[str]:
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


def _tensor_parallel_reasons(
    spec: ModelSpec, job: Job, cluster: Cluster, ests: list[Estimate], win: Estimate
) -> list[str]:
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


def _context_parallel_reasons(job: Job, ests: list[Estimate], win: Estimate) -> list[str]:
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
    from meshlm.plan.cluster import LINKS

    value = getattr(cluster, which)
    return next((k for k, v in LINKS.items() if v == value), f"{value[0] / 1e9:.0f} GB/s")


def train_keys(job: Job, e: Estimate) -> list[tuple[str, object]]:
    """The `meshlm train` config keys that run estimate e (the model's own come from spec.run_as)."""
    lay = e.candidate
    mbs = job.micro_batch
    keys = lay.layout.keys()
    if lay.pp > 1:
        mbs = job.micro_batch * e.micro_batches  # meshlm splits the rank's batch into pipeline micro-batches
        keys += [("parallel.micro_batches", e.micro_batches), ("parallel.schedule", "1f1b")]
    keys += [("seq_length", job.seq_length), ("micro_batch_size", mbs), ("grad_accum", e.grad_accum)]
    keys += [("mixed_precision", "bf16")] * (job.precision == "bf16")
    keys += [("activation_checkpointing", "full")] * lay.ac
    keys += [("chunked_loss", job.chunked_loss)] * (job.chunked_loss != "auto")
    keys += [("activation_offload", "true")] * job.activation_offload
    keys += [("parallel.cp_attention", job.cp_attention)] * (lay.cp > 1 and job.cp_attention != "auto")
    keys += [("attention", "sdpa")] * (lay.cp > 1 and job.cp_attention == "allgather")  # a kernel taking a mask
    keys += [("objective", "dpo")] * (job.objective == "dpo")
    keys += [("dpo.precompute_reference", "true")] * (job.objective == "dpo" and job.precompute_reference)
    keys += [("lora.r", job.lora_r)] * bool(job.lora_r)
    keys += [("lora.targets", job.lora_targets)] * bool(job.lora_r and job.lora_targets)
    keys += [("float8", job.float8)] * (job.float8 != "off")
    return keys + [("cpu_offload", "true")] * lay.offload


def command(spec: ModelSpec, job: Job, cluster: Cluster, e: Estimate) -> list[str]:
    """The `meshlm train` command line that runs layout e (on the first node; others add --node-rank)."""
    cmd = ["meshlm", "train", "--nproc", str(cluster.gpus_per_node)]
    if cluster.nodes > 1:
        cmd += ["--nnodes", str(cluster.nodes), "--node-rank", "0", "--rdzv-endpoint", "HOST:29500"]
    return cmd + list(spec.run_as) + to_args(train_keys(job, e))
