"""benchmarks/peer_torchtitan.py on CPU, without torchtitan: one job description gives meshlm and torchtitan the
same model and run (meshlm's own parser and model builder read its half), and torchtitan's log lines, written
here with torchtitan's own format strings (0.2.2's, as 0.3.0's), parse to the numbers they carry."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from helpers.bench import script
from meshlm.models.build import build_model, load_tokenizer
from meshlm.options import parse_train

peer = script("peer_torchtitan")
torchtitan_job = script("torchtitan_job")


@pytest.mark.parametrize("job", [peer.GPU_JOB, peer.TINY_JOB], ids=["gpu", "tiny"])
def test_one_job_gives_both_tools_the_same_model_and_run(job, tmp_path):
    meshlm_args, titan = peer.options(job, tmp_path, tmp_path / "out")
    _, cfg = parse_train(meshlm_args)
    # the shapes on the meta device; sdpa because this CPU refuses flex (the job's kernel is compared below)
    model = build_model(dataclasses.replace(cfg, attention="sdpa"), load_tokenizer(cfg)[0], "meta")
    mc = model.config
    # what torchtitan_job.py checks its flavor against and sets on it (it fails the run if the flavor differs)
    assert titan["body"] == {
        "dim": mc.hidden_size,
        "n_layers": mc.num_hidden_layers,
        "n_heads": mc.num_attention_heads,
        "n_kv_heads": mc.num_key_value_heads,
        "hidden_dim": mc.intermediate_size,
    }
    assert (titan["vocab_size"], titan["tied"]) == (mc.vocab_size, mc.tie_word_embeddings)
    # the count compare() holds torchtitan's logged size to
    assert sum(p.numel() for p in model.parameters()) == job.params()
    assert titan["seq_len"] == cfg.seq_length and titan["local_batch_size"] == job.micro_batch
    assert titan["mixed_precision_param"] == {"bf16": "bfloat16", "no": "float32"}[cfg.mixed_precision]
    assert (titan["compile"], titan["ac"], titan["attn_backend"]) == (
        cfg.compile,
        cfg.activation_checkpointing,
        cfg.attention,
    )
    assert (titan["steps"], titan["log_freq"], titan["warmup_steps"], titan["lr"]) == (
        job.steps,
        job.warmup,
        cfg.warmup_steps,
        cfg.lr,
    )
    assert Path(cfg.dataset_name).parent == Path(titan["dataset_dir"])


def test_gpu_job_is_section_4s_job():
    """The ~1B job of benchmarks/gpu_mfu.py (its MODEL) at sequence 2048, micro-batch 8, bf16, compiled."""
    gpu_mfu = script("gpu_mfu")

    arch = dict(zip(gpu_mfu.MODEL[::2], gpu_mfu.MODEL[1::2]))
    job = peer.GPU_JOB
    assert (job.hidden, job.layers, job.heads, job.kv_heads, job.mlp) == tuple(
        int(arch[f"--arch.{k}"]) for k in ("hidden-size", "layers", "heads", "kv-heads", "intermediate-size")
    )
    assert (job.seq_length, job.micro_batch, job.bf16, job.compile) == (2048, 8, True, True)


class Color:  # torchtitan/tools/utils.py Color
    red, green, blue, cyan, magenta, reset = (f"\033[{n}m" for n in (31, 32, 34, 36, 35, 39))
    orange, turquoise = "\033[38;2;180;60;0m", "\033[38;2;54;234;195m"


def step_line(color, step, loss, gib, pct, tps, tflops, mfu) -> str:
    """torchtitan/components/metrics.py MetricsProcessor.log's line, its f-string as written there."""
    mfu_str = f"{mfu:.2f}%" if mfu is not None else "N/A"
    return "[titan] 2026-11-24 21:50:29,100 - root - INFO - " + (
        f"{color.red}step: {step:2}  "
        f"{color.green}loss: {loss:8.5f}  "
        f"{color.orange}grad_norm: {1.25:7.4f}  "
        f"{color.turquoise}memory: {gib:5.2f}GiB"
        f"({pct:.2f}%)  "
        f"{color.blue}tps: {round(tps):,}  "
        f"{color.cyan}tflops: {tflops:,.2f}  "
        f"{color.magenta}mfu: {mfu_str}{color.reset}"
    )


