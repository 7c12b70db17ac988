"""The run header: what a training run is about to do, in plain words, before its first step.

One line each, in this order: the model and where its weights come from, the layout (named by what runs), the
objective and its settings, LoRA, the data, the global batch and learning rate. A user who forgot --pretrained,
or expected DPO, LoRA or a held-out split, reads it here rather than from the loss curve.
"""

from __future__ import annotations

import dataclasses

from meshlm.config import Config, lora_base_dtype, lora_on, nf4_base
from meshlm.data.load import describe

# --lr's default is a from-scratch rate: fine-tuning pretrained weights at it undoes what they learned
FROM_SCRATCH_LR = next(f.default for f in dataclasses.fields(Config) if f.name == "lr")


def weights(cfg: Config, resumed_from) -> str:
    if resumed_from is not None:
        return f"weights from checkpoint {resumed_from}"
    if cfg.pretrained:
        return f"weights from {cfg.model_name}"
    hint = "; add --pretrained to load its weights" if cfg.model_name else ""
    return f"random initialisation (--seed {cfg.seed}{hint})"


def adapters(cfg: Config, source) -> str:
    """LoRA's rank, targets and how many parameters train, counted on a meta copy of the model with its adapters
    (the trained model may be split over stages by now)."""
    if not lora_on(cfg.lora):
        return "LoRA: off (every parameter trains)"
    from meshlm.parallel import lora

    model = lora.apply_lora(source.on_meta(), cfg)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    targets = ",".join(lora.targets(cfg, model.config))
    return (
        f"LoRA: rank {cfg.lora.r}, alpha {cfg.lora.alpha:g}, targets {targets}; trainable {trainable:,} of "
        f"{total:,} parameters ({trainable / total:.2%}); frozen base {frozen_base(cfg)}"
    )


def frozen_base(cfg: Config) -> str:
    """How the frozen base is stored (--lora.base-dtype, --lora.quantize): what its memory depends on."""
    dtype = lora_base_dtype(cfg.lora.base_dtype, cfg.mixed_precision)
    return f"NF4 block projections, the rest {dtype} (--lora.quantize nf4)" if nf4_base(cfg.lora) else dtype


def data(cfg: Config, blocks, eval_blocks) -> str:
    if hasattr(blocks, "describe"):  # GRPO's prompts (objectives/grpo_data.py)
        return f"data: {blocks.describe()}" + (f"; held out: {len(eval_blocks)} prompts" if eval_blocks else "")
    held = (
        f"held out: {eval_blocks.meta['documents']} documents, {len(eval_blocks)} blocks"
        if eval_blocks is not None
        else "held out: none (--eval-fraction 0)"
    )
    return f"data: {describe(cfg, blocks)}; {held}"


def lr_note(cfg: Config) -> list[str]:
    """A note, not a different default: a default that changed with --pretrained would make the same --lr mean
    two things, and resumed runs' config.toml record the rate either way."""
    if cfg.pretrained and cfg.lr == FROM_SCRATCH_LR:
        return [
            f"note: --pretrained fine-tunes at --lr {cfg.lr:g}, the default for training from scratch; "
            "fine-tuning usually wants 1e-5..1e-4 (LoRA 1e-4..3e-4): set --lr"
        ]
    return []


def lines(trainer) -> list[str]:
    """The header of a Trainer whose setup is done, in the order the module docstring gives."""
    cfg, rt, t = trainer.cfg, trainer.rt, trainer
    fp = t.fingerprint
    return [
        f"model: {cfg.model_name or 'the built-in tiny Llama'} ({fp['model_type']}, "
        f"{fp['parameters'] / 1e6:.2f}M parameters), {weights(cfg, t.checkpoints.resume_from)}",
        f"layout: {t.layout.in_words()}{f' on {rt.world_size} ranks' * (rt.world_size > 1)} "
        f"({rt.backend or 'no process group'}, {rt.device.type}); {t.layout.describe()}; "
        f"attention {t.attention} (--attention {cfg.attention})",
        f"objective: {t.engine.objective.describe(cfg)}",
        adapters(cfg, t.source),
        data(cfg, t.blocks, t.eval_blocks),
        f"global batch {t.global_batch} = micro-batch {cfg.micro_batch_size} x accumulation {cfg.grad_accum} x "
        f"{t.layout.dp} data-parallel ranks; lr {t.lr:g} (scale-lr {cfg.scale_lr})",
        *lr_note(cfg),
    ]
