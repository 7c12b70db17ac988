"""`meshlm generate`: every mode against transformers' own `generate`, real gloo ranks, bad input.

The model is a tiny random Llama (fp32) saved with save_pretrained next to the
built-in byte tokenizer. Its EOS is chosen as the token greedy decoding emits
most often, so some prompts stop early and others run to --max-new-tokens.
The reference decodes each prompt alone (batch of one, no padding) with
`model.generate`; meshlm batches them with left padding in every mode, and
greedy tokens must be identical (exact equality, no tolerance).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from conftest import TINY, run_cases, run_meshlm
from meshlm.cli import main
from meshlm.data.builtin import byte_tokenizer
from meshlm.data.records import format_prompt

pytestmark = pytest.mark.slow

MAX_NEW = 10
POSITIONS = 96


@dataclass
class Tiny:
    model: Path
    prompts_file: Path
    prompts: list[str]
    ref: list[list[int]]  # greedy token ids per prompt, EOS included when reached
    tokenizer: object
    hf: object


def _greedy(model, ids: list[int], eos: int | None, max_new: int = MAX_NEW) -> list[int]:
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=256
    )[0, len(ids) :].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


def _records() -> list[dict]:
    """13 prompts of 2 to ~50 tokens: plain 'prompt' fields and Alpaca instruction (+ input) records."""
    recs = []
    for i in range(13):
        if i % 3 == 0:
            recs.append({"instruction": "Copy" + " it" * (i // 3), **({"input": "ab c"} if i % 2 else {})})
        else:
            recs.append({"prompt": ("q" * (5 * i)) + f" {i}?"})
    return recs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    d = tmp_path_factory.mktemp("generate")
    tok = byte_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=POSITIONS,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        eos_token_id=None,
        initializer_range=0.2,
    )  # peaked logits: greedy ties are out of float rounding's reach
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    recs = _records()
    prompts = [r["prompt"] if "prompt" in r else format_prompt(r) for r in recs]
    ids = [tok(p)["input_ids"] for p in prompts]
    free = [_greedy(model, t, None) for t in ids]
    eos = Counter(x for seq in free for x in seq[1:]).most_common(1)[0][0]
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    ref = [_greedy(model, t, eos) for t in ids]
    stopped = sum(seq[-1] == eos for seq in ref)
    assert 0 < stopped < len(ref), "the fixture must mix early EOS stops with full-length completions"
    model.save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    pf = d / "prompts.jsonl"
    pf.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return Tiny(d / "model", pf, prompts, ref, tok, model)


# a chat template as the chat training tests use: every turn tagged by its role, the assistant's opened at the end
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "2+2?"}],
    [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Copy: ab c"}],
    # a training record: its answer is left out, the model is asked for it
    [{"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}],
]


@dataclass
class Chats:
    model: Path  # the tiny model with a tokenizer that has CHAT_TEMPLATE
    prompts_file: Path
    rendered: list[str]
    ref: list[list[int]]


@pytest.fixture(scope="module")
def chats(tiny, tmp_path_factory) -> Chats:
    """`messages` records and transformers' greedy tokens on apply_chat_template's ids (generation prompt added)."""
    d = tmp_path_factory.mktemp("chat")
    tok = byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    asked = [c[:-1] if c[-1]["role"] == "assistant" else c for c in CONVERSATIONS]
    rendered = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in asked]
    ids = [tok.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"] for c in asked]
    eos = tiny.hf.generation_config.eos_token_id
    tiny.hf.save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    (d / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    return Chats(d / "model", d / "chats.jsonl", rendered, [_greedy(tiny.hf, t, eos) for t in ids])


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _args(tiny: Tiny, out: Path) -> list:
    return ["--model-name", tiny.model, "--prompts", tiny.prompts_file, "--out", out, "--max-new-tokens", MAX_NEW,
            "--batch-size", "4"]  # fmt: skip


def _generate(tiny: Tiny, out: Path, *args: str):
    return run_meshlm("generate", *_args(tiny, out), *args)


SAMPLING = {"temperature": 1.5, "top_p": 0.95, "seed": 11}  # the 3-rank launch's; in one process as options
CHECKPOINT_PROMPTS = [{"instruction": "Add the two numbers.", "input": "12 + 30"}, {"prompt": "hello"}]


@dataclass
class Launched:
    """What the module's two launches wrote (tests/helpers/family_runs.py: every case in the ranks of one job, so
    the module pays each world size's process start-up once): generate's outputs by case id, and the 2-stage
    pipeline training run whose checkpoint test_loads_training_checkpoint reads."""

    outs: dict[str, Path]
    run: Path


def _gen_case(case_id: str, out: Path, **args) -> dict:
    return {"id": case_id, "kind": "generate", "args": {"out": str(out), "batch_size": 4, **args}}


@pytest.fixture(scope="module")
def launched(tiny, chats, tmp_path_factory) -> Launched:
    """2 ranks: greedy tp and pp (also of chat prompts), then a pp 2 training run and tp/pp generation from its
    checkpoint; 3 ranks: greedy dp (13 prompts: 5 + 4 + 4; and the chat prompts) and seeded sampling of 2 prompts
    (fewer prompts than ranks)."""
    work = tmp_path_factory.mktemp("generate-launches")
    run, outs = work / "run", {}
    mine = {"model_name": str(tiny.model), "prompts": str(tiny.prompts_file), "max_new_tokens": MAX_NEW}
    chat = {"model_name": str(chats.model), "prompts": str(chats.prompts_file), "max_new_tokens": MAX_NEW}
    two, ckpt_prompts = work / "two.jsonl", work / "ckpt-prompts.jsonl"
    two.write_text("".join(line + "\n" for line in tiny.prompts_file.read_text().splitlines()[:2]))
    ckpt_prompts.write_text("".join(json.dumps(r) + "\n" for r in CHECKPOINT_PROMPTS))
    from_ckpt = {"checkpoint": str(run), "prompts": str(ckpt_prompts), "max_new_tokens": 6}
    train = [*TINY, "--parallel.pp", "2", "--micro-batch-size", "4", "--max-steps", "3", "--output-dir", str(run)]
    cases = {
        2: [_gen_case(f"{m}2", work / f"{m}2.jsonl", mode=m, **mine) for m in ("tp", "pp")]
        + [_gen_case(f"chat-{m}2", work / f"chat-{m}2.jsonl", mode=m, **chat) for m in ("tp", "pp")]
        + [{"id": "train", "kind": "train", "args": train}]
        + [_gen_case(f"ckpt-{m}", work / f"ckpt-{m}.jsonl", mode=m, **from_ckpt) for m in ("tp", "pp")],
        3: [
            _gen_case("dp3", work / "dp3.jsonl", mode="dp", **mine),
            _gen_case("chat-dp3", work / "chat-dp3.jsonl", mode="dp", **chat),
            _gen_case("sample3", work / "sample3.jsonl", mode="dp", **{**mine, "prompts": str(two)}, sampling=SAMPLING),
        ],
    }
    for world, some in cases.items():
        run_cases(world, some, work / f"launch-{world}")
        outs |= {c["id"]: Path(c["args"]["out"]) for c in some if c["kind"] == "generate"}
    return Launched(outs, run)


@pytest.mark.parametrize(
    "mode,ranks,how",
    [("dp", 2, "cli"), ("dp", 3, "dp3"), ("tp", 2, "tp2"), ("pp", 2, "pp2"), ("layer-split", 1, "in-process")],
    ids=["dp2", "dp3", "tp2", "pp2", "layer-split"],
)
def test_greedy_matches_transformers_generate(tiny, launched, tmp_path, capsys, mode, ranks, how):
    """dp 2 through `meshlm generate --nproc 2` (its launcher), layer split in this process (two CPU "devices"),
    the others from the module's launches."""
    out = launched.outs.get(how, tmp_path / "out.jsonl")
    if how == "cli":
        _generate(tiny, out, "--mode", mode, "--nproc", "2")
    elif how == "in-process":
        code, err = _cli(capsys, *_args(tiny, out), "--mode", mode, "--devices", "cpu,cpu")
        assert code == 0, err
    recs = _read(out)
    assert [r["index"] for r in recs] == list(range(len(tiny.prompts)))  # each prompt once, in input order
    assert [r["prompt"] for r in recs] == tiny.prompts
    assert [r["token_ids"] for r in recs] == tiny.ref
    assert [r["completion"] for r in recs] == [tiny.tokenizer.decode(t, skip_special_tokens=True) for t in tiny.ref]
    assert [r["new_tokens"] for r in recs] == [len(t) for t in tiny.ref]
    eos = tiny.hf.generation_config.eos_token_id
    assert [r["finish"] for r in recs] == ["eos" if t[-1] == eos else "length" for t in tiny.ref]
    s = json.loads(out.with_name(out.name.removesuffix(".jsonl") + ".summary.json").read_text())
    assert (s["mode"], s["ranks"], s["prompts"], s["new_tokens"]) == (mode, ranks, 13, sum(map(len, tiny.ref)))
    assert s["tokens_per_s"] > 0 and s["prompts_per_s"] > 0 and s["ttft_p99_s"] >= s["ttft_p50_s"] > 0
    assert s["token_latency_p99_s"] >= s["token_latency_p50_s"] > 0
    assert sorted(r["rank"] for r in s["per_rank"]) == list(range(ranks))
    assert all(r["mem_peak_bytes"] > 0 and r["cpu_s"] > 0 for r in s["per_rank"])


