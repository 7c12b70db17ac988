"""Bad input, one row of docs/errors.md each: a one-line `meshlm: error:`, exit status 2, and an existing
output directory left byte-for-byte as it was.

Every row runs in this process through `cli.main`, and the rows of `meshlm train` again under `--nproc 2`:
most fail before any rank starts (cheap); those only ranks can find (a checkpoint of another model, a missing
shard) start two real ranks, which reject the input while the console still gets one line.
"""

from __future__ import annotations

import multiprocessing.util
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import TINY, family_config, needs_family, tree_digest, without_arch
from meshlm import cli

pytestmark = pytest.mark.slow  # one real run is the existing output directory; one row runs two ranks

DOCS = Path(__file__).resolve().parents[1] / "docs" / "errors.md"


def _write(name: str, text: str):
    def setup(out: Path, tmp: Path) -> None:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(text)

    return setup


def _edit_checkpoint(fn):
    """fn on every checkpoint of the run: one left whole would be resumed from instead."""

    def setup(out: Path, tmp: Path) -> None:
        for step in (out / "checkpoints").glob("step-*"):
            fn(step, tmp)

    return setup


def _python_config(out: Path, tmp: Path) -> None:
    """A config file that is Python, not TOML: it is parsed as data, so its code never runs."""
    (tmp / "c.toml").write_text(f"import pathlib\npathlib.Path('{tmp}/pwned').touch()\n")


def _custom_code_model(out: Path, tmp: Path) -> None:
    """A model directory whose config needs its own Python code (auto_map), which would run on import."""
    (tmp / "custom").mkdir()
    (tmp / "custom" / "config.json").write_text(
        '{"model_type": "custom", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}'
    )
    (tmp / "custom" / "configuration_custom.py").write_text(
        f"import pathlib\npathlib.Path('{tmp}/pwned').touch()\n"
        "from transformers import PretrainedConfig\nclass CustomConfig(PretrainedConfig):\n    model_type = 'custom'\n"
    )


def _bloom_model(out: Path, tmp: Path) -> None:
    """A family whose attention does not go through transformers' attention interface (context parallel's way in)."""
    from transformers import BloomConfig

    from meshlm.data.builtin import byte_tokenizer

    BloomConfig(vocab_size=320, hidden_size=32, n_layer=2, n_head=4).save_pretrained(tmp / "bloom")
    byte_tokenizer().save_pretrained(tmp / "bloom")


_holders: list[subprocess.Popen] = []  # jobs holding a run directory, ended after each test


def _held_by_another_job(out: Path, tmp: Path) -> None:
    """A live process holds the directory's lock, as a running job's launcher does."""
    code = (
        "import sys, time; from pathlib import Path; from meshlm.checkpoint.run_dir import RunLock; "
        "RunLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    _holders.append(holder)
    assert holder.stdout.readline().strip() == "held"


@pytest.fixture(autouse=True)
def _end_holders():
    yield
    while _holders:
        holder = _holders.pop()
        holder.kill()
        holder.wait()


def _opt_model(out: Path, tmp: Path) -> None:
    """An OPT model: a causal LM whose config carries no TP plan and no layer list, and no meshlm override."""
    from transformers import OPTConfig

    from meshlm.data.builtin import byte_tokenizer

    dims = dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64)
    OPTConfig(**dims, vocab_size=320).save_pretrained(tmp / "opt")
    byte_tokenizer().save_pretrained(tmp / "opt")


def _glm_moe_dsa_model(out: Path, tmp: Path) -> None:
    """A GLM-MoE-DSA model: a layer list, but blocks that pass the indexer's choices to the next one."""
    from transformers import GlmMoeDsaConfig

    from meshlm.data.builtin import byte_tokenizer

    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    GlmMoeDsaConfig(**dims, vocab_size=320).save_pretrained(tmp / "glm_moe_dsa")
    byte_tokenizer().save_pretrained(tmp / "glm_moe_dsa")


def _older_transformers(out: Path, tmp: Path) -> None:
    """transformers 5.16.0's metadata first on the path (the test puts sys.path back)."""
    meta = tmp / "older" / "transformers-5.16.0.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 5.16.0\n")
    sys.path.insert(0, str(tmp / "older"))


def _inkling2_model(out: Path, tmp: Path) -> None:
    """An Inkling 2 model: its decoder passes a second per-token stream (block_states) between blocks."""
    from meshlm.data.builtin import byte_tokenizer

    dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = needs_family(family_config("Inkling2TextConfig", **dims, vocab_size=320), "inkling2_text")
    config.save_pretrained(tmp / "inkling2_text")
    byte_tokenizer().save_pretrained(tmp / "inkling2_text")


def _hrm_model(out: Path, tmp: Path) -> None:
    """An HRM model: its TP plan splits blocks under two recurrent stacks (H_module, L_module)."""
    from transformers import HrmTextConfig

    from meshlm.data.builtin import byte_tokenizer

    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    HrmTextConfig(**dims, vocab_size=320).save_pretrained(tmp / "hrm_text")
    byte_tokenizer().save_pretrained(tmp / "hrm_text")


