"""What to generate with: an exported transformers directory (or hub id), or a meshlm training checkpoint.

A meshlm checkpoint is `checkpoints/step-N/state/`, a DCP directory written by
any training layout (DDP, FSDP, TP, PP) with the model under keys `model.*`.
DCP reshards on load: `--mode dp` reads it into a plain, unsharded model; tp, pp
and layer split read into the split model's own state dict, so each rank reads
only its DTensor shards or its stage's tensors. models/source.py loads both kinds
(the run directory's config.toml says which model was trained); this module holds
generate's choice of source and the few things decoding asks of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from meshlm.errors import MeshlmError
from meshlm.models.source import ModelSource

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelChoice:
    """generate's model options: exactly one of --model-name and --checkpoint, and how to read it."""

    model_name: str = ""
    checkpoint: str = ""
    tokenizer_name: str = ""
    trust_remote_code: bool = False
    dtype: str = "float32"
    attention: str = "auto"  # --attention: the kernel the model is built with (models/attention.py)

    def source(self) -> ModelSource:
        """Check the choice and read the model's config and tokenizer (cheap: no weights); the source builds
        with --attention's kernel, checked here (a kernel that cannot run fails before any rank starts)."""
        src = self._source()
        src.cfg.attention = self.attention  # a checkpoint's run may have trained with another: decoding chooses
        self.kernel(src)
        return src

    def kernel(self, src: ModelSource) -> str:
        """transformers' attn_implementation for --attention on this machine (MeshlmError if it cannot run)."""
        from meshlm.models.attention import implementation

        return implementation(self.attention, src.model_config, torch.cuda.is_available(), src.cfg.seq_length)

    def _source(self) -> ModelSource:
        if self.dtype not in DTYPES:
            raise MeshlmError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if bool(self.model_name) == bool(self.checkpoint):
            raise MeshlmError(
                "give exactly one of --model-name (a transformers directory or hub id) "
                "and --checkpoint (a meshlm run or checkpoints/step-N directory)"
            )
        if self.checkpoint:
            if not Path(self.checkpoint).is_dir():
                raise MeshlmError(f"checkpoint directory {self.checkpoint} does not exist")
            return ModelSource.of_checkpoint(self.checkpoint, self.trust_remote_code, self.tokenizer_name)
        return ModelSource.of_model(self.model_name, self.tokenizer_name, self.trust_remote_code)


def load_model(src: ModelSource, dtype: str = "float32", device: torch.device | str = "cpu", meta: bool = False):
    """The whole model in eval mode on `device` (transformers weights, or a checkpoint read with DCP). meta: no
    weights are read yet; the model is on the meta device, to be split and then given only this rank's slices
    by `load_slices`."""
    if meta:  # a checkpoint's model as its run built it (checked); --model-name's with generate's lengths
        model = src.on_meta(seq_length=1 if src.step_dir is None else None)
    else:
        model = src.whole(DTYPES[dtype], device)
    # A mixture of experts whose config asks for its router loss would compute it in every decoding forward
    # (and transformers' own mis-shapes it against a padded batch's attention mask under a KV cache).
    model.config.output_router_logits = False
    return model


def per_shard(src: ModelSource, mode: str) -> bool:
    """Whether each rank reads only its part: in tp, pp and layer split, but for a LoRA run under tp that adapts
    what the TP plan does not split as nn.Linear (GPT-2's Conv1D, which LoRA cannot shard, parallel/lora.py; a
    mixture of experts' grouped weights, split whole per rank, whose adapters peft merges only whole): that one
    is read whole, merged, then split as a plain model."""
    if mode == "dp":
        return False
    if mode != "tp" or not src.lora:
        return True
    from meshlm.models.families import LINEAR_STYLES, tp_plan
    from meshlm.parallel.lora import targets

    styles: dict[str, set] = {}
    for path, style in tp_plan(src.model_config).items():
        styles.setdefault(path.rsplit(".", 1)[-1], set()).add(style)
    return all(styles.get(name) and styles[name] <= set(LINEAR_STYLES) for name in targets(src.cfg, src.model_config))


def load_slices(model: torch.nn.Module, init, src: ModelSource, device) -> torch.nn.Module:
    """This rank's part of a split meta-device model, in tensors already of --dtype (generate casts them on
    the meta device: a cast after loading held the part twice, in float32 and in --dtype), in this process alone."""
    src.fill(model, init, device)
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
