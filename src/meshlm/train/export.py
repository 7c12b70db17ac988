"""`meshlm export`: a sharded DCP checkpoint -> a Hugging Face model directory (consolidated
safetensors + config + tokenizer) that `AutoModelForCausalLM.from_pretrained` loads.

Runs in one process without a process group: DCP reads every rank's shards and reassembles
each tensor, whatever layout (ddp, zero1-3, hsdp, tp, ...) wrote the checkpoint.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from meshlm import config as config_mod
from meshlm.errors import MeshlmError
from meshlm.models.build import build_model, fingerprint, load_tokenizer
from meshlm.train.checkpoint import MARKER
from meshlm.train.consolidate import write_safetensors


def find_checkpoint(path: Path) -> tuple[Path, Path]:
    """(step-N directory, run directory) for a run directory, its checkpoints/ or a step-N."""
    path = path.expanduser()
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if (path / "latest").is_file():
        path = path / (path / "latest").read_text().strip()
    if not (path / "state").is_dir():
        raise MeshlmError(f"{path} is not a meshlm checkpoint (no state/ inside); give a run directory, "
                          f"its checkpoints/ or a checkpoints/step-N")
    if not (path / MARKER).is_file():
        raise MeshlmError(f"checkpoint {path} is incomplete (no {MARKER} marker); export a complete step-N")
    return path, path.parent.parent


def load_weights(model, step_dir: Path) -> None:
    """Fill a plain (unsharded) model with a checkpoint's weights, in this process and without a process
    group, whatever layout wrote them. Used by export and by `meshlm generate --checkpoint`."""
    saved = json.loads((step_dir / "trainer.json").read_text()).get("fingerprint")
    if saved != fingerprint(model):
        raise MeshlmError(f"checkpoint {step_dir} is from another model ({saved} vs {fingerprint(model)}); "
                          f"its run's config.toml does not describe it")
    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # "loading in a single process": that is the point
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(state, checkpoint_id=str(step_dir / "state"), no_dist=True)  # no_dist: also inside a job
    except (Exception, CheckpointException) as e:  # DCP wraps a missing shard file in this BaseException
        msg = str(e).strip().splitlines()
        raise MeshlmError(f"checkpoint {step_dir} cannot be loaded (corrupt or missing shards): "
                          f"{msg[-1] if msg else type(e).__name__}") from None
    model.load_state_dict(state["model"])
    model.config.use_cache = True  # training turned the KV cache off; generation wants it


def export(checkpoint: str, out: str) -> Path:
    step_dir, run_dir = find_checkpoint(Path(checkpoint))
    out_dir = Path(out)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise MeshlmError(f"--out {out_dir} exists and is not empty; give a new directory")
    cfg_file = run_dir / "config.toml"
    if not cfg_file.is_file():
        raise MeshlmError(f"{cfg_file} not found: export needs the run's config next to checkpoints/")
    cfg = config_mod.load(str(cfg_file))
    cfg.pretrained = False  # every weight comes from the checkpoint
    tokenizer, _ = load_tokenizer(cfg)

    # Shapes, names and ties from the config (meta device); the weights stream through one tensor at a time.
    model = build_model(cfg, tokenizer, "meta")
    saved = json.loads((step_dir / "trainer.json").read_text()).get("fingerprint")
    if saved != fingerprint(model):
        raise MeshlmError(f"checkpoint {step_dir} is from another model ({saved} vs {fingerprint(model)}); "
                          f"its run's config.toml does not describe it")
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_safetensors(model, step_dir, tmp)
    model.config.use_cache = True  # training turned the KV cache off; generation wants it
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in tmp.iterdir():
        f.replace(out_dir / f.name)
    tmp.rmdir()
    return out_dir