def _qwen4_exp_model(out: Path, tmp: Path) -> None:
    """A Qwen4-Exp model: transformers' plan splits its hyper-connection mixers (rowwise_split_input) and its n-gram
    embedding (embedding_colwise) in styles meshlm does not implement."""
    from transformers import Qwen4ExpTextConfig

    from meshlm.data.builtin import byte_tokenizer

    dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
    Qwen4ExpTextConfig(**dims, vocab_size=320).save_pretrained(tmp / "qwen4_exp_text")
    byte_tokenizer().save_pretrained(tmp / "qwen4_exp_text")


def _mistral_model(out: Path, tmp: Path) -> None:
    """A Mistral model with a sliding window: its attention is not plain causal within a document."""
    from transformers import MistralConfig

    from meshlm.data.builtin import byte_tokenizer

    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    MistralConfig(**dims, num_key_value_heads=2, vocab_size=320, sliding_window=32).save_pretrained(tmp / "mistral")
    byte_tokenizer().save_pretrained(tmp / "mistral")


def _falcon_model(out: Path, tmp: Path) -> None:
    """A Falcon model: SDPA in its own code, not through transformers' attention interface."""
    from transformers import FalconConfig

    from meshlm.data.builtin import byte_tokenizer

    FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=320).save_pretrained(
        tmp / "falcon"
    )
    byte_tokenizer().save_pretrained(tmp / "falcon")


def _qwen3_six_heads(out: Path, tmp: Path) -> None:
    """A Qwen 3 model with 6 attention heads (2 key/value heads): tp 4 divides neither count; heads come first."""
    from transformers import Qwen3Config

    from meshlm.data.builtin import byte_tokenizer

    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16, vocab_size=320)
    Qwen3Config(**dims, num_attention_heads=6, num_key_value_heads=2).save_pretrained(tmp / "qwen3")
    byte_tokenizer().save_pretrained(tmp / "qwen3")


def _mixtral_three_experts(out: Path, tmp: Path) -> None:
    """A Mixtral model with 3 experts per layer: its heads and MLP width split over tp 2, its experts do not."""
    from transformers import MixtralConfig

    from meshlm.data.builtin import byte_tokenizer

    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=320)
    MixtralConfig(**dims, num_key_value_heads=2, num_local_experts=3).save_pretrained(tmp / "mixtral")
    byte_tokenizer().save_pretrained(tmp / "mixtral")


def _lora_run_on_fused_projections(out: Path, tmp: Path) -> None:
    """A LoRA run directory on a Phi-3 base (adapters on the parts of qkv_proj and gate_up_proj); its
    checkpoint is complete but empty: the refusal comes before anything is read."""
    from transformers import Phi3Config

    from meshlm.data.builtin import byte_tokenizer

    Phi3Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=320,
        pad_token_id=0,
    ).save_pretrained(tmp / "phi3")
    byte_tokenizer().save_pretrained(tmp / "phi3")
    (tmp / "run" / "checkpoints" / "step-1" / "state").mkdir(parents=True)
    (tmp / "run" / "checkpoints" / "step-1" / "COMPLETE").write_text("")
    (tmp / "run" / "checkpoints" / "latest").write_text("step-1\n")
    (tmp / "run" / "config.toml").write_text(f'model_name = "{tmp / "phi3"}"\n[lora]\nr = 4\n')


