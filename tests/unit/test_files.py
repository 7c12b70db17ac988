"""The guarded reader: each kind of damage to a data, config, model or tokenizer file is one MeshlmError naming
the file (and its line where known), never the parser's own exception."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from meshlm import files
from meshlm.errors import MeshlmError


def _safetensors_cut_in_half(path):
    save_file({"w": torch.zeros(64, 64)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# (file name, content, reader, what the one line must say)
DAMAGE = {
    "text-not-utf8": ("d.txt", b"ok\n\xff\xfe\n", files.read_text, "d.txt:2 is not UTF-8 text (byte 0xff)"),
    "json-cut-short": ("c.json", b'{"a": [1, 2', files.read_json, "c.json is not valid JSON"),
    "json-too-deep": ("c.json", b"[" * 100_000, lambda p: files.read_json(p, None), "nested too deeply"),
    "json-wrong-top": ("c.json", b"[1, 2]", files.read_json, "c.json holds a JSON array, not a JSON object"),
    "json-missing-key": ("t.json", b"{}", lambda p: files.read_json(p, need=("state",)), "t.json lacks 'state'"),
    "jsonl-not-utf8": ("d.jsonl", b'{"text": "a"}\n{"text": "\xc3"}\n', lambda p: list(files.jsonl(p)), "d.jsonl:2"),
    "jsonl-too-deep": ("d.jsonl", b'{"text": "a"}\n' + b"[" * 100_000, lambda p: list(files.jsonl(p)), ":2 is JSON"),
    "jsonl-wrong-top": ("d.jsonl", b'"a"\n', lambda p: list(files.jsonl(p, dict)), "d.jsonl:1 holds a JSON string"),
    "toml-not-utf8": ("c.toml", b"max_steps = 5\nexperiment_name = '\xff'\n", files.read_toml, "c.toml:2 is not UTF-8"),
    "toml-too-deep": ("c.toml", b"a = " + b"[" * 100_000, files.read_toml, "c.toml is TOML nested too deeply"),
    "missing": (None, None, files.read_text, "could not read"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damage_is_one_line_naming_the_file(case, tmp_path):
    name, content, read, expect = DAMAGE[case]
    path = tmp_path / (name or "absent.txt")
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(MeshlmError) as e:
        read(path)
    assert expect in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert str(tmp_path) in str(e.value)


def test_safetensors_cut_in_half(tmp_path):
    path = tmp_path / "model.safetensors"
    _safetensors_cut_in_half(path)
    with pytest.raises(MeshlmError, match=r"model.safetensors is not a readable safetensors file \(.*\); copy"):
        with files.safetensors(path):
            pass


def test_sound_files_read_back(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "é"}\n\n[1]\n', encoding="utf-8")
    assert list(files.jsonl(tmp_path / "d.jsonl")) == [(1, {"text": "é"}), (3, [1])]
    (tmp_path / "c.toml").write_text("[parallel]\ntp = 2\n")
    assert files.read_toml(tmp_path / "c.toml") == {"parallel": {"tp": 2}}
    save_file({"w": torch.ones(2, 2)}, str(tmp_path / "m.safetensors"))
    with files.safetensors(tmp_path / "m.safetensors") as f:
        assert torch.equal(f.get_tensor("w"), torch.ones(2, 2))


def test_can_write_dir_tries_and_leaves_nothing(tmp_path):
    (tmp_path / "f").write_text("x")
    assert files.can_write_dir(tmp_path / "new" / "run")
    assert not files.can_write_dir(tmp_path / "f" / "run")  # under a file
    assert not files.can_write_dir(tmp_path / "f")  # a file
    assert not files.can_write_dir(Path("/proc/meshlm-out"))  # root may pass permission bits; /proc takes nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # the probe directory is gone, nothing was made