@pytest.mark.parametrize("mode", ["dp3", "tp2", "pp2", "layer-split"])
def test_chat_prompts_are_rendered_with_the_chat_template(chats, launched, tmp_path, capsys, mode):
    """`messages` records: the tokenizer's chat template with the generation prompt, in every mode; greedy tokens
    equal transformers' generate on apply_chat_template's ids."""
    out = launched.outs.get(f"chat-{mode}", tmp_path / "out.jsonl")
    if mode == "layer-split":
        args = ["--model-name", chats.model, "--prompts", chats.prompts_file, "--out", out]
        code, err = _cli(capsys, *args, "--max-new-tokens", MAX_NEW, "--mode", mode, "--devices", "cpu,cpu")
        assert code == 0, err
    recs = _read(out)
    assert [r["prompt"] for r in recs] == chats.rendered
    assert [r["token_ids"] for r in recs] == chats.ref


@pytest.mark.parametrize("attention,mode", [("sdpa", "dp"), ("varlen", "dp"), ("varlen", "layer-split")])
def test_every_cpu_kernel_gives_transformers_tokens(tiny, tmp_path, capsys, attention, mode):
    """--attention sdpa and varlen (meshlm_varlen; auto is meshlm_sdpa, the other tests') give transformers' greedy
    tokens over padded batches of prompts, whole and cut into stages (layer split: the stages' own masks)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from meshlm.models.attention import DOCUMENTS

    kernel = DOCUMENTS if attention == "varlen" else "sdpa"
    registered, calls = ALL_ATTENTION_FUNCTIONS[kernel], []

    def counted(*args, **kwargs):  # the model really runs the chosen kernel, not only names it
        calls.append(1)
        return registered(*args, **kwargs)

    out = tmp_path / "out.jsonl"
    devices = ["--devices", "cpu,cpu"] if mode == "layer-split" else []
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, kernel, counted)
        code, err = _cli(capsys, *_args(tiny, out), "--mode", mode, *devices, "--attention", attention)
    assert code == 0, err
    assert calls, f"no call of {kernel}"
    assert [r["token_ids"] for r in _read(out)] == tiny.ref
    assert json.loads(out.with_name("out.summary.json").read_text())["attention"] == attention


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_greedy_matches_transformers_generate(tiny, tmp_path):
    """On a GPU (device cuda:0, fp32): the same tokens as transformers' generate on that GPU."""
    model = tiny.hf.to("cuda")
    eos = model.generation_config.eos_token_id
    ref = []
    for p in tiny.prompts:
        ids = torch.tensor([tiny.tokenizer(p)["input_ids"]], device="cuda")
        out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=256)[0, ids.shape[1] :].tolist()
        ref.append(out[: out.index(eos) + 1] if eos in out else out)
    tiny.hf.to("cpu")
    _generate(tiny, tmp_path / "out.jsonl")
    assert [r["token_ids"] for r in _read(tmp_path / "out.jsonl")] == ref
    assert json.loads((tmp_path / "out.summary.json").read_text())["per_rank"][0]["device"] == "cuda:0"


