"""Apply the parallel techniques to a model in one fixed order, each a function that takes a module
and returns it.

Order matters and is the same everywhere (as in torchtitan):
  -  LoRA adapters and the chunked-loss head (parallel/loss.py) change the model itself, first
  0. pipeline split    - keeps this rank's stages and drops the rest of the model
  1. tensor parallel   - rewrites Linear weights into DTensor shards; must see the plain model
     context parallel  - attention across the cp ranks (parallel/context.py): after TP set the heads a rank has
  2. activation ckpt   - wraps whole blocks, so it goes after TP changed their insides
  3. compile           - compiles the wrapped blocks
  4. data parallel     - outermost: FSDP shards or DDP replicates whatever the blocks now are
Under a pipeline, steps 1-4 apply to each stage, which is then a model of its own. All of it
happens on the layout's DeviceMesh (pp, dp_replicate, dp_shard, cp, tp); the engine that comes out
only steps (accumulation, clipping, the optimizer, metrics).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from meshlm.config import Config, lora_on, nf4_base
from meshlm.engines.base import Engine, EngineOptions
from meshlm.engines.fsdp import FSDPEngine
from meshlm.layout import Layout, Mesh
from meshlm.models.families import family, transformer_blocks
from meshlm.models.materialize import InitialWeights, materialize, on_meta
from meshlm.parallel.fsdp import apply_fsdp, mixed_precision_policy
from meshlm.runtime import Runtime, log

Fill = Callable[..., None]  # models/materialize.py materialize(model, init, device, pretrained)


def _initial_weights(model, cfg: Config, frozen: bool) -> InitialWeights | None:
    """The seeded initial weights' twin of a meta-device model (fp32), then the frozen base in its storage dtype
    (parallel/lora.py cast_base: after the twin, so the base is the fp32 one rounded)."""
    if not lora_on(cfg.lora):
        return InitialWeights.of(model, cfg.seed) if on_meta(model) else None
    from meshlm.parallel import lora

    init = InitialWeights.of(model, cfg.seed, lora.initial_value) if on_meta(model) else None
    if not frozen:
        lora.cast_base(model, cfg)
        if nf4_base(cfg.lora):
            from meshlm.parallel import nf4

            nf4.quantize_model(model, cfg)  # NF4 block projections, filled with the rest
    return init


@dataclass(frozen=True)
class Standins:
    """The two steps of `parallelize` that read or write values, as one seam: `fill` fills this rank's part of a
    meta-device model (materialize's signature) and `ddp` is the class that replicates a module. Training uses
    the defaults (TRAINING); `meshlm plan --simulate` passes its fake-tensor stand-ins (plan/simulate_standins.py
    SIMULATED), and nothing else of training is replaced (docs/plan.md)."""

    fill: Fill = materialize
    ddp: type[DDP] = DDP


TRAINING = Standins()


def _trained_parts(model, cfg: Config, rt: Runtime, layout: Layout) -> None:
    """What only a trained model has, in place: LoRA's adapters first (every technique after treats them as parts
    of their blocks), float8's linears, the chunked loss."""
    if lora_on(cfg.lora):
        from meshlm.parallel.lora import apply_lora

        apply_lora(model, cfg)
    _float8(model, cfg, rt, layout)
    chunked_loss(model, cfg, layout)


