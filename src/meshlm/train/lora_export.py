"""A LoRA run's checkpoint as a model: the base the run trained on, plus its adapters.

A LoRA checkpoint holds the adapters only (parallel/lora.py), so the base is rebuilt
the way training built it (--seed for the built-in model's random init, or the
pretrained weights of --model-name), checked against the digest the checkpoint
recorded, and wrapped by peft's `get_peft_model` with the run's LoRA settings; the
adapters then load by name (peft keeps the paths training used). From there peft
does the rest: `merge_and_unload` for a merged transformers model (what `meshlm
export` writes by default and what `meshlm generate --checkpoint` runs, in every
mode), `save_pretrained` for an adapter directory `PeftModel.from_pretrained` loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from meshlm import config as config_mod
from meshlm.errors import MeshlmError
from meshlm.models.build import build_model, fingerprint, load_tokenizer
from meshlm.models.fused import join_fused
from meshlm.models.materialize import InitialWeights, materialize
from meshlm.parallel import lora
from meshlm.train import safe_load


def _base_on_meta(step_dir: Path, trust_remote_code: bool):
    """(the run's base on the meta device, checked against the checkpoint; the run's config; tokenizer).
    trust_remote_code comes from the caller's command line, never from the run's config.toml."""
    cfg = config_mod.load(str(step_dir.parent.parent / "config.toml"))  # as trained: pretrained flag included
    cfg.trust_remote_code = trust_remote_code
    tokenizer, _ = load_tokenizer(cfg)
    base = build_model(cfg, tokenizer, "meta")  # filled as training fills it: name-seeded init or the safetensors
    saved = json.loads((step_dir / "trainer.json").read_text()).get("fingerprint", {})
    mine = fingerprint(base) | lora.base_fingerprint(cfg)
    if saved != mine:
        raise MeshlmError(
            f"LoRA checkpoint {step_dir} was trained on another base model ({saved} vs {mine}); "
            f"its run's config.toml must name the base it was trained on"
        )
    return base, cfg, tokenizer


def adapted_on_meta(step_dir: Path, trust_remote_code: bool = False) -> torch.nn.Module:
    """The run's base with its adapters injected as training injects them, on the meta device: split it
    (tp, pp, layer split), then `fill_merged` with `InitialWeights.of(model, seed, lora.initial_value)`."""
    model, cfg, _ = _base_on_meta(step_dir, trust_remote_code)
    return lora.apply_lora(model, cfg)


def fill_merged(model: torch.nn.Module, init: InitialWeights, step_dir: Path, device) -> None:
    """This rank's part of a split `adapted_on_meta` model: its base slices as training made them, its
    adapters (or their tensor-parallel shards) read by DCP, then each adapter merged into its base weight
    by peft (in place, shard by shard), so the model computes what `merged_model` computes."""
    from peft.tuners.lora import LoraLayer

    cfg = config_mod.load(str(step_dir.parent.parent / "config.toml"))
    materialize(model, init, device, cfg.model_name if cfg.pretrained else None)
    state = {"model": {k: v for k, v in model.state_dict().items() if lora.is_adapter(k)}}
    safe_load.load_step(state, step_dir)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoraLayer):
                m.merge()


def peft_model(step_dir: Path, trust_remote_code: bool = False):
    """(PeftModel with the checkpoint's adapters, the run's config, tokenizer) on the CPU, in float32.
    trust_remote_code comes from the caller's command line, never from the run's config.toml."""
    from peft import get_peft_model

    base, cfg, tokenizer = _base_on_meta(step_dir, trust_remote_code)
    materialize(base, InitialWeights.of(base, cfg.seed), "cpu", cfg.model_name if cfg.pretrained else None)
    with torch.random.fork_rng(devices=[]):  # peft's random init of A is overwritten by the checkpoint
        model = get_peft_model(base, lora.peft_config(cfg, base), adapter_name=lora.ADAPTER)
    inner = model.get_base_model()  # the injected model: same paths as in training
    state = {"model": {k: v for k, v in inner.state_dict().items() if lora.is_adapter(k)}}
    safe_load.load_step(state, step_dir)  # the restricted unpickler; 'corrupt' only when it is
    inner.load_state_dict(state["model"], strict=False)
    return model, cfg, tokenizer


def merged_model(step_dir: Path, trust_remote_code: bool = False) -> torch.nn.Module:
    """The base with the adapters folded into its weights: a plain transformers model."""
    model, _, _ = peft_model(step_dir, trust_remote_code)
    merged = model.merge_and_unload()
    merged.config.use_cache = True  # training turned the KV cache off; generation wants it
    return merged


def write(step_dir: Path, tmp: Path, adapter_only: bool, trust_remote_code: bool = False) -> None:
    """Write the merged model (or, with adapter_only, the adapter directory) and the tokenizer into tmp."""
    model, _, tokenizer = peft_model(step_dir, trust_remote_code)
    if adapter_only:
        model.save_pretrained(tmp)  # adapter_config.json + adapter_model.safetensors
    else:
        join_fused(model.merge_and_unload()).save_pretrained(tmp)  # Phi-3's parts: its fused projections again
    tokenizer.save_pretrained(tmp)