@pytest.mark.parametrize("color", [Color, type("NoColor", (), dict.fromkeys(vars(Color), ""))])
def test_torchtitan_log_lines_parse(color):
    size = "[titan] ... - root - INFO - Model llama3 1B size: 974,456,832 total parameters"  # trainer.py
    lines = [size, step_line(color, 1, 5.9, 20.5, 25.9, 1_000, 6.6, 0.67)]  # step 1: compile, left out
    lines += [step_line(color, 5, 4.0, 36.25, 45.8, 60_000, 398.9, 40.3)]  # the warm-up interval, left out
    lines += [step_line(color, s, 3.0, 35.0, 44.2, tps, 0.0, tps / 1000) for s, tps in ((10, 60_000), (15, 40_000))]
    got = peer.parse_torchtitan("\n".join(lines) + "\n", warmup=5)
    assert got["tokens_per_s"] == pytest.approx(48_000)  # 2 intervals of equal tokens: the harmonic mean
    assert got["mfu_dense"] == pytest.approx(0.48)
    assert got["reserved_bytes"] == 36.25 * 2**30 and got["params"] == 974_456_832 and got["loss"] == 3.0


def test_torchtitan_log_without_mfu_or_steps():
    lines = ["x size: 10 total parameters", step_line(Color, 4, 3.0, 1.0, 1.0, 500, 0.0, None)]
    assert math.isnan(peer.parse_torchtitan("\n".join(lines), warmup=2)["mfu_dense"])  # N/A under float8/MX
    with pytest.raises(ValueError, match="step lines"):
        peer.parse_torchtitan(lines[0], warmup=2)


def test_first_error_of_a_failed_torchtitan_run():
    """The line compare() reports, from this CPU's real failure (torchrun repeats it in its summary)."""
    log = (
        '  File ".../torch/cuda/__init__.py", line 689, in set_device\n    torch._C._cuda_setDevice(device)\n'
        "AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'\n"
        "E1124 21:50:31.585000 10324 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1)\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    )
    assert (
        peer.ERROR_LINE.search(log).group(0) == "AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'"
    )


def test_gpu_check_runs_the_peer_on_one_gpu():
    """In the first-lease set, on one GPU, with the torchtitan release torchtitan_job.py is written for."""
    gpu_check_rows = script("gpu_check_rows")
    WHEELS = script("gpu_check_jobs").WHEELS

    (row,) = [r for r in gpu_check_rows.rows() if r.check is gpu_check_rows.torchtitan_peer]
    assert (row.lease, row.gpus, row.wheels) == ("first", 1, "torchtitan")
    assert "torchtitan==0.2.2" in WHEELS["torchtitan"] and "0.2.2" in torchtitan_job.__doc__


@pytest.mark.parametrize("job", [peer.GPU_JOB, peer.TINY_JOB], ids=["gpu", "tiny"])
def test_torchtitan_command_line_carries_every_setting(job, tmp_path):
    """torchtitan 0.2.2's options, as torchtitan_job.command_line writes them, hold each of the job's settings."""
    _, titan = peer.options(job, tmp_path, tmp_path / "out")
    argv = torchtitan_job.command_line(titan)
    flags = {
        a for i, a in enumerate(argv) if a.startswith("--") and (i + 1 == len(argv) or argv[i + 1].startswith("--"))
    }
    value = {a: argv[i + 1] for i, a in enumerate(argv) if a.startswith("--") and a not in flags}
    assert (value["--model.name"], value["--model.flavor"]) == (torchtitan_job.SPEC, torchtitan_job.FLAVOR)
    assert value["--experimental.custom_import"] == "torchtitan_job"
    assert int(value["--training.local_batch_size"]) == job.micro_batch
    assert int(value["--training.seq_len"]) == job.seq_length and int(value["--training.steps"]) == job.steps
    assert value["--training.mixed_precision_param"] == ("bfloat16" if job.bf16 else "float32")
    assert int(value["--metrics.log_freq"]) == job.warmup == int(value["--lr_scheduler.warmup_steps"])
    assert value["--activation_checkpoint.mode"] == job.ac and float(value["--optimizer.lr"]) == titan["lr"]
    assert (
        value["--training.dataset_path"] == str(tmp_path) and value["--model.hf_assets_path"] == titan["tokenizer_dir"]
    )
    assert ("--compile.enable" in flags) == job.compile and "--metrics.disable_color_printing" in flags