def parallelize(model, cfg: Config, rt: Runtime, layout: Layout, standins: Standins = TRAINING, frozen=False) -> Engine:
    """`model` (on the meta device, or real) split as `layout` says, filled with this rank's weights (`standins`),
    inside the engine `layout.engine` names. frozen: a model that never trains (DPO's reference,
    objectives/dpo.py): the same split and shards, no adapters, no gradients, and nothing that only keeps
    replicas' updates equal (DDP, ZeRO-1, master weights: the plain engine instead)."""
    ddp = standins.ddp
    if frozen:
        model.requires_grad_(False)
    else:
        _trained_parts(model, cfg, rt, layout)
    # A model on the meta device gets its weights once this rank's part is known (`fill`), before any
    # wrapper that needs real tensors (DDP broadcasts them) and after FSDP, which shards on meta.
    init = _initial_weights(model, cfg, frozen)
    fill = partial(_fill, standins.fill, model, init, cfg, rt)
    kind = "single" if frozen and layout.engine in ("masters", "zero1", "ddp") else layout.engine
    if kind == "layer-split":
        from meshlm.engines.layer_split import LayerSplitEngine, LayerSplitOptions

        # blocks change in place, then are allocated on their devices
        model = compile_blocks(activation_checkpointing(model, cfg), cfg)
        engine = LayerSplitEngine(model, layout, rt, LayerSplitOptions.of(cfg))
        fill()
        return engine
    mesh = layout.mesh(rt.device.type)  # the engines read the same (cached) mesh
    if kind == "masters":  # bf16 zero1/zero2: fp32 masters sharded by owner
        from meshlm.engines.master_weights import MasterWeightEngine

        model = compile_blocks(activation_checkpointing(model, cfg), cfg)
        fill()
        return MasterWeightEngine(model, layout, rt, EngineOptions.of(cfg), ddp=ddp)
    if kind == "pipeline":
        return _pipeline(model, cfg, rt, layout, mesh, fill, ddp)

    model = tensor_parallel(model, cfg, mesh)  # 1.
    model = context_parallel(model, cfg, layout, mesh)
    model = expert_parallel(model, cfg, mesh)  # 1b. after TP: its MoE blocks' inputs come from TP's layers
    model = activation_checkpointing(model, cfg)  # 2.
    model = compile_blocks(model, cfg)  # 3.
    if kind == "fsdp":  # 4. FSDP shards the meta model; then each rank fills only its shards
        engine = FSDPEngine(data_parallel(model, cfg, rt, layout, mesh), layout, rt, EngineOptions.of(cfg))
        fill()
        return engine
    fill()  # 4. DDP and DataParallel start from real weights
    if kind == "dp":  # single-process nn.DataParallel: its own wrap, on every step
        from meshlm.engines.dp import DataParallelEngine

        return DataParallelEngine(model, layout, rt, EngineOptions.of(cfg))
    wrapped = data_parallel(model, cfg, rt, layout, mesh, ddp=ddp)
    if kind == "single":  # one rank, tensor parallel alone, or a frozen model: nothing to replicate
        return Engine(wrapped, layout, rt, EngineOptions.of(cfg))
    if kind == "zero1":
        from meshlm.engines.zero1 import ZeroOneEngine

        return ZeroOneEngine(wrapped, layout, rt, EngineOptions.of(cfg))
    from meshlm.engines.ddp import DDPEngine, DDPOptions

    return DDPEngine(wrapped, layout, rt, DDPOptions.of(cfg))


def _float8(model, cfg: Config, rt: Runtime, layout: Layout) -> None:
    """--float8: torchao's Float8Linear in place of the Linear layers, before TP or FSDP wrap them."""
    if cfg.float8 == "off":
        return
    from meshlm.parallel import float8

    float8.check(cfg.float8, rt.device, cfg.parallel.sequence_parallel)
    n = float8.convert(model, cfg.float8, fsdp=layout.sharded, tp=layout.tp)
    where = "" if rt.device.type == "cuda" else " (torch's CPU float8 matmul: slower than fp32, for its numerics)"
    log.info(f"float8 ({cfg.float8}): {n} Linear layers compute in float8{where}")


def _fill(fill: Fill, model, init: InitialWeights | None, cfg: Config, rt: Runtime) -> None:
    """This rank's weights (seeded init or --pretrained safetensors) for a model still on the meta device."""
    if init is not None:
        fill(
            model,
            init,
            torch.device("cpu") if cfg.cpu_offload else rt.device,
            cfg.model_name if cfg.pretrained else None,
        )


def _pipeline(model, cfg: Config, rt: Runtime, layout: Layout, mesh: Mesh, fill, ddp: type[DDP]) -> Engine:
    """0. this rank's stages, then 1-4 on each stage."""
    from meshlm.engines.pipeline import PipelineEngine, PipelineOptions
    from meshlm.models.families import router_class, tied
    from meshlm.parallel.aux_loss import RouterCarry
    from meshlm.parallel.pipeline import split_for_rank

    model_tied = tied(model)
    stages = split_for_rank(model, cfg, mesh["pp"].get_local_rank())
    tensor_parallel(model, cfg, mesh, runs=[s.layer_ids for s in stages])
    context_parallel(model, cfg, layout, mesh)  # the stages hold the model's own attention modules
    expert_parallel(model, cfg, mesh)
    stages = [compile_blocks(activation_checkpointing(s, cfg), cfg) for s in stages]
    carried = [RouterCarry(s) if router_class(model) else s for s in stages]  # MoE: routers' statistics
    fsdp_stages = layout.sharded  # FSDP shards on meta; DDP broadcasts real weights
    if not fsdp_stages:
        fill()
    modules = [data_parallel(s, cfg, rt, layout, mesh, pipeline_stage=True, ddp=ddp) for s in carried]
    if fsdp_stages:
        fill()
    return PipelineEngine(model, stages, modules, layout, rt, PipelineOptions.of(cfg), model_tied)


def tensor_parallel(model, cfg: Config, mesh: Mesh | None, runs=None):
    """Under a pipeline (runs given) the last stage gathers its logits; alone, the loss runs on vocabulary-
    sharded ones (engine.loss_context)."""
    if mesh is not None and mesh.degrees.tp > 1:
        from meshlm.parallel.tensor import apply_tp

        apply_tp(model, mesh["tp"], cfg.parallel.sequence_parallel, runs, sharded_logits=runs is None)
    return model


