"""Build the tokenizer and the model: the built-in tiny Llama/GPT-2, or any hub id / local directory."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2Config, LlamaConfig

from meshlm import files
from meshlm.config import Config
from meshlm.data import builtin
from meshlm.data.builtin import byte_tokenizer
from meshlm.errors import MeshlmError
from meshlm.models.attention import implementation
from meshlm.models.families import family


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).exists()


@contextlib.contextmanager
def _hub_quiet():
    """huggingface_hub logs every retry of an unreachable hub (a dozen lines over half a minute offline); the one
    error line says it once. Its verbosity is the process's: put back afterwards."""
    from huggingface_hub.utils import logging as hub_logging

    verbosity = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()
    try:
        yield
    finally:
        hub_logging.set_verbosity(verbosity)


def _unreadable(e: BaseException) -> str:
    """The first line of transformers' error, and what to do when the hub could not be reached and the files are
    not in its local cache (transformers raises OSError from huggingface_hub's LocalEntryNotFoundError)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    first = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
    if not isinstance(e.__cause__, LocalEntryNotFoundError):
        return first
    if constants.HF_HUB_OFFLINE:
        return "not in the hub cache and HF_HUB_OFFLINE is set; give a local directory (written by save_pretrained)"
    return (
        "the hub is unreachable and it is not in the hub cache; give a local directory (written by "
        "save_pretrained), and set HF_HUB_OFFLINE=1 to read cached hub ids without waiting for the hub"
    )


def load_tokenizer(cfg: Config):
    """(tokenizer, id) where id names it for caches."""
    if cfg.model_name:
        model_config(cfg)  # a bad model directory is reported as such, not as a tokenizer that failed
    return _read_tokenizer(cfg)


def tokenizer_and_config(cfg: Config):
    """(tokenizer, id, the model's transformers config), each read once: a named model's config first (as
    load_tokenizer checks it), the built-in model's after its tokenizer, whose vocabulary sizes it."""
    if cfg.model_name:
        mcfg = model_config(cfg)
        return (*_read_tokenizer(cfg), mcfg)
    tokenizer, ident = _read_tokenizer(cfg)
    return tokenizer, ident, model_config(cfg, len(tokenizer))


def _read_tokenizer(cfg: Config):
    name = cfg.tokenizer_name or cfg.model_name
    if not name:
        return byte_tokenizer(), builtin.TOKENIZER_ID
    if _looks_local(name) and not Path(name).is_dir():
        raise MeshlmError(f"tokenizer directory {name} does not exist")
    if Path(name).is_dir():
        _check_tokenizer_files(Path(name), "tokenizer" if cfg.tokenizer_name else "model", cfg.trust_remote_code)
    try:
        with _hub_quiet():
            tok = AutoTokenizer.from_pretrained(name, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise MeshlmError(f"could not load a tokenizer from {name!r}: {_unreadable(e)}") from None
    if len(tok) < 2:  # transformers may build an empty tokenizer where it finds none: every text would be no tokens
        raise MeshlmError(f"{name} gives an empty tokenizer (vocabulary {len(tok)}); {_TOKENIZER_FIX}")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    ident = str(Path(name).resolve()) if Path(name).is_dir() else name
    return tok, ident


# What a directory written by a tokenizer's save_pretrained holds at least one of (fast, SentencePiece, BPE, WordPiece).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
_TOKENIZER_FIX = "give one with --tokenizer-name (a hub id, or a directory a tokenizer's save_pretrained wrote)"


def _check_tokenizer_files(directory: Path, kind: str, custom_code: bool) -> None:
    """The directory holds a tokenizer, and its JSON files read (a damaged one is named, not transformers' error).
    A tokenizer with its own code (--trust-remote-code) may read files of any name: only its JSON is checked."""
    found = [f for f in TOKENIZER_FILES if (directory / f).is_file()]
    if not (found or custom_code or any(directory.glob("*.tiktoken"))):
        raise MeshlmError(
            f"{kind} directory {directory} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); {_TOKENIZER_FIX}"
        )
    for f in (*found, "special_tokens_map.json"):
        if f.endswith(".json") and (directory / f).is_file():
            files.read_json(directory / f)


def decoder_config(
    family: str, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, max_positions: int, **keys
) -> transformers.PretrainedConfig:
    """The transformers config of a GPT-2 or Llama decoder with these dimensions, for meshlm's built-in model and
    the planner's presets alike; `keys`: the config's own further keys (`kv_heads` is Llama's alone: GPT-2's
    keys have every head)."""
    if family == "gpt2":
        return GPT2Config(
            vocab_size=vocab,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_inner=mlp,
            n_positions=max_positions,
            **keys,
        )
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=mlp,
        max_position_embeddings=max_positions,
        **keys,
    )


def model_config(cfg: Config, vocab_size: int | None = None) -> transformers.PretrainedConfig:
    """The model's config alone: no weights are read."""
    if not cfg.model_name:
        a = cfg.arch
        vocab = vocab_size or builtin.VOCAB
        vocab = (vocab + 63) // 64 * 64  # a multiple of 64: friendlier matmuls, divisible by tp
        token = vocab_size - 1 if vocab_size else 0  # end of text: the tokenizer's last id (GPT-2's, the bytes' EOS)
        dims = dict(
            vocab=vocab,
            hidden=a.hidden_size,
            layers=a.layers,
            heads=a.heads,
            kv_heads=a.kv_heads,
            mlp=a.intermediate_size,
            max_positions=a.max_positions,
        )
        if a.family == "gpt2":
            drop = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
            return decoder_config(
                "gpt2", **dims, **drop, bos_token_id=token, eos_token_id=token, tie_word_embeddings=True
            )
        # the tokenizer's end of text, not Llama's defaults (2): an export's generate stops where training ended
        ends = dict(bos_token_id=None, eos_token_id=token)
        return decoder_config("llama", **dims, **ends, tie_word_embeddings=False, rms_norm_eps=1e-5)
    name = cfg.model_name
    if _looks_local(name) and not Path(name).is_dir():
        raise MeshlmError(f"model directory {name} does not exist")
    if Path(name).is_dir() and not (Path(name) / "config.json").is_file():
        raise MeshlmError(f"model directory {name} has no config.json; use a directory written by save_pretrained")
    if Path(name).is_dir():
        files.read_json(Path(name) / "config.json")  # damage named here, not as transformers' parse error
    try:
        with _hub_quiet():
            return AutoConfig.from_pretrained(name, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        hint = "; pass --trust-remote-code true only if you trust that code" if "custom code" in str(e) else ""
        raise MeshlmError(f"could not read a model config from {name!r}: {_unreadable(e)}{hint}") from None


def max_positions(mcfg) -> int | None:
    return getattr(mcfg, "max_position_embeddings", None) or getattr(mcfg, "n_positions", None)


def check_seq_length(cfg: Config, mcfg) -> None:
    limit = max_positions(mcfg)
    if limit is not None and cfg.seq_length > limit:
        raise MeshlmError(
            f"--seq-length {cfg.seq_length} is larger than the model's {limit} positions; "
            f"use --seq-length {limit} or less"
        )


def build_model(cfg: Config, tokenizer, device: torch.device | str = "cpu", mcfg=None) -> torch.nn.Module:
    """A causal LM in float32 on `device`, its embeddings grown to fit the tokenizer; `mcfg`: its transformers
    config when the caller has read it (a copy is built on: the caller's stays as it was).

    On the meta device nothing is read or allocated: shapes only, the vocabulary already grown to fit the
    tokenizer; parallel/apply.py then gives each rank its part (models/materialize.py).
    """
    mcfg = copy.deepcopy(mcfg) if mcfg is not None else model_config(cfg, len(tokenizer))
    check_seq_length(cfg, mcfg)
    mcfg.use_cache = False
    kernel = implementation(cfg.attention, mcfg, torch.cuda.is_available(), cfg.seq_length)
    if str(device) == "meta" and len(tokenizer) > mcfg.vocab_size:
        mcfg.vocab_size = (len(tokenizer) + 63) // 64 * 64  # what resize_token_embeddings(pad_to_multiple_of=64) makes
    if cfg.model_name and cfg.pretrained and str(device) != "meta":
        try:
            model = AutoModelForCausalLM.from_pretrained(
                cfg.model_name,
                config=mcfg,
                dtype=torch.float32,
                trust_remote_code=cfg.trust_remote_code,
                attn_implementation=kernel,
            )
        except (OSError, ValueError) as e:
            raise MeshlmError(f"could not load weights from {cfg.model_name!r}: {str(e).splitlines()[0]}") from None
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                mcfg, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code, attn_implementation=kernel
            )
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
    if family(model.config).fused:  # a family with fused projections (models/fused.py, imported only then)
        from meshlm.models.fused import split_fused

        model = split_fused(model)
    return model.to(device)


def fingerprint(model: torch.nn.Module) -> dict:
    """What must match for a checkpoint to belong to this model."""
    c = model.config
    return {
        "model_type": c.model_type,
        "hidden_size": c.hidden_size,
        "layers": c.num_hidden_layers,
        "vocab_size": model.get_input_embeddings().weight.shape[0],
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def weights_digest(cfg: Config) -> str:
    """What the starting weights are, without reading them: every layout fills them from --seed (name-seeded
    init) or from --model-name's safetensors, so that source names them: the seed, or every tensor's name,
    shape and first row in the files. No weights are read beyond those rows and no rank talks to another.
    (A LoRA checkpoint's base, parallel/lora.py; DPO's precomputed reference, objectives/dpo.py.)"""
    import hashlib

    h = hashlib.sha256()
    if not cfg.pretrained:
        h.update(f"seed {cfg.seed}".encode())
    else:
        from meshlm.models.safetensors_read import SafetensorsCheckpoint

        ckpt = SafetensorsCheckpoint(cfg.model_name)
        for key in sorted(ckpt.weight_map):
            shape = ckpt.shape(key)
            first = ckpt.read(key, (slice(0, 1),)) if shape else torch.zeros(())
            h.update(f"{key} {shape}".encode() + first.numpy().tobytes())
    return h.hexdigest()[:16]
