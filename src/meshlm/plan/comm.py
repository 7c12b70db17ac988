"""Communication of one rank per optimizer step, by collective, and its time over the links it crosses.

Payload is the size of the buffer a collective works on (what a process-group wrapper
counts, and what `--validate` measures): the all-reduced tensor, the gathered output, the
scattered input, the tensors sent plus received. Wire bytes are what this rank sends under
ring algorithms: 2(N-1)/N of the payload for all-reduce, (N-1)/N for all-gather and
reduce-scatter and broadcast, the sent half for point-to-point. So DDP moves 2(N-1)/N x the gradient
bytes per step, and ZeRO-3 1.5x that (parameters gathered in forward and again in backward,
gradients reduce-scattered).

Ranks are laid out as the mesh (pp, dp_replicate, dp_shard, tp), tp innermost: a group whose
ranks span at most one node's GPUs runs at the intra-node bandwidth, any other at the
inter-node one (a ring is as fast as its slowest link).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshlm.plan.cluster import Cluster
from meshlm.plan.grpo_cost import generation_gathers
from meshlm.plan.job import Job
from meshlm.plan.memory import DDP_BUCKET, master_weights
from meshlm.plan.shape import Dtypes, StageShape
from meshlm.plan.spec import ModelSpec

# Megatron's count: per block, the row-parallel outputs of attention and MLP are all-reduced in forward, and the
# inputs' gradients of attention and MLP in backward. parallel/tensor.py makes the attention and MLP modules'
# inputs one Replicate DTensor each, so q/k/v (and gate/up) share one backward all-reduce, as Megatron's fused
# projections do. Forward outputs are in the compute dtype, backward gradients in the residual stream's.
TP_ALL_REDUCES = {"forward": 2, "backward": 2}


@dataclass
class Collective:
    kind: str  # all_reduce | all_gather | reduce_scatter | reduce | p2p | host_copy
    what: str
    group: str  # mesh dimension(s) it runs over
    ranks: int
    payload: int  # bytes per step on this rank
    calls: int
    wire: float = 0.0
    seconds: float = 0.0
    overlapped: bool = False  # hidden behind compute (DDP buckets in backward, FSDP prefetch)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _wire(kind: str, ranks: int, payload: int) -> float:
    if kind == "all_reduce":
        return 2 * (ranks - 1) / ranks * payload
    if kind in ("all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all"):
        return (ranks - 1) / ranks * payload  # all_to_all: what a rank sends; its own share does not travel
    if kind == "p2p":
        return payload / 2
    return payload


def collectives(
    spec: ModelSpec,
    job: Job,
    cluster: Cluster,
    strategy: str,
    dp: int,
    shard: int,
    tp: int,
    pp: int,
    stage: StageShape,
    stage_index: int,
    micro_batches: int,
    offload: bool,
) -> list[Collective]:
    """Per-step collectives of one rank of `stage`; `micro_batches` forward/backward passes per step."""
    psi, m = stage.params(spec), micro_batches
    if master_weights(strategy, job, stage, dp, pp > 1, offload):  # no TP, PP or offload with this engine
        return _timed(_master_weight_collectives(spec, strategy, dp, psi, m), cluster, strategy, dp, shard, tp, pp)
    grads = psi * 4  # fp32 gradients (fp32 master weights, also under bf16)
    half = 2 if job.precision == "bf16" else 4
    tokens = job.micro_batch * job.seq_length
    units = stage.layers + 1  # FSDP: one unit per block plus the root
    out: list[Collective] = []

    def add(kind, what, group, ranks, payload, calls, overlapped):
        if ranks > 1 and payload > 0:
            out.append(Collective(kind, what, group, ranks, int(payload), int(calls), overlapped=overlapped))

    _replicated(add, spec, strategy, dp, psi, grads, m)
    d = Dtypes.of(job, strategy in ("zero2", "zero3", "hsdp"))
    experts = spec.expert_layer_params // tp * stage.layers if stage.ep > 1 else 0  # their own FSDP units
    _sharded(add, spec, strategy, stage, dp, shard, tp, pp, m, psi - experts, grads - 4 * experts, half, units)
    if experts and strategy in ("zero2", "zero3", "hsdp"):
        _sharded_experts(add, strategy, stage, shard, pp, m, experts, half)
    if job.reference_forward and strategy in ("zero2", "zero3", "hsdp"):  # DPO's, GRPO's: resharded after it
        group, n = ("dp_shard", shard) if strategy == "hsdp" else ("dp", dp)
        what = f"reference parameters, its forward ({job.objective})"
        add("all_gather", what, group, n, m * psi * half, m * units, True)
    generation_gathers(add, job, strategy, dp, shard, pp, m, psi * half, units)
    if tp > 1:
        _tensor_parallel(add, spec, stage, d, tp, m, tokens)
    if spec.experts and stage.layers and tp * stage.ep > 1:
        _expert_dispatch(add, spec, stage, d, tp, m, tokens)
    if pp > 1:
        _pipeline(add, spec, stage, d, pp, m, tokens // stage.cp)
    if stage.cp > 1:
        _context_parallel(add, spec, stage, d, m, tokens, job.cp_attention)
    if offload:
        out.append(_host_copies(psi, shard, m, units))
    return _timed(out, cluster, strategy, dp, shard, tp, pp)


def _expert_dispatch(add, spec: ModelSpec, stage: StageShape, d, tp: int, m: int, tokens: int) -> None:
    """parallel/expert.py: per MoE block and micro-batch, each rank sends its k copies of its tokens (a cp rank
    its part of the sequences, a TP rank its slice of the rows) to their experts and gets them back: two
    all-to-alls forward, two backward, plus the exchange of the counts; under TP the rows are gathered again
    (forward) and their gradients (backward)."""
    tokens //= stage.cp
    rows = tokens // tp
    copies = rows * spec.active_experts * spec.hidden
    calls = m * stage.layers
    payload = copies * (2 * d.compute + 2 * d.stream)  # sent: dispatch, combine, and their gradients
    what = "tokens to their experts and back (forward, backward)"
    add("all_to_all", what, "experts", tp * stage.ep, calls * payload, calls * 4, False)
    if tp > 1:
        rows_back = calls * tokens * spec.hidden * (d.compute + d.stream)
        add("all_gather", "MoE rows of the TP ranks, and their gradients", "tp", tp, rows_back, calls * 2, False)


def _sharded_experts(add, strategy: str, stage: StageShape, shard: int, pp: int, m: int, experts: int, half: int):
    """Under expert parallel each experts module is an FSDP unit over the ranks holding the same experts
    (shard / ep of them; `shard` counts the cp ranks, which hold the same experts too): its all-gathers and
    reduce-scatters move this rank's experts (experts / ep) only."""
    n, local = max(shard // stage.ep, 1), experts // stage.ep
    passes = 1 if pp > 1 else (m if strategy == "zero2" else 2 * m)
    gathered = passes * local * half
    add("all_gather", "experts of this rank (their FSDP units)", "efsdp", n, gathered, passes * stage.layers, True)
    syncs = 1 if pp > 1 or strategy == "zero2" else m
    add("reduce_scatter", "expert gradients", "efsdp", n, syncs * local * 4, syncs * stage.layers, True)


def _replicated(add, spec: ModelSpec, strategy: str, dp: int, psi: int, grads: int, m: int) -> None:
    """DDP (ddp, zero1): bucketed gradient all-reduce, buffer broadcasts; zero1 then gathers the updated parameters."""
    if strategy in ("ddp", "zero1"):
        add(
            "all_reduce",
            "gradients (DDP buckets, once per step)",
            "dp",
            dp,
            grads,
            max(1, math.ceil(grads / DDP_BUCKET)),
            True,
        )
        add(
            "broadcast",
            "module buffers from rank 0 before every forward (DDP broadcast_buffers)",
            "dp",
            dp,
            m * spec.buffer_bytes,
            m,
            False,
        )
    if strategy == "zero1":
        add("all_gather", "updated parameters after the sharded optimizer step", "dp", dp, psi * 4, 1, False)


def _sharded(
    add,
    spec: ModelSpec,
    strategy: str,
    stage: StageShape,
    dp: int,
    shard: int,
    tp: int,
    pp: int,
    m: int,
    psi: int,
    grads: int,
    half: int,
    units: int,
) -> None:
    """FSDP (zero2, zero3, hsdp): parameter all-gathers and gradient reduce-scatters per unit, and hsdp's
    all-reduce across replicas."""
    if strategy in ("zero2", "zero3", "hsdp") and pp > 1:
        # Under PP a stage stays gathered for the step and syncs gradients after its last micro-batch only
        # (parallel/apply.py, and torch.distributed.pipelining's FSDP handling).
        group, n = ("dp_shard", shard) if strategy == "hsdp" else ("dp", dp)
        add("all_gather", "stage parameters, once per step", group, n, psi * half, units, True)
        add("reduce_scatter", "gradients, after the last micro-batch", group, n, grads, units, True)
    elif strategy in ("zero2", "zero3", "hsdp"):
        group, n = ("dp_shard", shard) if strategy == "hsdp" else ("dp", dp)
        if strategy == "zero2":
            add("all_gather", "parameters, forward (kept for backward)", group, n, m * psi * half, m * units, True)
        else:  # but the untied embedding, whose backward needs no weight (parallel/fsdp.py)
            embed = 0 if spec.tied or not stage.first else spec.vocab * spec.hidden // tp
            add(
                "all_gather",
                "parameters, forward and again in backward",
                group,
                n,
                m * (2 * psi - embed) * half,
                m * 2 * units,
                True,
            )
        # gradient accumulation (FSDPEngine.no_sync): zero2 keeps whole gradients and reduce-scatters once per
        # step, zero3 every micro-batch; hsdp all-reduces across replicas on the last micro-batch only
        syncs = 1 if strategy == "zero2" else m
        add("reduce_scatter", "gradients", group, n, syncs * grads, syncs * units, True)
    if strategy == "hsdp":  # after the reduce-scatter in the group, in both cases
        add("all_reduce", "gradient shards across replicas", "dp_replicate", dp // shard, grads // shard, units, True)


def _pipeline(add, spec: ModelSpec, stage: StageShape, d, pp: int, m: int, tokens: int) -> None:
    """Point-to-point sends and receives at this stage's boundaries with its neighbours."""
    boundaries = (0 if stage.first else 1) + (0 if stage.last else 1)
    # activations forward and their gradients backward, in the residual stream's dtype (fp32 under autocast)
    add(
        "p2p",
        "activations and their gradients between stages",
        "pp",
        pp,
        m * boundaries * 2 * tokens * spec.hidden * d.stream,
        m * boundaries * 2,
        False,
    )


def _context_parallel(add, spec: ModelSpec, stage: StageShape, d, m: int, tokens: int, choice: str) -> None:
    """parallel/context.py, per block: ulysses all-to-alls q, k, v and the attention output (forward, and their
    gradients backward); ring (parallel/ring.py) passes k and v on cp - 1 times in forward and again in backward,
    with the fp32 dk and dv cp times; allgather gathers the whole sequence's k and v (reduce-scattering their
    gradients). Point-to-point bytes count what a rank sends and what it receives.
    q and k leave the rotary embedding in the residual stream's dtype (its cos and sin are: fp32 under
    autocast), v and the attention output in the compute dtype. Once per forward the position ids (int64) of
    the whole sequence are gathered for the masks."""
    kv = spec.kv_heads * spec.head_dim // stage.tp  # k's width, and v's
    local = tokens // stage.cp
    add("all_gather", "cp: the whole sequence's position ids (masks)", "cp", stage.cp, m * tokens * 8, m, False)
    scheme = stage.cp_scheme(spec, choice)
    if scheme == "ring":
        kv_bytes = kv * local * (d.stream + d.compute)
        grads = 2 * kv * local * 4
        per_block = 2 * (2 * (stage.cp - 1) * kv_bytes + stage.cp * grads)  # sent and received
        calls = 2 * 2 * (2 * (stage.cp - 1) + stage.cp)
        add(
            "p2p",
            "cp: k, v (and their gradients) around the ring per block",
            "cp",
            stage.cp,
            m * stage.layers * per_block,
            m * stage.layers * calls,
            False,
        )
        return
    if scheme == "ulysses":
        per_block = (spec.hidden // stage.tp + kv) * local * (d.stream + d.compute) * 2  # forward and backward
        add(
            "all_to_all",
            "cp: q, k, v and attention output per block",
            "cp",
            stage.cp,
            m * stage.layers * per_block,
            m * stage.layers * 8,
            False,
        )
        return
    whole = kv * tokens * (d.stream + d.compute)
    add(
        "all_gather",
        "cp: the whole sequence's k and v per block",
        "cp",
        stage.cp,
        m * stage.layers * whole,
        m * stage.layers * 2,
        False,
    )
    add(
        "reduce_scatter",
        "cp: k and v gradients per block",
        "cp",
        stage.cp,
        m * stage.layers * whole,
        m * stage.layers * 2,
        False,
    )


def moe_layers(spec: ModelSpec) -> int:
    """The blocks whose MLP is a mixture of experts (DeepSeek-V3 keeps its first 3 dense)."""
    if not spec.experts or not spec.expert_mlp:
        return 0
    return spec.expert_params // (3 * spec.hidden * spec.expert_mlp * spec.experts)


def _tensor_parallel(add, spec: ModelSpec, stage: StageShape, d, tp: int, m: int, tokens: int) -> None:
    fwd, bwd = TP_ALL_REDUCES["forward"], TP_ALL_REDUCES["backward"]
    # a MoE block's MLP is its experts, split whole over the TP ranks and reached by the dispatch's all-to-alls
    # (_expert_dispatch), not all-reduced: such a block has only attention's forward and backward all-reduce
    moe = stage.layers * moe_layers(spec) // spec.layers
    per_token = spec.hidden * ((fwd * d.compute + bwd * d.stream) * stage.layers - (d.compute + d.stream) * moe)
    add(
        "all_reduce",
        f"activations: {fwd} forward + {bwd} backward per block (MoE blocks 1 + 1)",
        "tp",
        tp,
        m * tokens * per_token,
        m * ((fwd + bwd) * stage.layers - 2 * moe),
        False,
    )
    # vocabulary parallel (parallel/tensor.py): the sharded embedding's fp32 output, the LM head's input
    # gradient, and loss_parallel's per-token max, sum of exponentials and target logit
    vocab = (tokens * spec.hidden * 4 if stage.first else 0) + (tokens * (spec.hidden * 4 + 12) if stage.last else 0)
    if vocab:
        add(
            "all_reduce",
            "vocabulary-parallel embedding, head and loss",
            "tp",
            tp,
            m * vocab,
            m * (int(stage.first) + 4 * int(stage.last)),
            False,
        )


def _host_copies(psi: int, shard: int, m: int, units: int) -> Collective:
    shard_bytes = psi * 4 // max(shard, 1)
    return Collective(
        "host_copy",
        "parameter shards to the GPU (forward, backward), gradients back",
        "host",
        1,
        m * 3 * shard_bytes,
        m * 3 * units,
    )


def _timed(out: list[Collective], cluster: Cluster, strategy: str, dp: int, shard: int, tp: int, pp: int):
    for c in out:
        c.wire = _wire(c.kind, c.ranks, c.payload)
        bandwidth, latency = link(cluster, c.group, tp, shard if strategy == "hsdp" else dp, dp, pp, c.ranks)
        c.seconds = c.calls * latency + c.wire / bandwidth
    return out


def _master_weight_collectives(spec: ModelSpec, strategy: str, dp: int, psi: int, m: int) -> list[Collective]:
    """engines/master_weights.py: bf16 gradients all-reduced by DDP (zero1) or reduced to each parameter's
    owner on the last micro-batch (zero2, one call per parameter), then each owner broadcasts its updated
    bf16 parameters (one flat call per rank)."""
    grads = 2 * psi
    if strategy == "zero1":
        out = [
            Collective(
                "all_reduce",
                "bf16 gradients (DDP buckets, once per step)",
                "dp",
                dp,
                grads,
                max(1, math.ceil(grads / DDP_BUCKET)),
                overlapped=True,
            )
        ]
        if spec.buffer_bytes:
            out.append(
                Collective(
                    "broadcast",
                    "module buffers from rank 0 before every forward (DDP broadcast_buffers)",
                    "dp",
                    dp,
                    m * spec.buffer_bytes,
                    m,
                )
            )
    else:
        out = [
            Collective(
                "reduce", "bf16 gradients to their owner rank", "dp", dp, grads, spec.layers * 9 + 3, overlapped=True
            )
        ]
    out.append(Collective("all_gather", "updated bf16 parameters, broadcast by their owners", "dp", dp, 2 * psi, dp))
    return out


def link(cluster: Cluster, group: str, tp: int, shard: int, dp: int, pp: int, ranks: int = 1) -> tuple[float, float]:
    """(bytes/s, latency) of the slowest link a group's ring crosses (`dp` counts the cp ranks with the dp ranks:
    both average gradients; cp lies next to tp). The expert group (its `ranks`: ep x tp) is the ep innermost
    data-parallel ranks with their TP ranks (layout.py); efsdp strides over them, across the shard."""
    if group == "host":
        return cluster.host
    spans = {"tp": tp, "cp": tp * ranks, "dp_shard": tp * shard, "dp": tp * dp, "dp_replicate": tp * dp}
    spans.update(experts=ranks, efsdp=tp * shard)
    span = spans.get(group, tp * dp * pp)  # pp
    return cluster.intra if span <= cluster.gpus_per_node else cluster.inter