def chunked_loss(model, cfg: Config, layout: Layout) -> None:
    """The LM head computes the loss over chunks of tokens where --chunked-loss says (parallel/loss.py). Not
    under nn.DataParallel (its replicas each get part of the batch, not the head's targets) or layer split
    (it computes the loss of row chunks itself)."""
    if layout.engine in ("dp", "layer-split") or cfg.objective != "sft":  # DPO reads log-probabilities: whole logits
        return
    from meshlm.parallel.loss import apply_chunked_loss, chunk_tokens

    head = model.get_output_embeddings()
    tokens = cfg.micro_batch_size * cfg.seq_length // layout.cp
    if layout.pp_enabled:
        from meshlm.parallel.pipeline import micro_batches

        tokens //= micro_batches(cfg)
    if not isinstance(head, torch.nn.Linear):
        return
    fused_hidden = head.in_features if layout.tp == 1 else 0  # under tp the chunks are checkpointed, not fused
    chunk = chunk_tokens(cfg.chunked_loss, head.out_features // layout.tp, tokens, fused_hidden)
    if apply_chunked_loss(model, chunk) is not None:
        how = f"over chunks of {chunk} tokens (of {tokens})" if chunk < tokens else f"of its {tokens} tokens at once"
        skipped = ", positions without a target skipped" if fused_hidden else ""
        # an internal detail, logged before the run's log file opens: debug, so the console opens with the header
        log.debug(f"chunked loss: the LM head computes the loss {how}{skipped}")


def context_parallel(model, cfg: Config, layout: Layout, mesh: Mesh | None):
    if layout.cp_enabled:
        from meshlm.parallel.context import apply_cp

        scheme = apply_cp(model, mesh["cp"].get_group(), cfg.parallel.cp_attention, layout.tp)
        log.info(f"context parallel: each sequence split over {layout.cp} ranks, attention by {scheme}")
    return model


def expert_parallel(model, cfg: Config, mesh: Mesh | None):
    """A mixture of experts under expert or tensor parallel: whole experts per rank of the expert group (ep
    data-parallel ranks x the tp ranks), tokens dispatched to them (parallel/expert.py)."""
    if mesh is None or family(model.config).experts is None:  # no experts: parallel/expert.py is not imported
        return model
    if mesh.degrees.tp > 1 or mesh.degrees.ep > 1:
        from meshlm.parallel.expert import apply_experts

        group = mesh["experts"] if mesh.degrees.ep > 1 else mesh["tp"]
        apply_experts(model, group, mesh["tp"], cfg.parallel.sequence_parallel)
    return model


def activation_checkpointing(model, cfg: Config):
    if cfg.activation_checkpointing == "none":  # parallel/checkpointing.py imported only when chosen
        return model
    from meshlm.parallel.checkpointing import apply_activation_checkpointing

    wrapped = apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if wrapped:
        log.info(
            f"activation checkpointing: {wrapped} of {len(transformer_blocks(model))} blocks "
            f"recompute their activations in backward"
        )
    return model


def compile_blocks(model, cfg: Config):
    if cfg.compile:
        from meshlm.parallel.compiling import apply_compile

        log.info(
            f"compile: {apply_compile(model)} blocks compiled with torch.compile (the first step includes "
            f"compiling them)"
        )
    return model


def data_parallel(
    module, cfg: Config, rt: Runtime, layout: Layout, mesh: Mesh | None, pipeline_stage: bool = False, ddp=DDP
):
    """The one data-parallel wrap, for the whole model and for each pipeline stage: FSDP shards it over the
    data-parallel part of the mesh (also on one rank, where only offload and the bf16 policy act), DDP
    replicates it; as is when there is nothing to replicate."""
    if mesh is None or (pipeline_stage and not layout.averages):
        return module
    trains = any(p.requires_grad for p in module.parameters())  # else a frozen model: DPO's reference
    if layout.sharded:
        # context-parallel ranks shard the states as well (torchtitan's dp_shard_cp)
        shard = "dp_shard_cp" if layout.cp_enabled else "dp_shard"
        dp_mesh = mesh.world["dp_replicate", shard] if layout.hybrid else mesh[shard]
        # zero2 keeps gathered parameters from forward to backward. So does a pipeline stage: it runs forward
        # on every micro-batch before their backwards, and resharding after each forward would all-gather
        # the same parameters M times (torchtitan keeps them gathered too). A frozen model has no backward to
        # keep them for: kept, they would stay gathered for good.
        reshard = not trains or (layout.reshards_after_forward and not pipeline_stage)
        return apply_fsdp(
            module,
            dp_mesh,
            reshard_after_forward=reshard,
            offload=layout.offload,
            mp_policy=mixed_precision_policy(layout.precision),
            experts_mesh=mesh["efsdp"] if layout.ep > 1 else None,
            experts_divide=layout.degrees.dp_cp,
        )
    if layout.replicated and trains:  # frozen replicas stay equal without DDP
        from meshlm.parallel.ddp import replicate

        if nf4_base(cfg.lora):
            from meshlm.parallel import nf4

            nf4.ddp_ignore(module)
        return replicate(module, cfg.sync_batchnorm, rt.device, mesh["dp_cp"].get_group(), ddp)
    return module
