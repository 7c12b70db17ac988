"""Model states under LoRA as the planner counts them: the adapters' parameters (dense projections and a mixture
of experts' grouped weights) and the frozen base beside them."""

from __future__ import annotations

from meshlm.plan.shape import StageShape
from meshlm.plan.spec import ModelSpec


def lora_params(spec: ModelSpec, r: int, tp: int = 1, targets: tuple[str, ...] = ()) -> int:
    """Adapter parameters of one block on one TP rank on its linear layers (parallel/lora.py: `targets`, or by
    default q/k/v/o and, where the blocks have a dense one, the MLP projections). Column-wise base: A (r x in)
    whole, B (out x r) split; row-wise base: A split, B whole."""
    h, kv = spec.hidden, spec.kv_heads * spec.head_dim
    colwise = [("q_proj", h, h), ("k_proj", h, kv), ("v_proj", h, kv)]  # (name, in, out)
    rowwise = [("o_proj", h, h)]
    if spec.family == "gpt2":  # fused c_attn, c_fc; c_proj twice (attention and MLP)
        colwise, rowwise = [("c_attn", h, 3 * h), ("c_fc", h, spec.mlp)], [("c_proj", h, h), ("c_proj", spec.mlp, h)]
    elif not spec.experts:  # a mixture of experts' MLP is its experts (expert_adapter_params)
        colwise += [("gate_proj", h, spec.mlp), ("up_proj", h, spec.mlp)]
        rowwise += [("down_proj", spec.mlp, h)]
    kept = lambda name: not targets or name in targets  # noqa: E731
    return sum(r * i + r * o // tp for n, i, o in colwise if kept(n)) + sum(
        r * i // tp + r * o for n, i, o in rowwise if kept(n)
    )


def lora_block_adapters(spec: ModelSpec, job, stage: StageShape) -> int:
    """Adapter parameters of one block on this rank under a plan Job's LoRA (plan/job.py): the gradients one FSDP
    unit makes, the frozen base beside them making none."""
    targets = job.lora_target_names
    return lora_params(spec, job.lora_r, stage.tp, targets) + expert_adapter_params(spec, job.lora_r, targets, 1)


# a mixture of experts' grouped weights (transformers' experts module) by name: (in, out) of one expert's matrix
def _expert_weight_widths(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    return {"gate_up_proj": (spec.hidden, 2 * spec.expert_mlp), "down_proj": (spec.expert_mlp, spec.hidden)}


def expert_adapter_params(spec: ModelSpec, r: int, targets: tuple[str, ...], layers: int) -> int:
    """Adapters on the experts' grouped weights of `layers` blocks (--lora.targets gate_up_proj,down_proj: peft's
    target_parameters, an r-wide A and B per expert). Not split by tp or ep: they stay whole in their block,
    sharded by FSDP over every data-parallel rank (parallel/expert.py _local_params)."""
    if not spec.experts or not spec.expert_mlp:
        return 0
    widths = _expert_weight_widths(spec)
    moe_experts = spec.expert_params // (3 * spec.hidden * spec.expert_mlp)  # experts over all MoE layers
    per_expert = sum(r * (i + o) for t, (i, o) in widths.items() if t in targets)
    return moe_experts * per_expert * layers // spec.layers


# --lora.quantize nf4 (parallel/nf4.py): bytes a value, 4-bit codes, an int8 scale per 64, an fp32 factor per 16384
NF4_BYTES = (4 + 8 / 64 + 32 / 16384) / 8
NF4_CHUNK_SCRATCH = (
    (1 << 14) * 2 * (8 + 4 + 4 + 4)
)  # dequantize's chunk (nf4.CHUNK): int64 indices, codes, scales, product


def nf4_projections(spec: ModelSpec) -> tuple[int, int]:
    """(values of one block's NF4 weights, its largest projection's) under --lora.quantize nf4: the block's
    nn.Linear projections, q/k/v/o and the MLP's where it is dense."""
    h, kv = spec.hidden, spec.kv_heads * spec.head_dim
    mats = [h * h, h * kv, h * kv, h * h] + ([] if spec.experts else [h * spec.mlp] * 3)
    return sum(mats), max(mats)


def nf4_dequantised(spec: ModelSpec, half: int) -> int:
    """The one projection dequantised at a time, in the compute dtype, with the chunk's scratch."""
    return nf4_projections(spec)[1] * half + NF4_CHUNK_SCRATCH


def lora_states(
    spec: ModelSpec,
    stage: StageShape,
    strategy: str,
    n: int,
    r: int,
    half: int,
    targets: tuple[str, ...] = (),
    base_bytes: int = 4,
    nf4: bool = False,
) -> dict[str, int]:
    """Model states under LoRA: the frozen base in `base_bytes` a parameter (--lora.base-dtype; no gradients, no
    optimizer states), its blocks' projections in NF4_BYTES under `nf4`, sharded as the layout shards parameters;
    fp32 adapters with fp32 gradients and AdamW states, sharded the same way."""
    base = stage.params(spec)
    quantized = nf4_projections(spec)[0] * stage.layers if nf4 else 0
    adapters = lora_params(spec, r, stage.tp, targets) * stage.layers
    adapters += expert_adapter_params(spec, r, targets, stage.layers)
    shard = 1 if strategy in ("single", "ddp", "zero1") else n
    nf4_bytes = int(quantized * NF4_BYTES)
    if strategy == "zero2":  # gathered fwd to bwd
        frozen = (base - quantized) * half + nf4_bytes
    else:
        frozen = ((base - quantized) * base_bytes + nf4_bytes) // shard
    return {
        "frozen parameters": frozen,
        "adapters": adapters * 4 // shard,
        "gradients": adapters * 4 // (1 if shard == 1 else n),
        "optimizer": adapters * 8 // (n if strategy == "zero1" else shard),
    }


def job_lora_states(spec: ModelSpec, job, stage: StageShape, strategy: str, n: int, half: int) -> dict[str, int]:
    """lora_states of a plan Job (plan/job.py): its rank, targets, base dtype and quantisation."""
    return lora_states(spec, stage, strategy, n, job.lora_r, half, job.lora_target_names, job.lora_base_bytes, job.nf4)
