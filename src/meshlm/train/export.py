"""`meshlm export`: a sharded DCP checkpoint -> a Hugging Face model directory (consolidated
safetensors + config + tokenizer) that `AutoModelForCausalLM.from_pretrained` loads, and with
--push-to-hub the directory uploaded to a Hub repository by huggingface_hub (its token, its HF_ENDPOINT).

Runs in one process without a process group: DCP reads every rank's shards and reassembles
each tensor, whatever layout (ddp, zero1-3, hsdp, tp, ...) wrote the checkpoint.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from meshlm.checkpoint.consolidate import write_safetensors
from meshlm.errors import MeshlmError
from meshlm.models.families import family
from meshlm.models.fused import join_fused
from meshlm.models.source import ModelSource, find_checkpoint


def _write_model(source: ModelSource, tmp: Path) -> None:
    # Shapes, names and ties from the config (meta device); the weights stream through one tensor at a time.
    model = source.on_meta()
    write_safetensors(model, source.step_dir, tmp)
    model.config.use_cache = True  # training turned the KV cache off; generation wants it
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    source.tokenizer.save_pretrained(tmp)


def _write_lora(source: ModelSource, tmp: Path, adapter_only: bool) -> None:
    """A LoRA run: the base with the adapters merged in (a plain transformers model), or with adapter_only the
    adapter directory PeftModel.from_pretrained loads (adapter_config.json + adapter_model.safetensors)."""
    model = source.peft_model()
    if adapter_only:
        model.save_pretrained(tmp)
    else:
        join_fused(model.merge_and_unload()).save_pretrained(tmp)  # Phi-3's parts: its fused projections again
    source.tokenizer.save_pretrained(tmp)


def export(checkpoint: str, out: str, trust_remote_code: bool = False, adapter_only: bool = False) -> Path:
    step_dir, run_dir = find_checkpoint(Path(checkpoint))
    out_dir = Path(out)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise MeshlmError(f"--out {out_dir} exists and is not empty; give a new directory")
    source = ModelSource.of_checkpoint(str(step_dir), trust_remote_code)
    if adapter_only and not source.lora:
        raise MeshlmError(f"--adapter-only exports LoRA adapters, but {run_dir} trained without --lora.r")
    if adapter_only and family(source.model_config).fused:
        raise MeshlmError(
            f"--adapter-only: {run_dir}'s adapters sit on the parts of fused projections (docs/families.md), which "
            f"a PEFT adapter on the fused projection cannot express; export without --adapter-only (merged)"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))  # ours alone to remove
    try:
        if source.lora:  # adapters on the run's base: merged, or the adapters alone
            _write_lora(source, tmp, adapter_only)
        else:
            _write_model(source, tmp)
        out_dir.mkdir(exist_ok=True)
        for f in tmp.iterdir():
            f.replace(out_dir / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def push_to_hub(out_dir: Path, repo: str) -> str:
    """Upload an export to the Hub repository `repo` (created when missing): the commit's URL. A refusal
    (offline, no token, no permission) is one line; the export stays on disk to push again."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()
    try:
        api.create_repo(repo, exist_ok=True)
        commit = api.upload_folder(folder_path=out_dir, repo_id=repo, commit_message="meshlm export")
    except (HfHubHTTPError, OSError, ValueError) as e:  # OSError: offline mode and connection errors
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MeshlmError(
            f"--push-to-hub {repo}: {reason}; the export is in {out_dir}: push it again (`hf upload {repo} {out_dir}`)"
        ) from None
    return commit.commit_url
