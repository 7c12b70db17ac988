"""What to generate with: an exported transformers directory (or hub id), or a meshlm training checkpoint.

A meshlm checkpoint is `checkpoints/step-N/state/`, a DCP directory written by
any training layout (DDP, FSDP, TP, PP) with the model under keys `model.*`.
DCP reshards on load: `--mode dp` reads it into a plain, unsharded model; tp, pp
and layer split read into the split model's own state dict, so each rank reads
only its DTensor shards or its stage's tensors. The run directory's config.toml
says which model was trained.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

from meshlm.config import Config
from meshlm.errors import MeshlmError
from meshlm.models.build import build_model, load_tokenizer, model_config
from meshlm.models.families import attention
from meshlm.models.materialize import InitialWeights, materialize
from meshlm.train import safe_load
from meshlm.train.export import check_fingerprint, find_checkpoint, load_weights, run_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelSource:
    model_name: str = ""
    checkpoint: str = ""
    tokenizer_name: str = ""
    trust_remote_code: bool = False
    dtype: str = "float32"


@dataclass
class ModelInfo:
    """Everything about the model that is known without reading its weights."""

    cfg: Config  # model_name / tokenizer / arch keys as training or the command line gave them
    model_config: object  # the transformers config
    tokenizer: object
    step_dir: Path | None  # the checkpoint to load, for meshlm checkpoints


def model_info(src: ModelSource) -> ModelInfo:
    """Check the model source and read its config and tokenizer (cheap: no weights)."""
    if src.dtype not in DTYPES:
        raise MeshlmError(f"--dtype must be one of {', '.join(DTYPES)}, got {src.dtype!r}")
    if bool(src.model_name) == bool(src.checkpoint):
        raise MeshlmError(
            "give exactly one of --model-name (a transformers directory or hub id) "
            "and --checkpoint (a meshlm run or checkpoints/step-N directory)"
        )
    step = None
    if src.checkpoint:
        path = Path(src.checkpoint)
        if not path.is_dir():
            raise MeshlmError(f"checkpoint directory {src.checkpoint} does not exist")
        step, run = find_checkpoint(path)
        if not (run / "config.toml").is_file():
            raise MeshlmError(
                f"checkpoint {step}: its run directory {run} has no config.toml to say which model "
                f"was trained; pass the checkpoint inside its run directory"
            )
        cfg = run_config(run, src.trust_remote_code)  # the weights come from the checkpoint
        if src.tokenizer_name:
            cfg.tokenizer_name = src.tokenizer_name
    else:
        cfg = Config(
            model_name=src.model_name,
            tokenizer_name=src.tokenizer_name,
            pretrained=True,
            trust_remote_code=src.trust_remote_code,
        )
    tokenizer, _ = load_tokenizer(cfg)
    return ModelInfo(cfg, model_config(cfg, len(tokenizer)), tokenizer, step)


def load_model(
    res: ModelInfo, dtype: str = "float32", device: torch.device | str = "cpu", meta: bool = False
) -> torch.nn.Module:
    """The whole model in eval mode on `device`: transformers weights, or a checkpoint read with DCP.
    meta: no weights are read yet; the model is on the meta device, to be split and then given only this
    rank's slices by `load_slices`."""
    model = _load(res, dtype, device, meta)
    # A mixture of experts whose config asks for its router loss would compute it in every decoding forward
    # (and transformers' own mis-shapes it against a padded batch's attention mask under a KV cache).
    model.config.output_router_logits = False
    return model


