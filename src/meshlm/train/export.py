"""`meshlm export`: a sharded DCP checkpoint -> a Hugging Face model directory (consolidated
safetensors + config + tokenizer) that `AutoModelForCausalLM.from_pretrained` loads.

Runs in one process without a process group: DCP reads every rank's shards and reassembles
each tensor, whatever layout (ddp, zero1-3, hsdp, tp, ...) wrote the checkpoint.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from meshlm import config as config_mod
from meshlm.errors import MeshlmError
from meshlm.models.build import build_model, fingerprint, load_tokenizer, model_config
from meshlm.models.families import family
from meshlm.train import safe_load
from meshlm.train.checkpoint import MARKER, step_named_by_latest
from meshlm.train.consolidate import write_safetensors


def find_checkpoint(path: Path) -> tuple[Path, Path]:
    """(step-N directory, run directory) for a run directory, its checkpoints/ or a step-N."""
    path = path.expanduser()
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    path = step_named_by_latest(path) or path
    if not (path / "state").is_dir():
        raise MeshlmError(
            f"{path} is not a meshlm checkpoint (no state/ inside); give a run directory, "
            f"its checkpoints/ or a checkpoints/step-N"
        )
    if not (path / MARKER).is_file():
        raise MeshlmError(f"checkpoint {path} is incomplete (no {MARKER} marker); export a complete step-N")
    return path, path.parent.parent


def check_fingerprint(model, step_dir: Path) -> None:
    """One line when the checkpoint is from another model than `model` (built from the run's config.toml,
    on any device: the meta device too)."""
    saved = json.loads((step_dir / "trainer.json").read_text()).get("fingerprint")
    if saved != fingerprint(model):
        raise MeshlmError(
            f"checkpoint {step_dir} is from another model ({saved} vs {fingerprint(model)}); "
            f"its run's config.toml does not describe it"
        )


def load_weights(model, step_dir: Path) -> None:
    """Fill a plain (unsharded) model with a checkpoint's weights, in this process and without a process
    group, whatever layout wrote them. Used by export and by `meshlm generate --checkpoint --mode dp`."""
    check_fingerprint(model, step_dir)
    state = {"model": model.state_dict()}
    safe_load.load_step(state, step_dir)
    model.load_state_dict(state["model"])
    model.config.use_cache = True  # training turned the KV cache off; generation wants it


def run_config(run_dir: Path, trust_remote_code: bool):
    """The config a run was trained with, for rebuilding its model. trust_remote_code comes from the
    caller's command line only: a config.toml from elsewhere must not switch on running the code of
    the model's repository."""
    cfg_file = run_dir / "config.toml"
    if not cfg_file.is_file():
        raise MeshlmError(f"{cfg_file} not found: the run's config.toml must sit next to checkpoints/")
    cfg = config_mod.load(str(cfg_file))
    cfg.pretrained = False  # every weight comes from the checkpoint
    cfg.trust_remote_code = trust_remote_code
    return cfg


def _write_model(cfg, step_dir: Path, tmp: Path) -> None:
    tokenizer, _ = load_tokenizer(cfg)
    # Shapes, names and ties from the config (meta device); the weights stream through one tensor at a time.
    model = build_model(cfg, tokenizer, "meta")
    check_fingerprint(model, step_dir)
    write_safetensors(model, step_dir, tmp)
    model.config.use_cache = True  # training turned the KV cache off; generation wants it
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)


def export(checkpoint: str, out: str, trust_remote_code: bool = False, adapter_only: bool = False) -> Path:
    step_dir, run_dir = find_checkpoint(Path(checkpoint))
    out_dir = Path(out)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise MeshlmError(f"--out {out_dir} exists and is not empty; give a new directory")
    cfg = run_config(run_dir, trust_remote_code)
    if adapter_only and not cfg.lora.r:
        raise MeshlmError(f"--adapter-only exports LoRA adapters, but {run_dir} trained without --lora.r")
    if adapter_only and family(model_config(cfg)).fused:
        raise MeshlmError(
            f"--adapter-only: {run_dir}'s adapters sit on the parts of fused projections (docs/families.md), which "
            f"a PEFT adapter on the fused projection cannot express; export without --adapter-only (merged)"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))  # ours alone to remove
    try:
        if cfg.lora.r:  # adapters on the run's base: merged, or the adapters alone (train/lora_export.py)
            from meshlm.train import lora_export

            lora_export.write(step_dir, tmp, adapter_only, trust_remote_code)
        else:
            _write_model(cfg, step_dir, tmp)
        out_dir.mkdir(exist_ok=True)
        for f in tmp.iterdir():
            f.replace(out_dir / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