def test_sampling_is_seeded_per_prompt_not_per_rank(tiny, launched, tmp_path, capsys):
    """One process (this one) on 13 prompts vs 3 ranks on the first 2 of them (fewer prompts than ranks):
    the same samples."""
    code, err = _cli(
        capsys,
        *_args(tiny, tmp_path / "one.jsonl"),
        *(x for k, v in SAMPLING.items() for x in (f"--{k.replace('_', '-')}", v)),
    )
    assert code == 0, err
    one, three = _read(tmp_path / "one.jsonl"), _read(launched.outs["sample3"])
    assert [r["index"] for r in three] == [0, 1]
    assert [r["token_ids"] for r in three] == [r["token_ids"] for r in one[:2]]
    assert [r["token_ids"] for r in one] != tiny.ref  # it really sampled


def test_prompt_sources(tmp_path):
    """.txt (one per non-empty line), .jsonl ('prompt' or Alpaca records, formatted as training formats them) and
    a dataset directory's split all give the prompts in file order."""
    from meshlm.infer.prompts import read_prompts

    alpaca = [
        {"instruction": "Add the two numbers.", "input": "1 + 2", "output": "3"},
        {"instruction": "Say hi", "input": "", "output": "hi"},
    ]
    (tmp_path / "p.txt").write_text("first line\n\nsecond: {x}\n")
    assert read_prompts(str(tmp_path / "p.txt")) == ["first line", "second: {x}"]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [{"prompt": "raw"}, *alpaca]))
    assert read_prompts(str(tmp_path / "p.jsonl")) == ["raw", *map(format_prompt, alpaca)]
    assert format_prompt(alpaca[0]).endswith("### Input:\n1 + 2\n\n### Response:\n")
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in alpaca))
    (ds / "test.jsonl").write_text(json.dumps(alpaca[1]) + "\n")
    assert read_prompts(str(ds), "test") == [format_prompt(alpaca[1])]


