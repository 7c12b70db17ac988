"""The rules behind a user's first week, in this process: one help style, what `env` and `plan` say, pieces
without a target dropped when packing, what a continued run keeps, metrics rows past a resume dropped, the run
directory's lock, and stopping on a signal. The real runs are tests/test_first_week.py, tests/test_errors.py
and tests/test_first_hour.py."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshlm import config
from meshlm.checkpoint import continuity, run_dir
from meshlm.cli import build_parser
from meshlm.data.batch import IGNORE
from meshlm.data.pack import Blocks, BlockWriter
from meshlm.errors import MeshlmError
from meshlm.options import HelpFormatter
from meshlm.runtime import Runtime
from meshlm.train.stopping import StopOnSignal


def test_every_subcommand_says_its_defaults_the_same_way():
    parser = build_parser()
    assert set(parser.commands) >= {"train", "generate", "export", "slurm", "plan", "verify", "report", "env"}
    for name, sub in parser.commands.items():
        formatter = HelpFormatter(prog=sub.prog)
        for action in sub._actions:
            text = formatter._expand_help(action) if action.help not in (None, argparse.SUPPRESS) else ""
            assert "(default" not in text, (name, action.option_strings, text)
            ending = re.search(r"\[([^\]]*)\]$", text)  # what ends a help: only ever its default
            assert not ending or ending.group(1).startswith("default: "), (name, action.option_strings, text)
            assert "[default: '" not in text and "[default: False]" not in text, (name, text)
        assert sub.description, f"meshlm {name} --help has no description"


def test_env_lists_the_optional_packages_meshlm_uses():
    from meshlm.env import report

    text = report()
    assert re.search(r"^peft\s", text, re.M) and re.search(r"^matplotlib\s", text, re.M), text


def test_plan_runs_the_pretrained_weights_of_an_ungated_copy_and_links_follow_the_gpu():
    from meshlm.plan.cli import inputs

    ns = build_parser().parse_args(["plan", "--model", "llama-7b", "--gpu", "L4"])
    spec, cluster, _, _ = inputs(ns)
    assert spec.run_as == ("--model-name", "NousResearch/Llama-2-7b-hf", "--pretrained")
    from meshlm.plan.cluster import LINKS

    assert cluster.intra == LINKS["pcie"]  # L4s have no NVLink
    spec, cluster, _, _ = inputs(build_parser().parse_args(["plan", "--model", "llama-7b"]))
    assert cluster.intra == LINKS["nvlink"]
    with pytest.raises(MeshlmError, match="is not a preset"):
        inputs(build_parser().parse_args(["plan", "--model", "llama-8b"]))


def test_pieces_without_a_target_are_dropped_and_counted(tmp_path):
    """A record longer than a block, split: a piece holding only prompt tokens teaches nothing."""
    writer = BlockWriter(tmp_path, seq_length=8, pad_id=0, packing=True, overflow="split")
    writer.add(list(range(1, 21)), [False] * 17 + [True] * 3)  # pieces 1-8, 9-16 all prompt; 17-20 learned
    writer.add([5, 6, 7], [False, True, True])
    meta = writer.close()
    assert meta["no_target"] == 2 and meta["split"] == 1
    blocks = Blocks(tmp_path)
    for i in range(len(blocks)):
        assert int(blocks.batch([i]).targets()) > 0
    assert (blocks.batch(list(range(len(blocks)))).labels != IGNORE).sum() == 3 + 2


def _cfg(**keys) -> config.Config:
    return config.load(None, [(k, str(v)) for k, v in keys.items()])


def test_the_global_batch_is_kept_on_another_rank_count_or_refused():
    cfg = _cfg(micro_batch_size=2)
    assert continuity.keep_global_batch(cfg, 2, None) is None and cfg.global_batch_size == 4
    cfg = _cfg(micro_batch_size=2)  # resumed on one rank from a 2-rank run of global batch 4
    note = continuity.keep_global_batch(cfg, 1, {"global_batch": 4})
    assert cfg.grad_accum == 2 and "accumulation 1 -> 2 keeps the global batch of 4" in note
    with pytest.raises(MeshlmError, match="global batch of 4 .* not a multiple of micro-batch 2 x 3"):
        continuity.keep_global_batch(_cfg(micro_batch_size=2), 3, {"global_batch": 4})
    cfg = _cfg(micro_batch_size=2, global_batch_size=8)  # said explicitly: the change is named
    note = continuity.keep_global_batch(cfg, 2, {"global_batch": 4})
    assert cfg.grad_accum == 2 and "global batch 4 -> 8 (--global-batch-size" in note


def test_a_longer_run_keeps_its_schedule_unless_told():
    def lr_at(span, step):
        return span * 1000 + step  # which schedule was asked, at which step

    cfg = _cfg(max_steps=400)
    note = continuity.keep_schedule(cfg, {"lr_schedule_steps": 200, "state": {"step": 200}}, lr_at)
    assert cfg.lr_schedule_steps == 200 and "--lr-schedule-steps 400 stretches" in note
    cfg = _cfg(max_steps=400, lr_schedule_steps=400)
    note = continuity.keep_schedule(cfg, {"lr_schedule_steps": 200, "state": {"step": 200}}, lr_at)
    assert cfg.lr_schedule_steps == 400 and "instead of 200" in note
    cfg = _cfg(max_steps=50)
    assert continuity.keep_schedule(cfg, None, lr_at) is None and cfg.lr_schedule_steps == 50


def test_metrics_rows_past_the_resumed_step_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {s}, "loss": 1.0}}\n' for s in (1, 2, 3, 4, 5)) + '{"step": 6, "lo')
    assert run_dir.truncate_metrics(path, 3) == 3
    assert path.read_text() == "".join(f'{{"step": {s}, "loss": 1.0}}\n' for s in (1, 2, 3))
    assert run_dir.truncate_metrics(path, 3) == 0


def test_overwrite_deletes_the_run_and_nothing_else(tmp_path):
    out = tmp_path / "run"
    for name in ("metrics.jsonl", "config.toml", "checkpoints/step-2/COMPLETE", "logs/rank-0.log", "notes.txt"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("x")
    with pytest.raises(MeshlmError, match="--resume false: .* already holds a run"):
        run_dir.check(_cfg(output_dir=out, resume="false"))
    cfg = _cfg(output_dir=out, resume="false", overwrite="true")
    run_dir.check(cfg)
    assert not cfg.resuming and run_dir.prepare(cfg, 0) == 0
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def _holder(out: Path) -> subprocess.Popen:
    code = (
        "import sys, time; from pathlib import Path; from meshlm.checkpoint.run_dir import RunLock; "
        "RunLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(600)"
    )
    p = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_live_holder_is_named_and_a_dead_ones_lock_is_taken_over(tmp_path):
    out = tmp_path / "a" / "run"
    holder = _holder(out)
    try:
        with pytest.raises(MeshlmError, match=f"in use by another job \\(host {socket.gethostname()} pid {holder.pid}"):
            run_dir.RunLock(out).acquire()
        with pytest.raises(MeshlmError, match="in use"):
            run_dir.RunLock(out).refuse_if_held()
    finally:
        holder.kill()
        holder.wait()
    assert (out / ".lock").is_file()  # left by the killed holder
    run_dir.RunLock(out).refuse_if_held()
    lock = run_dir.RunLock(out).acquire()
    assert f"pid {os.getpid()}" in (out / ".lock").read_text()
    lock.release()
    assert not (out / ".lock").exists() and out.is_dir()  # the directory was not created by this lock
    fresh = tmp_path / "b" / "c"
    run_dir.RunLock(fresh).acquire().release()
    assert not (tmp_path / "b").exists()  # what acquiring created, releasing removed


def test_the_first_signal_stops_after_the_step_and_a_later_second_at_once():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with StopOnSignal(Runtime()) as stop:
        assert stop.agreed() == 0
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed() == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGINT)  # the same request passed on by the launcher: ignored
        time.sleep(1.2)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def _failure(tmp: Path, rank: int, exitcode: int, error: BaseException | None):
    """A failed rank as torchelastic reports it, its error file written by the same code a rank uses (@record)."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, ProcessFailure

    path = tmp / f"rank-{rank}.error.json"
    if error is not None:
        os.environ["TORCHELASTIC_ERROR_FILE"] = str(path)
        try:
            raise error
        except type(error) as e:
            ErrorHandler().record_exception(e)
        finally:
            del os.environ["TORCHELASTIC_ERROR_FILE"]
    (tmp / f"rank-{rank}.stderr").write_text("")
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_a_meshlm_error_on_any_rank_is_its_line_and_status_2_whatever_the_others_did(tmp_path, capsys):
    """A failure seen in the field: rank 0 raised a MeshlmError (a bad record) and was SIGTERMed by the launcher after
    rank 1, which had lost it, exited 1 first. The launcher shows rank 0's line, exits 2, and moves nothing into
    the existing run directory."""
    from meshlm import launch_failures

    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "rank-0.log").write_text("an earlier run\n")
    tmp = tmp_path / "meshlm-launch-x"
    tmp.mkdir()
    failures = {
        0: _failure(tmp, 0, -signal.SIGTERM, MeshlmError("d.jsonl:2 is not valid JSON")),
        1: _failure(tmp, 1, 1, RuntimeError("rank 0 failed during tokenising (its error is the cause)")),
    }
    status, keep = launch_failures.failed(failures, tmp, out, launch_failures.rank_log_sizes(out))
    assert (status, keep) == (2, False)
    assert capsys.readouterr().err == "meshlm: error: d.jsonl:2 is not valid JSON\n"
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["rank-0.log"]