def _load(res: ModelInfo, dtype: str, device: torch.device | str, meta: bool) -> torch.nn.Module:
    if meta and res.step_dir is None:
        return build_model(replace(res.cfg, seq_length=1), res.tokenizer, "meta")  # generate checks its lengths
    if meta and res.cfg.lora.r:  # the base as training built it, adapters injected: merged once filled
        from meshlm.train.lora_export import adapted_on_meta

        return adapted_on_meta(res.step_dir, res.cfg.trust_remote_code)
    if meta:  # a checkpoint's model as its run built it, checked against it before anything is read
        model = build_model(res.cfg, res.tokenizer, "meta")
        check_fingerprint(model, res.step_dir)
        return model
    if res.step_dir is not None and res.cfg.lora.r:  # a LoRA run: its base with the adapters merged in
        from meshlm.train.lora_export import merged_model

        model = merged_model(res.step_dir, res.cfg.trust_remote_code)
    elif res.step_dir is not None:
        # Built on the CPU, not the meta device: non-persistent buffers (rotary inv_freq) need their values.
        model = build_model(res.cfg, res.tokenizer, "cpu")
        load_weights(model, res.step_dir)
    else:
        transformers.utils.logging.disable_progress_bar()  # rank 0's summary is the progress report
        try:
            model = AutoModelForCausalLM.from_pretrained(
                res.cfg.model_name,
                dtype=DTYPES[dtype],
                trust_remote_code=res.cfg.trust_remote_code,
                attn_implementation=attention(res.model_config),
            )
        except (OSError, ValueError) as e:
            raise MeshlmError(
                f"could not load weights from {res.cfg.model_name!r}: {str(e).strip().splitlines()[0]}"
            ) from None
    return model.to(device=device, dtype=DTYPES[dtype]).eval()


def lora_run(res: ModelInfo) -> bool:
    return res.step_dir is not None and bool(res.cfg.lora.r)


def per_shard(res: ModelInfo, mode: str) -> bool:
    """Whether each rank reads only its part: in tp, pp and layer split, but for a LoRA run under tp on a
    family whose projections are not nn.Linear (GPT-2's Conv1D), which LoRA cannot shard (parallel/lora.py):
    that one is read whole, merged, then split as a plain model."""
    if mode == "dp":
        return False
    if mode != "tp" or not lora_run(res):
        return True
    from meshlm.models.families import LINEAR_STYLES, tp_plan
    from meshlm.parallel.lora import targets

    adapted = set(targets(res.cfg, res.model_config))
    plan = tp_plan(res.model_config)
    return all(style in LINEAR_STYLES for path, style in plan.items() if path.rsplit(".", 1)[-1] in adapted)


def initial_weights(model: torch.nn.Module, res: ModelInfo) -> InitialWeights:
    """The unsplit meta skeleton (rotary buffers, ties); for a LoRA run also what fills its base and adapters
    as training filled them (the seeded init, parallel/lora.py's initial values)."""
    if lora_run(res):
        from meshlm.parallel import lora

        return InitialWeights.of(model, res.cfg.seed, lora.initial_value)
    return InitialWeights.of(model, 0)


def load_slices(model: torch.nn.Module, init: InitialWeights, res: ModelInfo, device) -> torch.nn.Module:
    """This rank's part of a split meta-device model, in tensors already of --dtype (generate casts them on
    the meta device: a cast after loading held the part twice, in float32 and in --dtype). From --model-name:
    read per slice from its safetensors. From a checkpoint: DCP reads into the split model's state dict
    (DTensors under tp: only the local shard; under pp: only this stage's names), in this process alone."""
    if res.step_dir is None:
        materialize(model, init, device, res.cfg.model_name)
    elif lora_run(res):  # the base's slices as training made them, the adapters read by DCP, merged by peft
        from meshlm.train.lora_export import fill_merged

        fill_merged(model, init, res.step_dir, device)
    else:
        materialize(model, init, device, computed_only=True)  # allocated; rotary buffers computed
        safe_load.load_step({"model": model.state_dict()}, res.step_dir)
    model.config.use_cache = True
    return model.eval()


def eos_ids(model, tokenizer, from_checkpoint: bool) -> list[int]:
    """Tokens that end a sequence: the tokenizer's EOS for meshlm checkpoints (training appends it to every
    text); for transformers models the generation config's, as `generate` uses, else the tokenizer's."""
    eos = None if from_checkpoint else model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]
