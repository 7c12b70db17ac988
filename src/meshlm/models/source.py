"""Where a model comes from, and the one way to load it: training, export, LoRA export and generate use this.

A source is a training config (the built-in model or --model-name; seeded or --pretrained; with or without
--lora.r), a hub id or model directory (generate --model-name), or a meshlm run's checkpoint (a run directory,
its checkpoints/ or a checkpoints/step-N, with the run's config.toml, read here and nowhere else). Each gives
the model on the meta device (shapes only: split it first), fills one rank's part of it (name-seeded init,
per-slice safetensors reads, or DCP reads of the checkpoint: a rank reads only its shards), or loads it whole;
a checkpoint is checked against the model it claims to hold (`check_fingerprint`, the one check, also
resuming's). A LoRA checkpoint holds adapters only: its base is rebuilt as the run built it, the adapters
read by name, and peft merges them (per shard when split).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from meshlm.checkpoint import integrity
from meshlm.checkpoint.integrity import MARKER, step_named_by_latest
from meshlm.config import Config, lora_on, nf4_base
from meshlm.config import load as load_config
from meshlm.errors import MeshlmError
from meshlm.models.attention import implementation
from meshlm.models.build import build_model, fingerprint, load_tokenizer, model_config, tokenizer_and_config
from meshlm.models.materialize import InitialWeights, materialize


def find_checkpoint(path: Path) -> tuple[Path, Path]:
    """(step-N directory, run directory) for a run directory, its checkpoints/ or a step-N."""
    path = path.expanduser()
    if not path.exists():
        raise MeshlmError(
            f"checkpoint {path} does not exist; give a run directory, its checkpoints/ or a checkpoints/step-N"
        )
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
    reason = integrity.damage(path, alone=True)  # any process may ask: no collective
    if reason:
        raise MeshlmError(f"checkpoint {path} is damaged ({reason}); use an older complete step-N")
    return path, path.parent.parent


def run_config(run_dir: Path, trust_remote_code: bool) -> Config:
    """The config a run trained with (its config.toml), to rebuild its model. trust_remote_code comes from the
    caller's command line only: a config.toml from elsewhere must not switch on running a repository's code."""
    cfg_file = run_dir / "config.toml"
    if not cfg_file.is_file():
        raise MeshlmError(
            f"{cfg_file} not found: the run's config.toml says which model was trained; "
            f"pass the checkpoint inside its run directory"
        )
    cfg = load_config(str(cfg_file))
    cfg.trust_remote_code = trust_remote_code
    return cfg


def saved_fingerprint(step_dir: Path) -> dict | None:
    try:
        return json.loads((step_dir / "trainer.json").read_text()).get("fingerprint")
    except (OSError, json.JSONDecodeError) as e:
        raise MeshlmError(f"checkpoint {step_dir} is corrupt (trainer.json: {e}); use another one") from None


def check_fingerprint(saved: dict | None, mine: dict, step_dir: Path, fix: str) -> None:
    """One line when a checkpoint is from another model than the one built to hold it; `fix` says what to do."""
    if saved != mine:
        raise MeshlmError(f"checkpoint {step_dir} is from another model ({saved} vs {mine}); {fix}")


@dataclass
class ModelSource:
    """A model's source, read once: `cfg` describes the model as training builds it; `step_dir` is the
    checkpoint whose weights fill it (None: the seed or --model-name's own weights)."""

    cfg: Config
    step_dir: Path | None = None
    tokenizer: object = field(default=None, repr=False)
    model_config: object = field(default=None, repr=False)

    def __post_init__(self):
        if self.tokenizer is None and self.model_config is None:
            self.tokenizer, _, self.model_config = tokenizer_and_config(self.cfg)
        if self.tokenizer is None:
            self.tokenizer, _ = load_tokenizer(self.cfg)
        if self.model_config is None:
            self.model_config = model_config(self.cfg, len(self.tokenizer))

    @classmethod
    def of_config(cls, cfg: Config, tokenizer=None, config=None) -> ModelSource:
        """Training's model: the built-in one or --model-name, seeded or --pretrained, with or without LoRA (its
        tokenizer and transformers config, when the caller has read them already)."""
        return cls(cfg, tokenizer=tokenizer, model_config=config)

    @classmethod
    def of_model(cls, name: str, tokenizer_name: str = "", trust_remote_code: bool = False) -> ModelSource:
        """A transformers model directory or hub id, with its own weights."""
        return cls(
            Config(model_name=name, tokenizer_name=tokenizer_name, pretrained=True, trust_remote_code=trust_remote_code)
        )

    @classmethod
    def of_checkpoint(cls, path: str, trust_remote_code: bool = False, tokenizer_name: str = "") -> ModelSource:
        """A meshlm run's checkpoint: its run's config.toml describes the model, the checkpoint fills it."""
        step_dir, run_dir = find_checkpoint(Path(path))
        cfg = run_config(run_dir, trust_remote_code)
        cfg.tokenizer_name = tokenizer_name or cfg.tokenizer_name
        # every weight comes from the checkpoint, but a LoRA run's base, which is filled as training filled it
        cfg.pretrained = cfg.pretrained and lora_on(cfg.lora)
        return cls(cfg, step_dir)

    @property
    def lora(self) -> bool:
        """A LoRA run's checkpoint: adapters only, on a base rebuilt as the run built it."""
        return self.step_dir is not None and lora_on(self.cfg.lora)

    def fingerprint(self, model: torch.nn.Module) -> dict:
        """What a checkpoint of this model records (a LoRA run's also names its base's source)."""
        if not lora_on(self.cfg.lora):
            return fingerprint(model)
        from meshlm.parallel.lora import base_fingerprint

        return fingerprint(model) | base_fingerprint(self.cfg)

    def check(self, model: torch.nn.Module) -> None:
        """The checkpoint holds this model (one line when its run's config.toml describes another)."""
        fix = (
            "its run's config.toml must name the base it was trained on"
            if self.lora
            else "its run's config.toml does not describe it"
        )
        check_fingerprint(saved_fingerprint(self.step_dir), self.fingerprint(model), self.step_dir, fix)

    def on_meta(self, seq_length: int | None = None) -> torch.nn.Module:
        """The model on the meta device (nothing read or allocated), checked against the checkpoint; a LoRA
        run's with its adapters injected as training injects them."""
        cfg = self.cfg if seq_length is None else replace(self.cfg, seq_length=seq_length)
        model = build_model(cfg, self.tokenizer, "meta", self.model_config)
        if self.step_dir is not None:
            self.check(model)
        if not self.lora:
            return model
        from meshlm.parallel.lora import apply_lora

        return apply_lora(model, self.cfg)

    def initial_weights(self, model: torch.nn.Module) -> InitialWeights:
        """The unsplit meta skeleton (rotary buffers, ties) and the seeded init training fills from."""
        if self.step_dir is None and not lora_on(self.cfg.lora):
            return InitialWeights.of(model, self.cfg.seed)
        if self.step_dir is None or self.lora:
            from meshlm.parallel.lora import initial_value

            return InitialWeights.of(model, self.cfg.seed, initial_value)
        return InitialWeights.of(model, 0)

    def fill(self, model: torch.nn.Module, init: InitialWeights, device) -> torch.nn.Module:
        """This rank's part of a (split) meta-device model: seeded or read per slice from --model-name's
        safetensors; from a checkpoint, DCP reads into the split model's own state dict (DTensor shards, this
        stage's names); a LoRA checkpoint's base as training filled it, its adapters read and merged by peft."""
        pretrained = self.cfg.model_name if self.cfg.pretrained else None
        if self.step_dir is None:
            materialize(model, init, device, pretrained)
        elif self.lora:
            materialize(model, init, device, pretrained)
            self._nf4_base(model)
            _read_and_merge_adapters(model, self.step_dir)
        else:
            materialize(model, init, device, computed_only=True)  # allocated; rotary buffers computed
            _load_step({"model": model.state_dict()}, self.step_dir)
        return model

    def _nf4_base(self, model: torch.nn.Module) -> None:
        """An NF4 run's base as it trained on it: its whole block projections quantised and dequantised."""
        if nf4_base(self.cfg.lora):
            from meshlm.parallel import nf4

            nf4.dequantised_base(model, self.cfg)

    def peft_model(self):
        """A LoRA run as a PeftModel (its base filled, its adapters read) on the CPU, in float32."""
        from peft import get_peft_model

        from meshlm.parallel import lora

        base = build_model(self.cfg, self.tokenizer, "meta", self.model_config)
        self.check(base)
        pretrained = self.cfg.model_name if self.cfg.pretrained else None
        materialize(base, InitialWeights.of(base, self.cfg.seed), "cpu", pretrained)
        self._nf4_base(base)
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():  # A's random init: overwritten below
            # peft's PeftModel reads transformers' deprecated is_gradient_checkpointing alias: not the user's to fix
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            model = get_peft_model(base, lora.peft_config(self.cfg, base), adapter_name=lora.ADAPTER)
        inner = model.get_base_model()  # the injected model: same paths as in training
        state = {"model": {k: v for k, v in inner.state_dict().items() if lora.is_adapter(k)}}
        _load_step(state, self.step_dir)
        inner.load_state_dict(state["model"], strict=False)
        return model

    def whole(self, dtype: torch.dtype = torch.float32, device="cpu") -> torch.nn.Module:
        """The whole model in eval mode, in `dtype` on `device`: a checkpoint's (a LoRA run's merged into a plain
        transformers model), or --model-name's own weights, read in `dtype`."""
        if self.lora:
            model = self.peft_model().merge_and_unload()
            model.config.use_cache = True  # training turned the KV cache off; generation wants it
        elif self.step_dir is not None:
            # Built on the CPU, not the meta device: non-persistent buffers (rotary inv_freq) need their values.
            model = build_model(self.cfg, self.tokenizer, "cpu", self.model_config)
            self.check(model)
            state = {"model": model.state_dict()}
            _load_step(state, self.step_dir)
            model.load_state_dict(state["model"])
            model.config.use_cache = True
        else:
            model = _pretrained(self.cfg, self.model_config, dtype)
        return model.to(device=device, dtype=dtype).eval()


def _pretrained(cfg: Config, mcfg, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        with _no_progress_bar():  # rank 0's summary is the progress report
            return AutoModelForCausalLM.from_pretrained(
                cfg.model_name,
                dtype=dtype,
                trust_remote_code=cfg.trust_remote_code,
                attn_implementation=implementation(cfg.attention, mcfg, torch.cuda.is_available(), cfg.seq_length),
            )
    except (OSError, ValueError) as e:
        raise MeshlmError(f"could not load weights from {cfg.model_name!r}: {str(e).strip().splitlines()[0]}") from None


@contextlib.contextmanager
def _no_progress_bar():
    """transformers' loading bar off while the weights load; its switch is process-wide, so put back after."""
    import transformers

    logging = transformers.logging
    was_on = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            logging.enable_progress_bar()


def _read_and_merge_adapters(model: torch.nn.Module, step_dir: Path) -> None:
    """A filled LoRA model's adapters (or their tensor-parallel shards) read by DCP, then each merged into its
    base weight by peft (in place, shard by shard)."""
    from peft.tuners.lora import LoraLayer

    from meshlm.parallel.lora import is_adapter

    state = {"model": {k: v for k, v in model.state_dict().items() if is_adapter(k)}}
    _load_step(state, step_dir)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoraLayer):
                m.merge()


def _load_step(state: dict, step_dir: Path) -> None:
    """A checkpoint's tensors into `state` (checkpoint/safe_load.py, imported only by a source that reads one)."""
    from meshlm.checkpoint import safe_load

    safe_load.load_step(state, step_dir)