def test_a_killed_rank_outranks_the_peer_that_lost_it(tmp_path, capsys):
    """kill -9 of rank 1 while rank 0 waited for it in a collective: rank 0's "connection closed by peer" reached
    its error file before the launcher saw rank 1 gone. The killed rank is named, with its exit code."""
    from meshlm import launch_failures

    tmp = tmp_path / "meshlm-launch-x"
    tmp.mkdir()
    closed = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234 (a remote worker crashing?)")
    failures = {0: _failure(tmp, 0, 1, closed), 1: _failure(tmp, 1, -signal.SIGKILL, None)}
    assert launch_failures.failed(failures, tmp, None, {}) == (1, True)
    assert capsys.readouterr().err.startswith("meshlm: rank 1 failed (exit code -9): killed by SIGKILL\n")


def _only_the_peer_reported(tmp: Path, error: BaseException) -> dict:
    """Rank 1 raised `error`, rank 0 lost the connection to it at once: both were dead by torchelastic's poll,
    which reported the first it found, rank 0. Rank 1's error file is in `tmp` all the same."""
    closed = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    failures = {0: _failure(tmp, 0, 1, closed)}
    _failure(tmp, 1, 1, error)
    return failures


def test_the_rank_that_raised_is_named_when_only_its_peer_was_reported(tmp_path, capsys):
    from meshlm import launch_failures

    tmp = tmp_path / "meshlm-launch-x"
    tmp.mkdir()
    failures = _only_the_peer_reported(tmp, RuntimeError("injected fault at step 2 on rank 1"))
    assert launch_failures.failed(failures, tmp, None, {}) == (1, True)
    err = capsys.readouterr().err
    assert err.startswith("meshlm: rank 1 failed (exit code 1): RuntimeError: injected fault at step 2 on rank 1\n")
    assert "rank 0" not in err