def _cli(capsys, *args) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(["generate", *map(str, args)])
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "case",
    [
        *("missing", "empty", "too-long", "mode", "tp-heads", "exists", "two-models", "layer-split-nproc"),
        *("flex-on-cpu", "chat-no-template", "chat-only-answer"),
    ],
)
def test_bad_input_is_one_line_exit_2(tiny, chats, tmp_path, capsys, case):
    out = tmp_path / "out.jsonl"
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    args = ["--model-name", tiny.model, "--prompts", prompts, "--out", out, "--max-new-tokens", MAX_NEW]
    expect = {
        "missing": "does not exist",
        "empty": "holds no prompts",
        "too-long": "--truncate",
        "mode": "--mode must be one of",
        "tp-heads": "divide",
        "exists": "--overwrite",
        "two-models": "exactly one of",
        "layer-split-nproc": "one process",
        "flex-on-cpu": "--attention flex: meshlm runs FlexAttention on CUDA only",
        "chat-no-template": "p.jsonl:1: chat records need a tokenizer with a chat template",
        "chat-only-answer": "p.jsonl:1: the conversation holds only an assistant turn",
    }[case]
    if case == "missing":
        args[3] = tmp_path / "nope.jsonl"
    elif case == "empty":
        prompts.write_text("\n  \n")
    elif case == "too-long":
        prompts.write_text("x" * (POSITIONS - MAX_NEW + 1) + "\n")
    elif case == "mode":
        args += ["--mode", "zigzag"]
    elif case == "tp-heads":
        args += ["--mode", "tp", "--nproc", "3"]  # 4 heads, 2 kv heads
    elif case == "exists":
        out.write_text("keep me\n")
    elif case == "two-models":
        args += ["--checkpoint", tmp_path]
    elif case == "layer-split-nproc":
        args += ["--mode", "layer-split", "--devices", "cpu,cpu", "--nproc", "2"]
    elif case == "flex-on-cpu":
        args += ["--attention", "flex", "--nproc", "2"]  # refused before any rank starts
    elif case.startswith("chat"):  # tiny's tokenizer has no chat template; the other model's has
        args[1] = tiny.model if case == "chat-no-template" else chats.model
        args[3] = tmp_path / "p.jsonl"
        args[3].write_text(json.dumps({"messages": [{"role": "assistant", "content": "6"}]}) + "\n")
    code, err = _cli(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("meshlm: error:") and expect in lines[0], err
    assert not out.exists() or out.read_text() == "keep me\n"
    assert not (tmp_path / "out.summary.json").exists()


def test_truncate_and_overwrite(tiny, tmp_path, capsys):
    """--truncate keeps a long prompt's last tokens; --overwrite replaces an existing output (in this process)."""
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    long = "w" * POSITIONS + "the end of a long prompt"
    prompts = tmp_path / "p.txt"
    prompts.write_text(long + "\nshort\n")
    code, _ = _cli(
        capsys,
        "--model-name",
        tiny.model,
        "--prompts",
        prompts,
        "--out",
        out,
        "--max-new-tokens",
        MAX_NEW,
        "--truncate",
        "--overwrite",
    )
    assert code == 0
    recs = _read(out)
    room = POSITIONS - MAX_NEW
    ids = tiny.tokenizer(long)["input_ids"]
    assert len(ids) > room and [r["truncated"] for r in recs] == [True, False]
    eos = tiny.hf.generation_config.eos_token_id
    assert recs[0]["token_ids"] == _greedy(tiny.hf, ids[-room:], eos)
    assert recs[1]["token_ids"] == _greedy(tiny.hf, tiny.tokenizer("short")["input_ids"], eos)


def test_loads_training_checkpoint(launched, tmp_path, capsys):
    """A checkpoint written by a 2-stage pipeline training run (each rank saved only its stage) loads into one
    plain model with exactly the weights DCP's own converter reads back, given as the run directory or as
    step-N, and generates what those weights generate in transformers: in dp, and in tp 2, pp 2 and layer
    split, where each rank reads only its shards or its stage's tensors from the checkpoint."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from meshlm.infer.load import load_model
    from meshlm.models.source import ModelSource

    run = launched.run
    dcp_to_torch_save(run / "checkpoints" / "step-3" / "state", tmp_path / "full.pt")
    saved = torch.load(tmp_path / "full.pt", weights_only=True)["model"]
    model = load_model(ModelSource.of_checkpoint(str(run)))
    mine = model.state_dict()
    assert sorted(mine) == sorted(saved)
    assert all(torch.equal(mine[k], saved[k]) for k in saved)

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in CHECKPOINT_PROMPTS))
    tok = byte_tokenizer()
    ref = [
        _greedy(model, tok(format_prompt(r) if "instruction" in r else r["prompt"])["input_ids"], tok.eos_token_id, 6)
        for r in CHECKPOINT_PROMPTS
    ]
    for ckpt in (run, run / "checkpoints" / "step-3"):
        out = tmp_path / f"{ckpt.name}.jsonl"
        code, err = _cli(capsys, "--checkpoint", ckpt, "--prompts", prompts, "--out", out, "--max-new-tokens", 6)
        assert code == 0, err
        assert [r["token_ids"] for r in _read(out)] == ref
    args = ["--checkpoint", run, "--prompts", prompts, "--max-new-tokens", 6, "--out"]
    assert _cli(capsys, *args, tmp_path / "ls.jsonl", "--mode", "layer-split", "--devices", "cpu,cpu")[0] == 0
    assert [r["token_ids"] for r in _read(tmp_path / "ls.jsonl")] == ref
    for mode in ("tp", "pp"):  # from the module's 2-rank launch
        assert [r["token_ids"] for r in _read(launched.outs[f"ckpt-{mode}"])] == ref, mode
