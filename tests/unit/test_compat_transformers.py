"""meshlm/compat_transformers.py against the installed transformers: every name it looks up is transformers' own
(or meshlm's equivalent where this release lacks it, computing the same), the facts it reads from a decoder's
source hold family by family, and no other module of meshlm reaches into a transformers submodule."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import transformers

from meshlm import compat_transformers as ct
from meshlm.compat import lookup
from meshlm.errors import MeshlmError

ROOT = Path(__file__).resolve().parents[2] / "src"
SEAM = ROOT / "meshlm" / "compat_transformers.py"
SOURCES = sorted((ROOT / "meshlm").rglob("*.py"))


@pytest.mark.parametrize("name", ct.NAMES)
def test_each_name_is_transformers_own_or_its_fallback(name):
    module, attr, needed = ct.NAMES[name]
    found = lookup(module, attr)
    got = ct.transformers_name(name)
    if isinstance(needed, str):  # no fallback: every supported release has it
        assert found is not None, f"transformers {transformers.__version__} has no {module}.{attr}"
        assert got is found
    else:
        assert got is (found if found is not None else needed)


def _dense(fn, n: int) -> torch.Tensor:
    i = torch.arange(n)
    return torch.stack([torch.stack([fn(0, 0, q, k) for k in i]) for q in i])


def test_packed_sequence_mask_keeps_documents_apart_at_their_own_positions():
    """Two documents of 3 and 3 tokens under a window of 2: each attends causally within itself only, the window
    counted in its own positions; the same as transformers' own function where the release has it."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    packed = ct.find_packed_sequence_indices(positions)
    window = ct.sliding_window_causal_mask_function(2)
    mine = _dense(ct._packed_sequence_compatibility(window, positions, packed), 6)
    block = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    want = torch.block_diag(block, block)
    assert torch.equal(mine, want)
    theirs = lookup("transformers.masking_utils", "packed_sequence_compatibility_function")
    if theirs is not None:
        assert torch.equal(_dense(theirs(window, positions, packed), 6), want)


def test_apply_converters_renames_by_the_first_matching_converter():
    """Mixtral's experts are saved as one tensor per expert: the save direction's converters group them; a norm
    matches none. Where transformers has apply_converters, the same answers."""
    from meshlm.models.conversions import _reverse_converters

    config = transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=2, vocab_size=64,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    converters = _reverse_converters(model)
    names = [n for n in model.state_dict() if "experts" in n or "norm" in n]
    mine = {n: ct._apply_converters(n, converters) for n in names}
    assert any(pattern is not None for _, pattern in mine.values())
    assert mine["model.norm.weight"] == ("model.norm.weight", None)
    theirs = lookup("transformers.core_model_loading", "apply_converters")
    if theirs is not None:
        assert mine == {n: theirs(n, converters) for n in names}


def test_a_name_this_release_lacks_is_its_fallback_or_one_line(monkeypatch):
    monkeypatch.setitem(ct.NAMES, "gone", ("transformers.no_such_module", "gone", "a feature"))
    monkeypatch.setitem(ct.NAMES, "kept", ("transformers.masking_utils", "no_such_name", len))
    with pytest.raises(MeshlmError, match=r"^a feature needs transformers' transformers.no_such_module.gone, whi"):
        ct.transformers_name("gone")(1)
    with pytest.raises(MeshlmError, match=r"install a release from transformers 5\.17\.0 to "):
        getattr(ct.transformers_name("gone"), "anything")  # noqa: B009
    assert ct.transformers_name("kept") is len


def test_grouped_mm_is_replaced_and_put_back():
    from transformers.integrations import moe

    real = moe._grouped_mm
    with ct.grouped_mm_replaced(len):
        assert moe._grouped_mm is len
    assert moe._grouped_mm is real


# Per family, what its decoder's forward does (read from its source): whether its masks see the position ids
# (packed documents kept apart), and whether it picks its one mask by the config's sliding window.
SOURCE_FACTS = {
    "LlamaModel": (True, False),
    "Qwen2Model": (True, False),
    "Gemma3TextModel": (True, False),
    "MistralModel": (True, True),
    "MixtralModel": (True, True),
    "Qwen3MoeModel": (True, True),
    "Phi3Model": (True, True),
    "Starcoder2Model": (True, True),
    "MiniMaxModel": (True, True),
    "GptOssModel": (False, False),
    "AfmoeModel": (False, False),
    "GraniteMoeHybridModel": (False, False),
}


@pytest.mark.parametrize("decoder", SOURCE_FACTS)
def test_source_facts_per_family(decoder):
    cls = getattr(transformers, decoder)
    assert (ct.masks_see_positions(cls), ct.window_by_config(cls)) == SOURCE_FACTS[decoder]


def test_embedding_norms_are_the_decoders_own():
    """The modules a stage runs after Inkling's token embedding exist on this release's decoder, and no other
    module holds a norm there (5.17: a separate embed_norm; 5.23: none, the embedding norms itself)."""
    config = transformers.InklingTextConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                            num_key_value_heads=2, n_routed_experts=4, vocab_size=128)  # fmt: skip
    decoder = transformers.InklingTextModel(config)
    norms = [n for n, m in decoder.named_children() if "norm" in n and n != "norm"]
    assert list(ct.embedding_norms("inkling_text")) == norms
    assert ct.embedding_norms("llama") == ()


def test_indexed_attention_is_this_releases_layer_type():
    """DeepSeek-V3.2's layers are of a type INDEXED_ATTENTION names (5.17: deepseek_sparse_attention)."""
    assert set(transformers.DeepseekV32Config(num_hidden_layers=2).layer_types) <= set(ct.INDEXED_ATTENTION)


# ---------------------------------------------------------------- no transformers submodule outside the seam


def transformers_reaches(path: Path) -> list[str]:
    """Imports of a transformers submodule (or of a private top-level name), and attributes reached below the
    top level of a name bound to transformers itself."""
    tree, found, aliases = ast.parse(path.read_text()), [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "transformers":
                    aliases.add(a.asname or a.name)
                elif a.name.startswith("transformers."):
                    found.append(f"import {a.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            top = node.module == "transformers"
            if node.module.startswith("transformers.") or (top and any(a.name.startswith("_") for a in node.names)):
                found.append(f"from {node.module} import {', '.join(a.name for a in node.names)}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            base = node.value.value
            if isinstance(base, ast.Name) and base.id in aliases:
                found.append(ast.unparse(node))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            found += [ast.unparse(node)] * node.attr.startswith("_")
    return found


def test_the_checker_sees_transformers_submodules(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import transformers\nimport transformers.masking_utils\nfrom transformers.core_model_loading import x\n"
        "from transformers import _private, AutoConfig\ntransformers.utils.logging\ntransformers._secret\n"
        "transformers.AutoConfig\n"
    )
    assert len(transformers_reaches(bad)) == 5


def test_no_transformers_submodule_outside_the_seam():
    found = {f.relative_to(ROOT).as_posix(): transformers_reaches(f) for f in SOURCES if f != SEAM}
    assert not {f: uses for f, uses in found.items() if uses}
