"""The family registry (models/families) owns every fact about a model family: parallel/ names none, each family's
facts sit in one entry, and whether the LM head is tied is answered by one function."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest
import transformers as tf
from torch import nn

from meshlm.models import families
from meshlm.models.families.entries import ENTRIES
from meshlm.models.families.registry import ENTRY_ONLY

SRC = Path(__file__).resolve().parents[2] / "src" / "meshlm"
# Stems of model types that are ordinary words in code and prose ("data" of data2vec-text, "seed" of seed_oss,
# "got" of got_ocr2, "flex" of flex_olmo, "big" of big_bird); the model types themselves are still looked for.
ORDINARY_WORDS = {"data", "seed", "got", "flex", "big"}


def _family_names() -> set[str]:
    """Every causal-LM model type transformers knows and every family meshlm has an entry for, as written in code
    (gpt_oss, gpt-oss) and its name's stem as written in prose (DeepSeek-V4 -> deepseek, Llama 4 -> llama)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kinds = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(ENTRIES)
    names = set()
    for kind in kinds:
        stem = re.match(r"[a-z]+", kind).group(0)
        names |= {kind, kind.replace("_", "-"), kind.replace("-", "_")}
        names |= {stem} if stem not in ORDINARY_WORDS and len(stem) > 1 else set()
    return names


def family_mentions(root: Path) -> list[str]:
    """Each place under `root` that names a model family, code and comments alike: 'file:line: name'."""
    names = sorted(_family_names(), key=len, reverse=True)
    pattern = re.compile(r"(?<![a-z0-9_])(" + "|".join(map(re.escape, names)) + r")(?![a-z])", re.IGNORECASE)
    found = []
    for f in sorted(root.rglob("*.py")):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            found += [f"{f.relative_to(SRC)}:{i}: {m.group(0)}" for m in pattern.finditer(line)]
    return found


def test_parallel_names_no_family():
    """parallel/ applies the styles and hooks a family's entry names, and engines/ steps what it built; which family
    uses which is the registry's."""
    assert family_mentions(SRC / "parallel") + family_mentions(SRC / "engines") == []


def test_the_scan_sees_a_family(tmp_path, monkeypatch):
    """The scan finds a family written as a model type, as a name in prose, and inside a comment."""
    monkeypatch.setattr(f"{__name__}.SRC", tmp_path)
    (tmp_path / "m.py").write_text("x = 1  # Doge's residual scales\nKIND = 'longcat_flash'\n# for DeepSeek-V4\n")
    assert [m.rsplit(" ", 1)[1] for m in family_mentions(tmp_path)] == ["Doge", "longcat_flash", "DeepSeek-V4"]


def test_entries_name_only_family_fields():
    """Each family's facts are one entry of fields the registry knows (its one override mechanism)."""
    known = {f.name for f in fields(families.Family)} | set(ENTRY_ONLY)
    assert {k: set(e) - known for k, e in ENTRIES.items() if set(e) - known} == {}


def test_plan_entries_go_over_transformers_plan():
    """`plan_entries` keeps transformers' other entries; `tp_plan` replaces the plan."""
    deepseek = families.family(tf.DeepseekV3Config())
    assert deepseek.tp_plan["layers.*.self_attn.kv_a_proj_with_mqa"] == "mla_kv_a_proj"  # the entry's
    assert deepseek.tp_plan["layers.*.mlp.down_proj"] == "rowwise"  # transformers' own
    assert families.family(tf.Olmo2Config()).tp_plan == {
        **{f"layers.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")},
        **{f"layers.*.self_attn.{n}": "sharded_norm" for n in ("q_norm", "k_norm")},
        "layers.*.self_attn.o_proj": "rowwise",
        **{
            f"layers.*.mlp.{p}": s
            for p, s in (("gate_proj", "colwise"), ("up_proj", "colwise"), ("down_proj", "rowwise"))
        },
    }


def _tiny(config_class, tie: bool) -> nn.Module:
    config = config_class(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=tie,
    )  # fmt: skip
    return tf.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("tie", [True, False])
def test_tied_head(tie):
    """The one answer to 'is the LM head the token embedding's weight': a model's, a broken tie's, a module's
    without an embedding or head (a pipeline stage's part)."""
    model = _tiny(tf.LlamaConfig, tie)
    assert families.tied(model) is tie
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    assert families.tied(model) is False
    assert families.tied(nn.Linear(2, 2)) is False


def test_tied_head_decided_once():
    """No module but the registry's compares a head's weight with an embedding's: every layout and checkpoint
    writer asks families.tied."""
    pattern = re.compile(r"\bweight is \w*\.?(get_input_embeddings\(\)\.)?\w*embed|\bis not embed\b")
    found = [
        f"{f.relative_to(SRC)}:{i}"
        for f in sorted(SRC.rglob("*.py"))
        if f != SRC / "models" / "families" / "parts.py"
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []
