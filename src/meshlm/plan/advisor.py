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

from meshlm.layout import FSDP_STRATEGIES, Degrees, Layout, composition_error
from meshlm.plan.cluster import Cluster
from meshlm.plan.comm import Collective, collectives
from meshlm.plan.grpo_cost import generation_seconds, in_flight
from meshlm.plan.job import Job, command
from meshlm.plan.memory import Memory, master_weights, memory, startup_bytes
from meshlm.plan.reasons import recommend
from meshlm.plan.shape import StageShape
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
            **({"generation": m.generation} if m.generation else {}),
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
        startup_bytes(spec, job, st, startup_shard(job, cand, st), False, *startup_engine(job, cand, st))
        for st, _, _, _ in per_stage
    )
    if est.startup > budget:
        est.notes.append(
            f"starting needs {est.startup / GiB:.1f} GiB per rank (its parameters as allocated plus one full tensor "
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
            decoding=in_flight(job, cand.pp, micro),
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
    half = 2 if job.precision == "bf16" else 4
    peak = cluster.peak_flops * efficiency
    if cand.pp > 1:
        compute *= (micro + cand.pp - 1) / micro
    # GRPO's decoding, after the bubble: its pipeline fills as its own batches allow (plan/grpo_cost.py)
    compute += generation_seconds(job, micro, st.params(spec), active, half, cluster.hbm_bw, peak, cand.pp)
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