def test_bad_input_on_a_rank_torchelastic_did_not_report_is_its_line(tmp_path, capsys):
    from meshlm import launch_failures

    tmp = tmp_path / "meshlm-launch-x"
    tmp.mkdir()
    failures = _only_the_peer_reported(tmp, MeshlmError("d.jsonl:2 is not valid JSON"))
    assert launch_failures.failed(failures, tmp, None, {}) == (2, False)
    assert capsys.readouterr().err == "meshlm: error: d.jsonl:2 is not valid JSON\n"


def test_a_rank_that_stopped_answering_is_named_with_its_last_step(tmp_path, capsys):
    """Rank 1 frozen (SIGSTOP): rank 0 timed out; rank 1 left no stack dump and was not yet reaped when the
    launcher collected rank 0. Its heartbeat names the step it was in."""
    from meshlm import heartbeat, launch_failures

    out = tmp_path / "run"
    logs = out / "logs"
    logs.mkdir(parents=True)
    tmp = tmp_path / "meshlm-launch-x"
    tmp.mkdir()
    timeout = RuntimeError("[unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete")
    failures = {0: _failure(tmp, 0, 1, timeout)}
    beats = [heartbeat.Heartbeat(logs, rank) for rank in (0, 1)]
    for rank, beat in enumerate(beats):
        (logs / f"rank-{rank}.log").write_text("... INFO global batch 8\n")
        beat.beat(12 + rank)
    beats[1].beat(8)  # an overwrite with a shorter number leaves no tail
    for beat in beats:
        beat.close()
    assert launch_failures.failed(failures, tmp, out, {}) == (1, False)
    err = capsys.readouterr().err
    assert "meshlm: rank 0 failed (exit code 1): RuntimeError: [unbound_buffer.cc:78] Timed out" in err
    assert "meshlm: rank 1 stopped answering at step 8: it left no stack dump on SIGTERM" in err, err
