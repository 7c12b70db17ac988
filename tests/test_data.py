"""Data, config and model loading from local files and directories (nothing is downloaded)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from conftest import TINY, assert_close, losses, metrics, run_cases, run_meshlm
from helpers.checkpoints import read_tensors
from helpers.data import load_blocks
from meshlm import config as config_mod
from meshlm.data import builtin
from meshlm.data.batch import IGNORE
from meshlm.data.load import dataset_source, records
from meshlm.data.pack import Blocks, BlockWriter
from meshlm.data.records import encode
from meshlm.data.sampler import ResumableSampler
from meshlm.errors import MeshlmError
from meshlm.models.build import load_tokenizer
from meshlm.parallel.loss import token_loss_sum

pytestmark = pytest.mark.slow


def test_sampler_ranks_partition_the_single_process_batch():
    single = list(ResumableSampler(100, 1, 0, seed=3, batch_size=8))
    per_rank = [list(ResumableSampler(100, 4, r, seed=3, batch_size=2)) for r in range(4)]
    assert len(single) == 12 and all(len(b) == 12 for b in per_rank)  # drop_last: 96 of 100 used
    for step in range(12):
        union = sorted(torch.cat([per_rank[r][step] for r in range(4)]).tolist())
        assert union == sorted(single[step].tolist())


def test_sampler_resumes_mid_epoch_and_reshuffles_per_epoch():
    s = ResumableSampler(50, 2, 1, seed=0, batch_size=5)
    s.set_epoch(1)
    full = [b.tolist() for b in s]
    s.set_epoch(1, start_batch=3)
    assert [b.tolist() for b in s] == full[3:]
    s.set_epoch(2)
    assert [b.tolist() for b in s] != full


def test_builtin_corpus_is_deterministic_and_structured():
    a, b = builtin.corpus(50, seed=1), builtin.corpus(50, seed=1)
    assert a == b and a != builtin.corpus(50, seed=2)
    adds = [r for r in a if r["instruction"].startswith("Add")]
    assert adds and all(int(r["output"]) == sum(map(int, r["input"].split(" + "))) for r in adds)
    tok = builtin.byte_tokenizer()
    text = "Sort: 3 1 2 ünïcode"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_local_files_alpaca_text_json_txt(tmp_path):
    recs = [{"instruction": "Add", "input": "1 + 2", "output": "3"}, {"instruction": "Hi", "input": "", "output": "Yo"}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "plain text"}))
    (tmp_path / "c.json").write_text(json.dumps(recs))
    (tmp_path / "d.txt").write_text("line one\n\nline two\n")
    cfg = config_mod.Config()
    cfg.dataset_name = str(tmp_path / "a.jsonl")
    assert list(records(cfg)) == recs
    tok = builtin.byte_tokenizer()
    ids, learned = encode(recs[0], tok, "response", "a")
    assert tok.decode(ids) == "### Instruction:\nAdd\n\n### Input:\n1 + 2\n\n### Response:\n3<|eos|>"
    assert tok.decode([t for t, keep in zip(ids, learned) if keep]) == "3<|eos|>"
    cfg.dataset_name = str(tmp_path / "b.jsonl")
    assert list(records(cfg)) == [{"text": "plain text"}]
    cfg.dataset_name = str(tmp_path / "c.json")
    assert len(list(records(cfg))) == 2
    cfg.dataset_name = str(tmp_path / "d.txt")  # one document per paragraph, or the whole file
    assert list(records(cfg)) == [{"text": "line one"}, {"text": "line two"}]
    cfg.text_unit = "file"
    assert list(records(cfg)) == [{"text": "line one\n\nline two"}]
    cfg.dataset_name = str(tmp_path / "missing.jsonl")
    with pytest.raises(MeshlmError, match="does not exist"):
        dataset_source(cfg)


def test_dataset_directory_goes_through_datasets_load_dataset(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    (d / "train.jsonl").write_text("\n".join(json.dumps({"text": f"row {i}"}) for i in range(5)))
    cfg = config_mod.Config()
    cfg.dataset_name = str(d)
    assert dataset_source(cfg)[0] == "hub"
    assert [r["text"] for r in records(cfg)] == [f"row {i}" for i in range(5)]
    cfg.streaming = True  # read lazily, record by record
    assert [r["text"] for r in records(cfg)] == [f"row {i}" for i in range(5)]


def test_a_directory_save_to_disk_wrote_is_read_with_its_splits(tmp_path):
    """What `Dataset.save_to_disk` and `DatasetDict.save_to_disk` write (load_dataset refuses both) trains and
    prompts; a split the saved dict lacks is one line naming the splits it has."""
    import datasets

    from meshlm.infer.prompts import read_prompts

    rows = [{"text": f"row {i}"} for i in range(5)]
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "one")
    split = {"train": datasets.Dataset.from_list(rows[:3]), "test": datasets.Dataset.from_list(rows[3:])}
    datasets.DatasetDict(split).save_to_disk(tmp_path / "dict")
    cfg = config_mod.Config()
    cfg.dataset_name = str(tmp_path / "one")
    assert [r["text"] for r in records(cfg)] == [f"row {i}" for i in range(5)]
    cfg.dataset_name, cfg.streaming = str(tmp_path / "dict"), True
    assert [r["text"] for r in records(cfg)] == ["row 0", "row 1", "row 2"]
    assert [r["text"] for r in records(cfg, "test")] == ["row 3", "row 4"]
    cfg.dataset_split = "validation"
    with pytest.raises(MeshlmError, match="split 'validation'.*holds the splits train, test, not 'validation'"):
        list(records(cfg))
    datasets.Dataset.from_list([{"prompt": "p1"}, {"prompt": "p2"}]).save_to_disk(tmp_path / "prompts")
    assert read_prompts(str(tmp_path / "prompts")) == ["p1", "p2"]


def test_training_data_needs_no_datasets_package(tmp_path):
    """`datasets` is imported only for hub datasets: with it unimportable, local data still tokenises."""
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in builtin.corpus(50, 0)))
    code = (
        "import sys; sys.modules['datasets'] = None\n"
        "import meshlm.cli, meshlm.train.trainer\n"
        "from meshlm import config\nfrom meshlm.data.builtin import byte_tokenizer\n"
        "from meshlm.data.load import load_data\n"
        f"cfg = config.load(None, [('dataset_name', {str(data)!r}), ('seq_length', '64')])\n"
        "print(len(load_data(cfg, byte_tokenizer(), 'bytes')[0]))"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "MESHLM_CACHE": str(tmp_path / "cache")},
    )
    assert p.returncode == 0 and int(p.stdout.split()[-1]) > 10, p.stderr[-2000:]


def test_documents_are_packed_whole_with_restarting_positions_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path))
    w = BlockWriter(tmp_path / "b", 4, pad_id=0, packing=True, overflow="split")
    w.add([1, 2], [False, True])
    w.add([3, 4, 5], [True, True, True])  # does not fit after [1, 2]: a new block
    w.add([6, 7, 8, 9, 10, 11], [True] * 6)  # longer than a block: split into [6..9] and [10, 11]
    # [6..9] fills a block (written at once); [10, 11] fills [1, 2]'s, the best fit (written); [3, 4, 5] at close
    assert w.close() == {"blocks": 3, "seq_length": 4, "documents": 3, "split": 1, "truncated": 0, "no_target": 0}
    b = Blocks(tmp_path / "b").batch([0, 1, 2])
    assert b.ids.tolist() == [[6, 7, 8, 9], [1, 2, 10, 11], [3, 4, 5, 0]]
    assert b.positions.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1], [0, 1, 2, 0]]
    assert b.labels.tolist() == [[IGNORE, 7, 8, 9], [IGNORE, 2, IGNORE, 11], [IGNORE, 4, 5, IGNORE]]
    assert b.pad_tokens == 1 and b.targets() == 7
    w = BlockWriter(tmp_path / "c", 4, pad_id=0, packing=True, overflow="split")
    w.add([1], [True])  # one token predicts nothing: dropped (a piece without a target)
    w.add([4, 5], [True, True])
    w.add([2, 3], [True, True])  # packed after [4, 5]: positions restart
    assert w.close()["no_target"] == 1
    assert Blocks(tmp_path / "c").batch([0]).positions.tolist() == [[0, 1, 0, 1]]
    tok = builtin.byte_tokenizer()
    cfg = config_mod.Config()
    cfg.builtin_samples, cfg.seq_length = 100, 32
    first = load_blocks(cfg, tok, "builtin-bytes")
    cached = [p for p in (tmp_path / "blocks").iterdir()]
    assert len(cached) == 1
    ids_file = cached[0] / "train" / "ids.bin"
    os.utime(ids_file, (1, 1))
    again = load_blocks(cfg, tok, "builtin-bytes")
    assert torch.equal(again.batch(range(len(again))).ids, first.batch(range(len(first))).ids)
    assert os.stat(ids_file).st_mtime == 1  # read, not rewritten


def test_config_toml_then_cli_overrides_and_round_trip(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('max_steps = 7\nstrategy = "ddp"\n[parallel]\ntp = 2\n[arch]\nlayers = 3\n')
    cfg = config_mod.load(str(f), [("max-steps", "9"), ("parallel.pp", "2")])
    assert (cfg.max_steps, cfg.strategy, cfg.parallel.tp, cfg.parallel.pp, cfg.arch.layers) == (9, "ddp", 2, 2, 3)
    (tmp_path / "resolved.toml").write_text(config_mod.to_toml(cfg))
    assert config_mod.load(str(tmp_path / "resolved.toml")) == cfg
    with pytest.raises(MeshlmError, match="needs an integer"):
        config_mod.load(None, [("max-steps", "1.5")])
    with pytest.raises(MeshlmError, match="unknown config key"):
        config_mod.load(None, [("parallel.ttp", "2")])


def _local_model_dir(path, vocab_extra: int = 0):
    """A Llama checkpoint and a word-level tokenizer built with `tokenizers`, saved like a hub repo."""
    corpus = [r["instruction"] + " " + r["input"] + " " + r["output"] for r in builtin.corpus(300, 0)]
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>", "<pad>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    tok.save_pretrained(path)
    cfg = LlamaConfig(
        vocab_size=len(tok) - vocab_extra,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return model, tok


def test_local_model_dir_from_config_pretrained_and_resized_embeddings(tmp_path):
    model_dir = tmp_path / "model"
    ref, tok = _local_model_dir(model_dir, vocab_extra=20)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in builtin.corpus(300, 5)))
    common = [
        "--model-name",
        model_dir,
        "--dataset-name",
        data,
        "--seq-length",
        "32",
        "--max-steps",
        "3",
        "--micro-batch-size",
        "4",
        "--log-every",
        "1",
        "--progress",
        "false",
        "--lr",
        "1e-3",
    ]
    # --pretrained: the first logged loss is the loaded model's loss on the first batch. from_config (the default):
    # same architecture, fresh weights. Both runs in one process (conftest.run_cases: one start-up for both).
    runs = {"pre": ["--pretrained", "true"], "scratch": []}
    cases = [
        {"id": run, "kind": "train", "args": [str(a) for a in [*common, *extra, "--output-dir", tmp_path / run]]}
        for run, extra in runs.items()
    ]
    run_cases(1, cases, tmp_path / "launch")
    cfg = config_mod.load(
        None,
        [("model-name", str(model_dir)), ("dataset-name", str(data)), ("seq-length", "32"), ("micro-batch-size", "4")],
    )
    t, tid = load_tokenizer(cfg)
    blocks = load_blocks(cfg, t, tid)
    first = next(iter(ResumableSampler(len(blocks), 1, 0, seed=cfg.seed, batch_size=4)))
    b = blocks.batch(first)
    saved_vocab = ref.config.vocab_size  # len(tok) - 20: the tokenizer has rows the checkpoint lacks
    ref.resize_token_embeddings(len(tok), pad_to_multiple_of=64)
    with torch.no_grad():
        logits = ref(input_ids=b.ids.long(), position_ids=b.positions.long(), use_cache=False).logits
        expected = (token_loss_sum(logits, b.labels.long()) / b.targets()).item()
    assert_close(losses(tmp_path / "pre")[:1], [expected], rtol=1e-5)
    # from_config: embeddings grown to the tokenizer
    assert abs(losses(tmp_path / "scratch")[0] - expected) > 1e-3
    # both runs grew the embedding and head to the tokenizer, rounded up to a multiple of 64 (as transformers'
    # resize_token_embeddings(pad_to_multiple_of=64)): read from what each run saved
    rows = math.ceil(len(tok) / 64) * 64
    assert saved_vocab < len(tok) <= rows
    for run in ("pre", "scratch"):
        saved = read_tensors(tmp_path / run / "checkpoints" / "step-3" / "state")
        shapes = {
            k: tuple(v.shape)
            for k, v in saved.items()
            if k in ("model.model.embed_tokens.weight", "model.lm_head.weight")
        }
        assert shapes == {"model.model.embed_tokens.weight": (rows, 64), "model.lm_head.weight": (rows, 64)}, shapes
    assert metrics(tmp_path / "scratch")[0]["step"] == 1


def test_two_ranks_tokenise_once(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    env = {"MESHLM_CACHE": str(cache)}
    args = ["train", *TINY, "--max-steps", "2", "--nproc", "2", "--micro-batch-size", "4", "--builtin-samples", "123"]
    p = run_meshlm(*args, "--output-dir", tmp_path / "a", env=env)
    assert "tokenising" in p.stdout
    assert len(list((cache / "blocks").iterdir())) == 1
    p = run_meshlm(*args, "--output-dir", tmp_path / "b", env=env)
    assert "tokenising" not in p.stdout


def test_env_reports_versions_and_backends():
    out = run_meshlm("env").stdout
    assert f"torch         {torch.__version__}" in out and "gloo" in out and "torchrun" in out
