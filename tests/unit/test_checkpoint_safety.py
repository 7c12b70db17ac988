"""Loading checkpoints for export and `generate --checkpoint`: the restricted unpickler, the `latest`
pointer, trust_remote_code from the command line only, no deletion of what export did not create, and
"corrupt" only for a checkpoint that really cannot be read. In-process, on a real DCP checkpoint of a
tiny model written here."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from meshlm.checkpoint.store import CheckpointDir, step_named_by_latest
from meshlm.config import ArchConfig, Config, to_toml
from meshlm.errors import MeshlmError
from meshlm.models import source
from meshlm.models.build import build_model, fingerprint, load_tokenizer
from meshlm.runtime import Runtime
from meshlm.train import export as export_mod


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run directory as training leaves it: config.toml, checkpoints/step-1 (DCP state, trainer.json,
    COMPLETE) and checkpoints/latest."""
    run = tmp_path_factory.mktemp("run")
    cfg = Config(arch=ArchConfig(hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate_size=64), seq_length=32)
    tokenizer, _ = load_tokenizer(cfg)
    model = build_model(cfg, tokenizer, "cpu")
    step = run / "checkpoints" / "step-1"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step / "state"), no_dist=True)
    meta = {"state": {"step": 1}, "scheduler": {}, "fingerprint": fingerprint(model)}
    (step / "trainer.json").write_text(json.dumps(meta))
    (step / "COMPLETE").write_text("")
    (run / "checkpoints" / "latest").write_text("step-1\n")
    (run / "config.toml").write_text(to_toml(cfg).replace("trust_remote_code = false", "trust_remote_code = true"))
    return run


def copy(run: Path, dst: Path) -> Path:
    shutil.copytree(run, dst)
    return dst


@pytest.mark.parametrize("name", ["../../elsewhere", "/etc", "step-1/../../x", "", "latest"])
def test_latest_must_name_a_step_inside_checkpoints(run, tmp_path, name):
    r = copy(run, tmp_path / "r")
    (r / "checkpoints" / "latest").write_text(name + "\n")
    for fn in (
        lambda: step_named_by_latest(r / "checkpoints"),
        lambda: CheckpointDir(r / "checkpoints", Runtime()).latest(),
        lambda: source.find_checkpoint(r),
    ):
        with pytest.raises(MeshlmError, match="not a step-N directory"):
            fn()


def test_config_toml_never_switches_on_remote_code(run):
    assert "trust_remote_code = true" in (run / "config.toml").read_text()
    assert source.run_config(run, trust_remote_code=False).trust_remote_code is False
    assert source.run_config(run, trust_remote_code=True).trust_remote_code is True
    from meshlm.infer.load import ModelChoice

    assert ModelChoice(checkpoint=str(run)).source().cfg.trust_remote_code is False


def test_export_leaves_directories_it_did_not_create(run, tmp_path):
    theirs = tmp_path / ".hf.tmp"  # the name export used to clear before writing
    theirs.mkdir()
    (theirs / "keep.txt").write_text("someone else's")
    out = export_mod.export(str(run), str(tmp_path / "hf"))
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert (theirs / "keep.txt").read_text() == "someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hf.tmp", "hf"]  # export's own temporary is gone


class Payload:
    def __reduce__(self):
        return (Path.touch, (Path("/tmp/meshlm-pwned-by-metadata"),))


def test_export_uses_the_restricted_unpickler(run, tmp_path):
    r = copy(run, tmp_path / "r")
    Path("/tmp/meshlm-pwned-by-metadata").unlink(missing_ok=True)
    meta = FileSystemReader(str(r / "checkpoints" / "step-1" / "state")).read_metadata()
    meta.storage_meta = Payload()
    (r / "checkpoints" / "step-1" / "state" / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(MeshlmError, match="is not allowed"):
        export_mod.export(str(r), str(tmp_path / "hf"))
    assert not Path("/tmp/meshlm-pwned-by-metadata").exists()


def test_truncated_shard_is_corrupt(run, tmp_path):
    r = copy(run, tmp_path / "r")
    shard = next((r / "checkpoints" / "step-1" / "state").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(MeshlmError, match=r"corrupt or missing shards.*is truncated"):
        export_mod.export(str(r), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


def test_other_errors_keep_their_traceback(run, tmp_path, monkeypatch):
    """An error that is not the checkpoint's (out of memory here) is not called corrupt: it propagates as is."""

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch.distributed.checkpoint.filesystem.FileSystemReader, "read_data", oom)
    with pytest.raises(BaseException) as info:
        export_mod.export(str(run), str(tmp_path / "hf"))
    assert not isinstance(info.value, MeshlmError)
    assert "out of memory" in str(info.value)


def test_every_reader_refuses_another_models_checkpoint_with_the_one_check(run, tmp_path, monkeypatch):
    """Export, generate's source and training's resume read a checkpoint whose config.toml describes another
    model (3 layers, not 1): each stops in source.check_fingerprint's one line, and nothing is written."""
    r = copy(run, tmp_path / "r")
    toml = r / "config.toml"
    toml.write_text(toml.read_text().replace("layers = 1", "layers = 3"))
    calls = []
    one_check = source.check_fingerprint
    monkeypatch.setattr(source, "check_fingerprint", lambda *a: calls.append(a[2]) or one_check(*a))
    monkeypatch.setattr("meshlm.checkpoint.store.check_fingerprint", source.check_fingerprint)
    theirs = source.ModelSource.of_checkpoint(str(r))
    readers = {
        "export": lambda: export_mod.export(str(r), str(tmp_path / "hf")),
        "generate": lambda: theirs.whole(),
        "resume": lambda: CheckpointDir(r / "checkpoints", Runtime()).check_model(
            r / "checkpoints" / "step-1", theirs.fingerprint(build_model(theirs.cfg, theirs.tokenizer, "meta"))
        ),
    }
    for name, read in readers.items():
        with pytest.raises(MeshlmError, match=r"checkpoint .*step-1 is from another model \(.*\); ") as e:
            read()
        assert "\n" not in str(e.value), name
    assert len(calls) == 3 and not (tmp_path / "hf").exists()