class _Payload:
    """What an attacker would put into a checkpoint's .metadata: code that runs when it is unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _malicious_metadata(step: Path, tmp: Path) -> None:
    """Its manifest removed too, as someone would who meant it (the checksums would refuse the file first)."""
    (step / "state" / ".metadata").write_bytes(pickle.dumps(_Payload(tmp / "pwned")))
    (step / "MANIFEST.json").unlink()


def _zero_4k_in_shard(step: Path, tmp: Path) -> None:
    """4 KiB zeroed inside the largest shard, its size unchanged, as a bad disk block would."""
    shard = max((step / "state").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4096] = bytes(4096)
    shard.write_bytes(bytes(data[: shard.stat().st_size]))


def _moe(kind: str, experts: int):
    """A tiny mixture of experts (transformers' config class, random weights) with the byte tokenizer."""

    def setup(out: Path, tmp: Path) -> None:
        import transformers as tf

        from meshlm.data.builtin import byte_tokenizer

        small = dict(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        config = {
            "mixtral": lambda: tf.MixtralConfig(**small, intermediate_size=32, num_local_experts=experts),
            "jetmoe": lambda: tf.JetMoeConfig(
                vocab_size=320, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
                intermediate_size=32, num_local_experts=experts,
            ),
        }[kind]()  # fmt: skip
        tf.AutoModelForCausalLM.from_config(config).save_pretrained(tmp / kind)
        byte_tokenizer().save_pretrained(tmp / kind)

    return setup


def _write_bytes(name: str, data: bytes):
    def setup(out: Path, tmp: Path) -> None:
        (tmp / name).write_bytes(data)

    return setup


def _llama(tokenizer: bool = True, weights: bool = False, damage=None):
    """A Llama directory in tmp/m of TINY's dimensions (so the finished run's checkpoint fits it and the ranks get
    as far as its weights), random weights with `weights`, the byte tokenizer unless told otherwise;
    `damage(directory)` then spoils one of its files."""

    def setup(out: Path, tmp: Path) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        from meshlm.data.builtin import byte_tokenizer

        dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)  # TINY's
        config = LlamaConfig(**dims, num_key_value_heads=2, vocab_size=320, tie_word_embeddings=False)
        (LlamaForCausalLM(config) if weights else config).save_pretrained(tmp / "m")
        if tokenizer:
            byte_tokenizer().save_pretrained(tmp / "m")
        if damage:
            damage(tmp / "m")

    return setup


def _cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _cache_in(path: str):
    """MESHLM_CACHE pointed at `path` (the setup's returned environment, set by the test)."""
    return lambda out, tmp: {"MESHLM_CACHE": path}


def _chat_answer_only(out: Path, tmp: Path) -> None:
    """A tiny Llama whose tokenizer has a chat template, and a chat prompt that is only an assistant turn."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from meshlm.data.builtin import byte_tokenizer

    config = LlamaConfig(
        vocab_size=320, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
    )
    LlamaForCausalLM(config).save_pretrained(tmp / "chat")
    tok = byte_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(tmp / "chat")
    (tmp / "p.jsonl").write_text('{"messages": [{"role": "assistant", "content": "6"}]}\n')


# id -> (arguments after `meshlm`, setup(out, tmp) run before the digest, text the error line must contain).
# A setup may return a dict of environment variables to set for the case.
# {out} and {tmp} in arguments are the existing output directory and a scratch directory.
CASES = {
    # command line
    "cli-unknown-option": (
        ["train", "--maxsteps", "5"],
        None,
        "unrecognized arguments: --maxsteps 5; did you mean --max-steps? (see `meshlm train --help`)",
    ),
    "cli-not-an-integer": (["train", "--max-steps", "ten"], None, "--max-steps needs an integer, got 'ten'"),
    "cli-bad-choice": (["train", "--strategy", "zero9"], None, "--strategy must be one of"),
    "version-too-old": (
        ["train"],
        _older_transformers,
        "meshlm needs transformers >= 5.17.0; found transformers 5.16.0: pip install 'transformers>=5.17.0'",
    ),
    "cli-negative": (["train", "--keep-last", "-1"], None, "--keep-last must not be negative"),
    "cli-zero-lr": (["train", "--lr", "0"], None, "--lr must be positive"),
    "cli-skip-nonfinite": (["train", "--skip-nonfinite", "-2"], None, "--skip-nonfinite must not be negative"),
    "cli-unknown-command": (["trian"], None, "invalid choice: 'trian'"),
    "cli-unknown-option-plan": (["plan", "--nodess", "2"], None, "did you mean --nodes? (see `meshlm plan --help`)"),
    "plan-unknown-model": (
        ["plan", "--model-name", "llama-8b"],
        None,
        "--model-name llama-8b is not a preset (tiny, llama-7b",
    ),
    # config files
    "config-missing": (["train", "--config", "{tmp}/nope.toml"], None, "config file {tmp}/nope.toml does not exist"),
    "config-not-toml": (["train", "--config", "{tmp}/c.toml"], _python_config, "is not valid TOML"),
    "config-unknown-key": (
        ["train", "--config", "{tmp}/c.toml"],
        _write("c.toml", "[parallel]\ntpp = 2\n"),
        "unknown config key 'parallel.tpp'",
    ),
    "config-wrong-type": (
        ["train", "--config", "{tmp}/c.toml"],
        _write("c.toml", 'max_steps = "ten"\n'),
        "--max-steps needs an integer, got 'ten'",
    ),
    # datasets
    "data-missing": (
        ["train", "--dataset-name", "{tmp}/nope.jsonl"],
        None,
        "dataset file {tmp}/nope.jsonl does not exist",
    ),
    "data-extension": (
        ["train", "--dataset-name", "{tmp}/d.csv"],
        _write("d.csv", "a,b\n"),
        "use a .jsonl, .json or .txt",
    ),
    "data-bad-json": (
        ["train", "--dataset-name", "{tmp}/d.jsonl"],
        _write("d.jsonl", '{"text": "a"}\n{oops\n'),
        "d.jsonl:2 is not valid JSON",
    ),
    "data-no-text": (
        ["train", "--dataset-name", "{tmp}/d.jsonl"],
        _write("d.jsonl", '{"title": "a"}\n'),
        "a record of unknown shape: found fields ['title']; expected Alpaca",
    ),
    "data-unknown-shape": (
        ["train", "--dataset-name", "{tmp}/d.jsonl"],
        _write("d.jsonl", '{"question": "q", "answer": "a"}\n'),
        "a record of unknown shape: found fields ['answer', 'question']; expected Alpaca",
    ),
    "data-chat-no-template": (
        ["train", "--dataset-name", "{tmp}/d.jsonl"],
        _write("d.jsonl", '{"messages": [{"role": "user", "content": "hi"}]}\n'),
        "chat records need a tokenizer with a chat template",
    ),
    "data-eval-fraction": (["train", "--eval-fraction", "0.7"], None, "--eval-fraction must be in (0, 0.5]"),
    "eval-samples-layout": (
        ["train", "--eval-every", "2", "--eval-fraction", "0.1", "--eval-samples", "2", "--parallel.tp", "2"],
        None,
        "--eval-samples runs under single, dp, ddp, zero1-3, fsdp and hsdp, not with --parallel.tp",
    ),
    "eval-samples-prompts": (
        ["train", "--eval-every", "2", "--eval-fraction", "0.1", "--eval-samples", "{tmp}/p.csv"],
        None,
        "--eval-samples must be a number of held-out prompts (1 or more) or an existing .jsonl or .txt file",
    ),
    "eval-samples-held-out": (
        ["train", "--eval-every", "2", "--eval-fraction", "0.1", "--eval-samples", "1000"],
        None,
        "--eval-samples 1000: the held-out part has 47 records; use 47 or fewer",
    ),
    "eval-samples-tokens": (
        ["train", "--eval-every", "2", "--eval-fraction", "0.1", "--eval-samples", "2", "--eval-sample-tokens", "1024"],
        None,
        "--eval-sample-tokens 1024 leaves no room for a prompt in the model's 1024 positions",
    ),
    "data-too-small": (["train", "--builtin-samples", "1"], None, "fewer than one global batch"),
    "data-too-small-ranks": (
        ["train", "--builtin-samples", "1", "--nproc", "2", "--micro-batch-size", "2"],
        None,
        "fewer than one global batch of 4",
    ),
    # preference data (--objective dpo)
    "dpo-no-rejected": (
        ["train", "--objective", "dpo", "--dataset-name", "{tmp}/d.jsonl"],
        _write("d.jsonl", '{"prompt": "a", "chosen": "b"}\n'),
        "d.jsonl record 1: --objective dpo needs preference records; this one has no 'rejected'",
    ),
    "dpo-empty-response": (
        ["train", "--objective", "dpo", "--dataset-name", "{tmp}/d.jsonl"],
        _write("d.jsonl", '{"prompt": "a", "chosen": "b", "rejected": ""}\n'),
        "d.jsonl record 1: the 'rejected' response is empty",
    ),
    "dpo-pair-too-long": (
        ["train", "--objective", "dpo", "--dataset-name", "{tmp}/d.jsonl"],
        _write("d.jsonl", '{"prompt": "%s", "chosen": "b", "rejected": "c"}\n' % ("x" * 70)),
        "is 144 tokens (72 + 72), longer than a block of --seq-length 64; raise --seq-length",
    ),
    "dpo-loss-on-all": (["train", "--objective", "dpo", "--loss-on", "all"], None, "drop --loss-on all"),
    "dpo-ipo-smoothing": (
        ["train", "--dpo.loss", "ipo", "--dpo.label-smoothing", "0.1"],
        None,
        "--dpo.loss ipo has none",
    ),
    "dpo-chunked-loss": (
        ["train", "--objective", "dpo", "--chunked-loss", "on"],
        None,
        "--chunked-loss on sums a next-token loss; --objective dpo needs each response's log-probabilities",
    ),
    # models and tokenizers
    "model-missing": (
        ["train", "--model-name", "{tmp}/no-model"],
        None,
        "model directory {tmp}/no-model does not exist",
    ),
    "model-no-config": (
        ["train", "--model-name", "{tmp}/empty"],
        _write("empty/README", ""),
        "model directory {tmp}/empty has no config.json",
    ),
    "model-remote-code": (
        ["train", "--model-name", "{tmp}/custom"],
        _custom_code_model,
        "contains custom code which must be executed",
    ),
    "model-short-positions": (
        ["train", "--arch.max-positions", "32"],
        None,
        "--seq-length 64 is larger than the model's 32 positions",
    ),
    "float8-conv1d": (
        ["train", "--arch.family", "gpt2", "--float8", "rowwise", "--output-dir", "{tmp}/gpt2"],  # not the llama run
        None,
        "--float8 rowwise computes torch's Linear layers; gpt2's projections are transformers' Conv1D: drop --float8",
    ),
    "float8-sequence-parallel-gloo": (
        [
            "train",
            "--nproc",
            "2",
            "--parallel.tp",
            "2",
            "--parallel.sequence-parallel",
            "true",
            "--float8",
            "tensorwise",
        ],
        None,
        "--float8 tensorwise with --parallel.sequence-parallel all-gathers float8 tensors, which gloo (CPU ranks) "
        "cannot: use --float8 rowwise or drop --parallel.sequence-parallel",
    ),
    "attention-flex-on-cpu": (
        ["train", "--attention", "flex"],
        None,
        "--attention flex: meshlm runs FlexAttention on CUDA only (on CPU it has no backward); use --attention "
        "varlen or sdpa",
    ),
    "attention-varlen-sliding-window": (
        ["train", "--model-name", "{tmp}/mistral", "--nproc", "2", "--attention", "varlen"],
        _mistral_model,
        "--attention varlen: mistral's attention has a sliding window; use --attention flex or sdpa",
    ),
    "attention-varlen-no-interface": (
        ["train", "--model-name", "{tmp}/falcon", "--nproc", "2", "--attention", "varlen"],
        _falcon_model,
        "--attention varlen: falcon's attention has its own code, not transformers' attention interface; "
        "use --attention flex or sdpa",
    ),
    "family-no-tp-plan": (
        ["train", "--model-name", "{tmp}/opt", "--nproc", "2", "--parallel.tp", "2"],
        _opt_model,
        "tensor parallel needs a TP plan for model family 'opt': its config has no base_model_tp_plan and meshlm "
        "has no override; layouts that still work: single, ddp, zero1, zero2, zero3, fsdp, hsdp",
    ),
    "family-no-layer-list": (
        ["train", "--model-name", "{tmp}/opt", "--nproc", "2", "--parallel.pp", "2"],
        _opt_model,
        "pipeline parallel needs the layer list of model family 'opt'",
    ),
    "family-unsplittable": (
        ["train", "--model-name", "{tmp}/glm_moe_dsa", "--nproc", "2", "--parallel.pp", "2"],
        _glm_moe_dsa_model,
        "pipeline parallel cannot cut model family 'glm_moe_dsa' into stages: its blocks pass the indexer's top-k "
        "choices on to the next block",
    ),
    "family-no-sequence-parallel": (
        [
            "train",
            "--model-name",
            "{tmp}/inkling2_text",
            "--nproc",
            "2",
            "--parallel.tp",
            "2",
            "--parallel.sequence-parallel",
            "true",
        ],
        _inkling2_model,
        "--parallel.sequence-parallel cannot split model family 'inkling2_text' along the sequence: its decoder "
        "carries a second per-token stream (block_states) between its blocks, outside them",
    ),
    "family-tp-block-stacks": (
        ["train", "--model-name", "{tmp}/hrm_text", "--nproc", "2", "--parallel.tp", "2"],
        _hrm_model,
        "tensor parallel for 'hrm_text': its plan splits blocks under H_module.layers, L_module.layers, and meshlm "
        "splits the blocks of one layer list (layers)",
    ),
    "family-tp-style": (
        ["train", "--model-name", "{tmp}/qwen4_exp_text", "--nproc", "2", "--parallel.tp", "2"],
        _qwen4_exp_model,
        "tensor parallel for 'qwen4_exp_text' needs plan styles meshlm does not implement: embedding_colwise, "
        "rowwise_split_input",
    ),
    "family-tp-kv-heads": (
        ["train", "--nproc", "4", "--parallel.tp", "4", "--arch.heads", "4", "--arch.kv-heads", "2"],
        None,
        "--parallel.tp 4 does not divide the model's 2 key/value heads; pick a tp that divides 2",
    ),
    "family-tp-heads": (
        ["train", "--model-name", "{tmp}/qwen3", "--nproc", "4", "--parallel.tp", "4"],
        _qwen3_six_heads,
        "--parallel.tp 4 does not divide the model's 6 attention heads; pick a tp that divides 6",
    ),
    "family-tp-experts": (
        ["train", "--model-name", "{tmp}/mixtral", "--nproc", "2", "--parallel.tp", "2"],
        _mixtral_three_experts,
        "--parallel.tp 2 does not divide the model's 3 experts; pick a degree that divides 3",
    ),
    "export-adapters-of-fused-parts": (
        ["export", "--checkpoint", "{tmp}/run", "--out", "{tmp}/adapters", "--adapter-only"],
        _lora_run_on_fused_projections,
        "--adapter-only: {tmp}/run's adapters sit on the parts of fused projections",
    ),
    "tokenizer-missing": (
        ["train", "--tokenizer-name", "{tmp}/no-tok"],
        None,
        "tokenizer directory {tmp}/no-tok does not exist",
    ),
    "generate-chat-answer-only": (
        ["generate", "--model-name", "{tmp}/chat", "--prompts", "{tmp}/p.jsonl", "--out", "{tmp}/r.jsonl"],
        _chat_answer_only,
        "{tmp}/p.jsonl:1: the conversation holds only an assistant turn; nothing asks for one",
    ),
    # the run directory
    "run-resume-false": (["train", "--resume", "false"], None, "already holds a run"),
    "run-in-use": (["train"], _held_by_another_job, "is in use by another job (host "),
    # checkpoints (in the existing output directory, which resumes from checkpoints/latest)
    "ckpt-latest-missing": (
        ["train"],
        lambda out, tmp: (out / "checkpoints" / "latest").write_text("step-99\n"),
        "step-99 named by",
    ),
    "ckpt-other-model": (["train", "--arch.hidden-size", "32"], None, "is from another model"),
    "ckpt-other-model-finished": (
        ["train", "--max-steps", "2", "--arch.hidden-size", "32"],
        None,
        "step-2 is from another model",
    ),
    "ckpt-corrupt-meta": (
        ["train"],
        _edit_checkpoint(lambda step, tmp: (step / "trainer.json").write_text("{")),
        "step-2/trainer.json has 1 bytes, the save wrote",
    ),
    "ckpt-missing-shard": (
        ["train"],
        _edit_checkpoint(lambda step, tmp: (step / "state" / "__0_0.distcp").unlink()),
        "step-2/state/__0_0.distcp is missing) and no older complete checkpoint is whole",
    ),
    "ckpt-damaged-in-place": (
        ["train"],
        _edit_checkpoint(_zero_4k_in_shard),
        "__0_0.distcp does not match its checksum (changed after the save)) and no older complete checkpoint",
    ),
    "ckpt-pickle-payload": (["train"], _edit_checkpoint(_malicious_metadata), "pathlib.Path.touch is not allowed"),
    # parallel degrees
    "degrees-not-divisible": (
        ["train", "--nproc", "3", "--parallel.tp", "2"],
        None,
        "world size 3 is not divisible by tp x pp = 2 x 1",
    ),
    "degrees-single-many": (["train", "--nproc", "2", "--strategy", "single"], None, "runs in one process"),
    "degrees-zero-tp": (["train", "--parallel.tp", "0"], None, "--parallel.tp must be at least 1"),
    # mixtures of experts (parallel/expert.py)
    "moe-ep-dense-model": (
        ["train", "--nproc", "2", "--parallel.ep", "2"],
        None,
        "--parallel.ep 2 splits a mixture of experts, and the llama model has no experts; drop --parallel.ep",
    ),
    "moe-ep-ranks": (
        ["train", "--nproc", "2", "--parallel.ep", "4", "--model-name", "{tmp}/mixtral"],
        _moe("mixtral", 4),
        "--parallel.ep 4 does not divide the 2 data-parallel ranks; pick an ep that divides 2",
    ),
    "moe-ep-experts": (
        ["train", "--nproc", "2", "--parallel.ep", "2", "--model-name", "{tmp}/mixtral"],
        _moe("mixtral", 3),
        "--parallel.ep 2 does not divide the model's 3 experts; pick a degree that divides 3",
    ),
    "moe-tp-experts": (
        ["train", "--nproc", "2", "--parallel.tp", "2", "--model-name", "{tmp}/mixtral"],
        _moe("mixtral", 3),
        "--parallel.tp 2 does not divide the model's 3 experts; pick a degree that divides 3",
    ),
    "moe-ep-ddp": (
        ["train", "--nproc", "2", "--strategy", "ddp", "--parallel.ep", "2", "--model-name", "{tmp}/mixtral"],
        _moe("mixtral", 4),
        "--parallel.ep 2 splits the experts over FSDP's shards: use --strategy zero2, zero3, fsdp, hsdp",
    ),
    "moe-ep-no-dispatch": (
        ["train", "--nproc", "2", "--parallel.ep", "2", "--model-name", "{tmp}/jetmoe"],
        _moe("jetmoe", 4),
        "meshlm cannot dispatch tokens to the experts of model family 'jetmoe'",
    ),
    "moe-lora-experts-dropout": (
        [
            "train",
            "--model-name",
            "{tmp}/mixtral",
            "--lora.r",
            "2",
            "--lora.targets",
            "q_proj,gate_up_proj",
            "--lora.dropout",
            "0.1",
        ],
        _moe("mixtral", 4),
        "--lora.targets gate_up_proj adapts grouped expert weights, whose peft adapters take no dropout",
    ),
    "lora-nf4-layout": (
        ["train", "--nproc", "2", "--parallel.tp", "2", "--lora.r", "4", "--lora.quantize", "nf4"],
        None,
        "--lora.quantize nf4 holds its 4-bit weights under --strategy single, ddp, zero3, fsdp or hsdp",
    ),
    "lora-nf4-shapes": (
        ["train", "--lora.r", "4", "--lora.quantize", "nf4"],
        None,
        "q_proj.weight has shape [64, 64], 4096 values: not a multiple of 16384",
    ),
    # context parallel and the chunked loss (TINY: 4 heads, 2 key/value heads, 64 tokens)
    "cp-seq-length": (
        ["train", "--nproc", "2", "--parallel.cp", "2", "--seq-length", "63"],
        None,
        "--parallel.cp 2 splits each sequence over 2 ranks; --seq-length 63 is not a multiple of 2",
    ),
    "cp-zigzag-seq-length": (
        ["train", "--nproc", "4", "--parallel.cp", "4", "--seq-length", "36"],
        None,
        "--parallel.cp 4 splits each sequence into 8 zig-zag chunks (attention by ring); --seq-length 36 is not a "
        "multiple of 8",
    ),
    "cp-heads": (
        ["train", "--nproc", "4", "--parallel.cp", "4", "--parallel.cp-attention", "ulysses"],
        None,
        "a tensor-parallel rank has 4 heads and 2 key/value heads: pick a cp dividing both",
    ),
    "cp-family": (
        ["train", "--nproc", "2", "--parallel.cp", "2", "--model-name", "{tmp}/bloom"],
        _bloom_model,
        "model family 'bloom' does not: train it without --parallel.cp",
    ),
    "cp-not-divisible": (
        ["train", "--nproc", "3", "--parallel.cp", "2"],
        None,
        "world size 3 is not divisible by tp x pp x cp = 1 x 1 x 2",
    ),
    "cp-ep": (
        ["train", "--nproc", "2", "--parallel.cp", "2", "--parallel.ep", "2"],
        None,
        "--parallel.ep 2 does not divide the 1 data-parallel ranks (experts are split over data-parallel ranks, not "
        "over the --parallel.cp 2 ranks of a sequence); add ranks or pick an ep that divides 1",
    ),
    "chunked-loss-value": (["train", "--chunked-loss", "lots"], None, "--chunked-loss must be auto, on, off"),
    # launch options
    "launch-nproc": (["train", "--nproc", "-1"], None, "--nproc must be at least 1, got -1"),
    "launch-nproc-zero": (["train", "--nproc", "0"], None, "--nproc must be at least 1, got 0 (leave it out"),
    "launch-cpu-offload": (
        ["train", "--strategy", "zero3", "--cpu-offload"],
        None,
        "--cpu-offload moves GPU state to the CPU: it needs CUDA GPUs",
    ),
    "launch-no-endpoint": (["train", "--nproc", "2", "--nnodes", "2"], None, "--nnodes > 1 needs --rdzv-endpoint"),
    "launch-endpoint-port": (
        ["train", "--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "node1"],
        None,
        "--rdzv-endpoint must be HOST:PORT",
    ),
    "launch-node-rank": (
        ["train", "--nproc", "2", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:29400"],
        None,
        "--node-rank 2 is outside 0..1",
    ),
    "launch-flags-without-nproc": (["train", "--nnodes", "2"], None, "need --nproc N"),
    "launch-dist-timeout": (["train", "--dist-timeout", "0"], None, "--dist-timeout must be a positive number"),
    "launch-no-gpus": (["train", "--nproc", "64", "--backend", "nccl"], None, "visible GPU"),
    "trace-no-pipeline": (
        ["train", "--trace-pipeline"],
        None,
        "--trace-pipeline draws a pipeline's schedule: it needs --parallel.pp 2 or more",
    ),
    # paths that cannot be written
    "path-output-dir-virtual": (
        ["train", "--output-dir", "/proc/meshlm-out"],
        None,
        "--output-dir must be a directory meshlm can create and write into",
    ),
    "path-output-dir-under-file": (
        ["train", "--output-dir", "{tmp}/d.jsonl/out"],
        _write("d.jsonl", '{"text": "a"}\n'),
        "got '{tmp}/d.jsonl/out'; pick another",
    ),
    "path-cache-unwritable": (
        ["train", "--builtin-samples", "401"],
        _cache_in("/proc/meshlm-cache"),
        "the cache /proc/meshlm-cache cannot be created or written",
    ),
    # numbers and names outside their domain, options the run would not read
    "domain-lr-nan": (["train", "--lr", "nan"], None, "--lr must be positive and finite, got nan"),
    "domain-adam-beta": (["train", "--beta1", "1.5"], None, "--beta1 must be in [0, 1), got 1.5"),
    "domain-seed": (["train", "--seed", "-1"], None, "--seed must be in 0 .. 2**63 - 1, got -1"),
    "domain-timeout-inf": (["train", "--dist-timeout", "inf"], None, "--dist-timeout must be a positive number"),
    "domain-kv-heads": (["train", "--arch.kv-heads", "0"], None, "--arch.kv-heads must be at least 1, got 0"),
    "domain-weight-decay": (["train", "--weight-decay", "-0.1"], None, "--weight-decay must be a finite number, not"),
    "domain-min-lr-ratio": (["train", "--min-lr-ratio", "-0.5"], None, "--min-lr-ratio must be in [0, 1], got -0.5"),
    "domain-max-positions": (["train", "--arch.max-positions", "0"], None, "--arch.max-positions must be at least 1"),
    "domain-experiment-name": (
        ["train", "--experiment-name", ".."],
        None,
        "--experiment-name must be a plain name (not empty, '.' or '..', no path separator), got '..'",
    ),
    "option-not-read": (
        ["train", "--parallel.shard-size", "2"],
        None,
        "--parallel.shard-size 2 is read only under --strategy hsdp: drop it",
    ),
    "option-arch-with-model": (
        ["train", "--model-name", "{tmp}/m", "--arch.layers", "2"],
        _llama(),
        "--arch.layers 2 is read only by the built-in model (without --model-name",
    ),
    "option-prefix": (
        ["train", "--max-step", "5"],
        None,
        "unrecognized arguments: --max-step 5; did you mean --max-steps?",
    ),
    # damaged files
    "data-null-response": (
        ["train", "--dataset-name", "{tmp}/d.jsonl"],
        _write("d.jsonl", '{"instruction": "a", "output": null}\n'),
        "d.jsonl record 1: field 'output' is null, not text; give it a string or drop the record",
    ),
    "data-not-utf8": (
        ["train", "--dataset-name", "{tmp}/d.jsonl"],
        _write_bytes("d.jsonl", b'{"text": "a"}\n{"text": "\xff"}\n'),
        "d.jsonl:2 is not UTF-8 text (byte 0xff); save it as UTF-8",
    ),
    "data-nested-too-deep": (
        ["train", "--dataset-name", "{tmp}/d.jsonl"],
        _write_bytes("d.jsonl", b"[" * 100_000 + b"\n"),
        "d.jsonl:1 is JSON nested too deeply to read",
    ),
    "config-not-utf8": (
        ["train", "--config", "{tmp}/c.toml"],
        _write_bytes("c.toml", b"max_steps = 5\nexperiment_name = '\xff'\n"),
        "c.toml:2 is not UTF-8 text",
    ),
    "config-typo-toml-spelling": (
        ["train", "--config", "{tmp}/c.toml"],
        _write("c.toml", "max_step = 5\n"),
        "unknown config key 'max_step' in {tmp}/c.toml (did you mean max_steps?)",
    ),
    "model-config-damaged": (
        ["train", "--model-name", "{tmp}/m"],
        _llama(damage=lambda d: _cut_in_half(d / "config.json")),
        "m/config.json is not valid JSON",
    ),
    "model-no-tokenizer": (
        ["train", "--model-name", "{tmp}/m"],
        _llama(tokenizer=False),
        "model directory {tmp}/m has no tokenizer files (tokenizer.json,",
    ),
    "model-weights-cut-short": (
        ["train", "--model-name", "{tmp}/m", "--pretrained"],
        _llama(weights=True, damage=lambda d: _cut_in_half(d / "model.safetensors")),
        "m/model.safetensors is not a readable safetensors file",
    ),
    "pp-split-count": (
        ["train", "--nproc", "2", "--parallel.pp", "2", "--parallel.pp-split", "0"],
        None,
        "--parallel.pp-split needs 1 layer index between 1 and 1",
    ),
    "export-no-checkpoint": (
        ["export", "--checkpoint", "{tmp}/a-zer03", "--out", "{tmp}/hf"],
        None,
        "checkpoint {tmp}/a-zer03 does not exist",
    ),
    # slurm
    "slurm-no-train": (
        ["slurm", "--nodes", "2", "--gpus-per-node", "8", "--time", "1:00:00"],
        None,
        "needs the training command after --",
    ),
    "slurm-launch-flag": (
        ["slurm", "--nodes", "2", "--gpus-per-node", "8", "--time", "1:00:00", "--", "train", "--nproc", "8"],
        None,
        "--nproc in the training arguments",
    ),
    "slurm-time": (
        ["slurm", "--nodes", "2", "--gpus-per-node", "8", "--time", "4h", "--", "train"],
        None,
        "--time must be a Slurm time",
    ),
}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A real (in-process) run with checkpoints: the existing output directory every row must leave alone."""
    out = tmp_path_factory.mktemp("finished") / "out"
    deterministic = torch.are_deterministic_algorithms_enabled()
    with pytest.raises(SystemExit) as e:
        cli.main(
            [
                "train",
                *TINY,
                "--micro-batch-size",
                "4",
                "--max-steps",
                "2",
                "--ckpt-every",
                "1",
                "--output-dir",
                str(out),
            ]
        )
    torch.use_deterministic_algorithms(deterministic)
    assert e.value.code == 0
    return out


def _fill(args: list[str], out: Path, tmp: Path) -> list[str]:
    return [a.format(out=out, tmp=tmp) for a in args]


def _documented() -> dict[str, str]:
    rows = {}
    for line in DOCS.read_text().splitlines():
        m = re.match(r"\|\s*`([a-z0-9-]+)`\s*\|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def test_every_case_is_documented():
    docs = _documented()
    assert set(docs) == set(CASES), (
        f"rows without a test: {set(docs) - set(CASES)}; tests without a row: {set(CASES) - set(docs)}"
    )
    for case, (_, _, expect) in CASES.items():
        assert expect.replace("{tmp}/", "") in docs[case].replace("\\|", "|"), (case, docs[case])
    assert len(CASES) >= 20


# Rows that are about one process, or set their own launch: walked once. Every other `train` row is walked in
# this process and again under `--nproc 2` (the launcher in this process; ranks only when the input passes
# every check made before they start: then two real ranks find it and the console still gets one line).
ONCE = {"launch-flags-without-nproc"}
WALKS = [
    (case, nproc)
    for case in sorted(CASES)
    for nproc in (1, 2)
    if nproc == 1 or (CASES[case][0][0] == "train" and "--nproc" not in CASES[case][0] and case not in ONCE)
]


@pytest.mark.parametrize("case,nproc", WALKS, ids=[f"{c}-nproc{n}" for c, n in WALKS])
def test_bad_input(case, nproc, finished_run, tmp_path, capsys, monkeypatch):
    args, setup, expect = CASES[case]
    out = tmp_path / "out"
    shutil.copytree(finished_run, out)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    temp = tmp_path / "temp"  # where the launcher makes its meshlm-launch-* directory: nothing must stay
    temp.mkdir()
    multiprocessing.util.get_temp_dir()  # the fork server's socket directory, one per process (gone at its exit)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setattr(sys, "path", list(sys.path))  # a setup may put an older package's metadata first
    env = setup(out, scratch) if setup else None
    for name, value in (env if isinstance(env, dict) else {}).items():  # a setup may return an environment
        monkeypatch.setenv(name, value)
    args = _fill(args, out, scratch)
    if args[0] == "train":  # the case's own options come last: they win over TINY's
        # the finished run's global batch of 4 (a resumed run keeps it): micro-batch 2 on 2 ranks, 4 on one
        two = nproc == 2 or "--nproc" in args
        launch = ["--nproc", "2"] * (nproc == 2) + ["--micro-batch-size", "2" if two else "4"]
        tiny = without_arch(TINY) if "--model-name" in args else TINY  # a named model has its own dimensions
        args = ["train", *tiny, *launch, "--output-dir", str(out), *args[1:]]
    before = tree_digest(out)
    capsys.readouterr()

    deterministic = torch.are_deterministic_algorithms_enabled()
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    torch.use_deterministic_algorithms(deterministic)

    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert e.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("meshlm: error: "), err
    assert expect.format(tmp=scratch) in lines[0], lines[0]
    assert tree_digest(out) == before
    assert not (scratch / "pwned").exists()  # no code from a checkpoint, config file or model directory ran
    assert not list(temp.iterdir()), list(temp.iterdir())
