"""The rows `make gpu-check` runs (gpu_check.py drives them), in order, each with its estimated seconds. Each check
takes a fresh directory and returns (one-line detail, numbers) or raises CheckFailed/AssertionError; none fails
because another did (the float8 and torchtitan rows read an earlier row's numbers where it ran)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpu_check_jobs import (
    ENV,
    HERE,
    MODEL,
    ROOT,
    RTOL,
    STEPS,
    CheckFailed,
    estimate,
    losses,
    meshlm,
    train,
    worst,
)

GIB = 2**30
# name -> (ranks, arguments), global batch 8 in every one (micro-batch x accumulation x data-parallel ranks)
LAYOUTS = {
    "ddp": (2, ["--strategy", "ddp", "--micro-batch-size", "4"]),
    "zero1": (2, ["--strategy", "zero1", "--micro-batch-size", "4"]),
    "zero2": (2, ["--strategy", "zero2", "--micro-batch-size", "4"]),
    "zero3": (2, ["--strategy", "zero3", "--micro-batch-size", "2", "--grad-accum", "2"]),
    "zero3 --cpu-offload": (2, ["--strategy", "zero3", "--micro-batch-size", "4", "--cpu-offload"]),
    "tp": (2, ["--parallel.tp", "2", "--micro-batch-size", "8"]),
    "pp": (2, ["--parallel.pp", "2", "--micro-batch-size", "8"]),
    "hsdp 2x2": (4, ["--strategy", "hsdp", "--parallel.shard-size", "2", "--micro-batch-size", "2"]),
    "fsdp+tp 2x2": (4, ["--strategy", "fsdp", "--parallel.tp", "2", "--micro-batch-size", "4"]),
}
_reference: dict = {}
earlier: dict[str, dict] = {}  # the results of the rows run before this one, by name (the driver fills it)


def reference(tmp: Path) -> list[dict]:
    """The one-GPU fp32 run every parity check compares with (run once)."""
    if "rows" not in _reference:
        _reference["rows"] = train(tmp.parent / "reference", *STEPS, "--strategy", "single", "--micro-batch-size", "8")
    return _reference["rows"]


def _speed(rows: list[dict]) -> dict:
    last = rows[-1]
    return {"tokens_per_s": last["tokens_per_s"], "mfu": last["mfu"], "mem_peak_gib": last["mem_peak_bytes"] / GIB}


def default_fp32(tmp):
    rows = train(tmp, "--max-steps", "30")
    assert rows[-1]["loss"] < rows[0]["loss"], "loss did not fall"
    return f"loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}, MFU {100 * rows[-1]['mfu']:.1f}%", _speed(rows)


def default_bf16(tmp):
    rows = train(tmp, "--max-steps", "30", "--mixed-precision", "bf16")
    ref = train(tmp.parent / "bf16-ref-fp32", "--max-steps", "30")
    diff = worst(losses(rows), losses(ref))
    assert diff < 0.02, f"bf16 losses {diff:.3g} from fp32 (> 2%)"
    return f"within {diff:.2g} of fp32, MFU {100 * rows[-1]['mfu']:.1f}% (of the bf16 peak)", _speed(rows)


def compiled(tmp):
    ref = reference(tmp)
    rows = train(tmp, *STEPS, "--strategy", "single", "--micro-batch-size", "8", "--compile", "true")
    diff = worst(losses(rows), losses(ref))
    assert diff < 1e-3, f"--compile losses {diff:.3g} from eager"
    return f"losses within {diff:.2g} of eager", _speed(rows)


def offload_one_gpu(tmp):
    # ~50M parameters: their 12 bytes each (parameters and Adam states, ~600 MB) must dwarf the 64 MiB of cuBLAS
    # workspaces that torch allocates through its caching allocator on an H100 with or without offload
    big = ["--arch.hidden-size", "1024", "--arch.intermediate-size", "2816", "--strategy", "zero3"]
    base = train(tmp / "plain", *STEPS, *big, "--micro-batch-size", "8")
    off = train(tmp / "offload", *STEPS, *big, "--micro-batch-size", "8", "--cpu-offload")
    diff = worst(losses(off), losses(base))
    a, b = off[-1]["mem_peak_bytes"], base[-1]["mem_peak_bytes"]
    assert diff < RTOL, f"offload losses {diff:.3g} from the plain run"
    assert off[-1]["mem_allocated_bytes"] < base[-1]["mem_allocated_bytes"] / 4, "offload left the states on the GPU"
    return (
        f"losses within {diff:.2g}; CUDA peak {a / GIB:.3f} GiB vs {b / GIB:.3f} GiB without offload",
        {"peak_offload_gib": a / GIB, "peak_plain_gib": b / GIB},
    )


def data_parallel(tmp):
    """nn.DataParallel over every visible GPU (2 or more: on one GPU there is no wrapper) against the one-GPU run."""
    rows = train(tmp, *STEPS, "--strategy", "dp", "--micro-batch-size", "8")
    wrapped = re.search(r"nn\.DataParallel over (\d+) GPUs", (tmp / "logs" / "rank-0.log").read_text())
    assert wrapped and int(wrapped.group(1)) >= 2, "--strategy dp did not wrap the model in nn.DataParallel"
    diff = worst(losses(rows), losses(reference(tmp)))
    assert diff < RTOL, f"dp losses {diff:.3g} from single"
    return (
        f"nn.DataParallel over {wrapped.group(1)} GPUs: losses within {diff:.2g} of one GPU, "
        f"MFU {100 * rows[-1]['mfu']:.1f}%"
    ), _speed(rows)


def gpu_tests(tmp):
    """The suite's tests marked gpu, with the GPUs visible (conftest hides them otherwise)."""
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"],
        capture_output=True,
        text=True,
        env={**ENV, "MESHLM_TEST_GPU": "1"},
        cwd=ROOT,
        timeout=1800,
        check=False,
    )
    tail = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr.strip()[-300:]
    if p.returncode:
        failed = [x.split(" - ")[0] for x in p.stdout.splitlines() if x.startswith("FAILED ")]
        raise CheckFailed(f"pytest -m gpu: {tail}: {', '.join(failed)}")
    return tail, {}


def plan_validate(tmp):
    """Predicted against measured CUDA peak memory for a ~1B Llama (gpu_mfu.py's model), single and zero3."""
    p = meshlm(
        "plan",
        "--model",
        "tiny",  # the built-in byte vocabulary: --validate trains it here
        "--layers",
        "16",
        "--hidden",
        "2048",
        "--heads",
        "32",
        "--kv-heads",
        "8",
        "--mlp",
        "8192",
        "--max-positions",
        "4096",
        "--seq-length",
        "2048",
        "--validate",
        "--nproc",
        "1",
        "--steps",
        "3",
        "--json",
        "--output-dir",
        tmp,
    )
    if p.returncode not in (0, 1):
        raise CheckFailed(f"meshlm plan --validate exited {p.returncode}: {p.stderr.strip()[-800:]}")
    results = json.loads(p.stdout)["results"]
    if not results or p.returncode:
        raise CheckFailed(f"{sum(not r['ok'] for r in results)} of {len(results)} layouts off their targets")
    return f"{len(results)} layouts within the plan's targets", {"validate": results}


def initial_weights_cpu_gpu(tmp):
    """Name-seeded init draws every tensor on the CPU: a run on the GPU starts from the CPU run's weights, bitwise.
    One step at --lr 1e-30 leaves the fp32 weights as they were; the final checkpoints are compared by name."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    args = ["--max-steps", "1", "--lr", "1e-30", "--warmup-steps", "0", "--micro-batch-size", "4"]
    weights = {}
    for where, env in (("gpu", {}), ("cpu", {"CUDA_VISIBLE_DEVICES": ""})):
        out = tmp / where
        p = meshlm("train", *MODEL, *args, "--output-dir", out, env=env)
        if p.returncode:
            raise CheckFailed(f"meshlm train on the {where} exited {p.returncode}: {p.stderr.strip()[-800:]}")
        dcp_to_torch_save(out / "checkpoints" / "step-1" / "state", tmp / f"{where}.pt")
        weights[where] = torch.load(tmp / f"{where}.pt", weights_only=False)["model"]
    gpu, cpu = weights["gpu"], weights["cpu"]
    assert gpu.keys() == cpu.keys() and len(cpu) >= 10, f"{len(gpu)} vs {len(cpu)} tensors"
    differ = [k for k in cpu if not torch.equal(gpu[k].cpu(), cpu[k])]
    assert not differ, f"{len(differ)} of {len(cpu)} tensors differ between the GPU and CPU runs, e.g. {differ[:3]}"
    return f"{len(cpu)} tensors bitwise equal after 1 step at lr 1e-30 (GPU run vs CPU run)", {}


def mfu_benchmark(tmp):
    sys.path.insert(0, str(HERE))
    import gpu_mfu

    rows = gpu_mfu.table(steps=20, warmup=5, micro_batch=8, seq_length=2048)
    ran = [r for r in rows if "mfu" in r]
    if len(ran) != len(rows):
        raise CheckFailed("; ".join(f"{r['compile']}/{r['ac']}: {r['error']}" for r in rows if "error" in r))
    best = max(r["mfu"] for r in ran)
    detail = f"best MFU {100 * best:.1f}% (target 45%); " + ", ".join(
        f"compile {r['compile']} ac {r['ac']}: {100 * r['mfu']:.1f}%" for r in ran
    )
    assert best >= 0.45, f"below the 45% target: {detail}"
    return detail, {"mfu_rows": rows}


def long_sequence(tmp):
    """Llama 3.2 1B's shape (128k vocabulary, tied) at 64k tokens on one GPU with the chunked loss,
    activation checkpointing and activation offload; the log's tokens/s and peak memory."""
    from transformers import LlamaConfig

    from meshlm.data.builtin import byte_tokenizer

    model = tmp / "llama-1b"
    LlamaConfig(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        max_position_embeddings=65536,
        tie_word_embeddings=True,
    ).save_pretrained(model)
    byte_tokenizer().save_pretrained(model)
    args = ["--model-name", model, "--seq-length", "65536", "--micro-batch-size", "1", "--max-steps", "4"]
    args += ["--mixed-precision", "bf16", "--activation-checkpointing", "full", "--activation-offload", "true"]
    args += ["--chunked-loss", "auto", "--builtin-samples", "20000", "--output-dir", tmp / "run"]
    args += ["--save-final", "false"]  # its final checkpoint would hold ~19 GB that nothing reads
    p = meshlm("train", *args)
    if p.returncode:
        raise CheckFailed(f"64k tokens did not train: {p.stderr.strip()[-1500:]}")
    rows = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert rows[-1]["loss"] == rows[-1]["loss"], "the loss is NaN"
    speed = _speed(rows)
    return f"{speed['tokens_per_s']:,.0f} tokens/s, peak {speed['mem_peak_gib']:.1f} GiB at 65536 tokens", speed


def _job(attention: str, *extra: str, seq_length: int = 2048, micro_batch: int = 8):
    """peer_torchtitan's ~1B job (gpu_mfu.py's model, the built-in records as documents, compiled,
    bf16) under `attention`, with `extra` options: tokens/s, mfu, mfu_dense, peak memory after the warm-up."""

    def check(tmp):
        sys.path.insert(0, str(HERE))
        import peer_torchtitan as peer

        job = dataclasses.replace(peer.GPU_JOB, attention=attention, seq_length=seq_length, micro_batch=micro_batch)
        args, _ = peer.options(job, peer.write_inputs(job, tmp / "inputs"), tmp / "torchtitan")
        try:
            r = peer.run_meshlm(job, [*args, *extra])
        except RuntimeError as e:
            raise CheckFailed(str(e).strip().splitlines()[-1]) from None
        return (
            f"{r['tokens_per_s']:,.0f} tok/s, mfu {100 * r['mfu']:.1f}% (dense {100 * r['mfu_dense']:.1f}%), "
            f"peak {r['peak_bytes'] / GIB:.1f} GiB"
        ), r

    return check


def float8_tensorwise(tmp):
    """The headline job with --float8 tensorwise; its tokens/s against the bf16 row's."""
    detail, r = _job("sdpa", "--float8", "tensorwise")(tmp)
    base = earlier.get(HEADLINE, {}).get("tokens_per_s")
    if base:
        r["ratio_to_bf16"] = r["tokens_per_s"] / base
        detail += f"; {r['ratio_to_bf16']:.2f}x the bf16 row"
    return detail, r


def torchtitan_peer(tmp):
    """torchtitan's Llama 3 trainer on the flex row's job (peer_torchtitan.py): the flex row is meshlm's side where
    it ran, else meshlm runs here too; target: meshlm >= 1.0x torchtitan's tokens/s."""
    sys.path.insert(0, str(HERE))
    import peer_torchtitan as peer

    mine = {k: v for k, v in earlier.get(FLEX, {}).items() if k in ("tokens_per_s", "mfu", "mfu_dense", "peak_bytes")}
    result = peer.compare(peer.GPU_JOB, tmp, sys.executable, repeats=1, meshlm_side=mine or None)
    failed = "; ".join(
        f"{side}: {result[side]['error']}" for side in ("meshlm", "torchtitan") if "error" in result[side]
    )
    if failed:
        raise CheckFailed(failed)
    detail = ", ".join(
        f"{side} {r['tokens_per_s']:,.0f} tok/s mfu_dense {100 * r['mfu_dense']:.1f}%"
        for side, r in (("meshlm", result["meshlm"]), ("torchtitan", result["torchtitan"]))
    )
    detail += f": {result['ratio']:.2f}x"
    assert result["ratio"] >= 1.0, f"meshlm below torchtitan's tokens/s: {detail}"
    return detail, {"torchtitan_peer": result}


FLOAT8_MODEL = [  # ~3B (Llama 3.2 3B's body), the byte vocabulary
    *["--arch.hidden-size", "3072", "--arch.layers", "28", "--arch.heads", "24", "--arch.kv-heads", "8"],
    *["--arch.intermediate-size", "8192", "--arch.max-positions", "4096", "--builtin-samples", "20000"],
]


def float8_speed(tmp):
    """--float8 rowwise and tensorwise against bf16 on the ~3B configuration (compiled, activation
    checkpointing, sequence 2048); target: float8 >= 1.15x bf16's tokens/s. Refused below compute capability 8.9."""
    import torch

    sys.path.insert(0, str(HERE))
    import harness

    if torch.cuda.get_device_capability() < (8, 9):
        raise CheckFailed(f"float8 needs compute capability 8.9+; this GPU has {torch.cuda.get_device_capability()}")
    job = [*FLOAT8_MODEL, "--seq-length", "2048", "--mixed-precision", "bf16", "--compile", "true"]
    job += ["--activation-checkpointing", "full"]
    recipes = ("off", "tensorwise", "rowwise")
    speed = {f: harness.train(1, 20, 5, 2, *job, "--float8", f)["tokens_per_s"] for f in recipes}
    ratios = {f: speed[f] / speed["off"] for f in ("tensorwise", "rowwise")}
    detail = f"bf16 {speed['off']:,.0f} tok/s; " + ", ".join(f"{f} {r:.2f}x" for f, r in ratios.items())
    assert max(ratios.values()) >= 1.15, f"float8 below 1.15x bf16: {detail}"
    return detail, {"float8_tokens_per_s": speed}


def parity(name: str):
    ranks, args = LAYOUTS[name]

    def check(tmp):
        rows = train(tmp, *STEPS, *args, nproc=ranks)
        diff = worst(losses(rows), losses(reference(tmp)))
        assert diff < RTOL, f"{name}: losses {diff:.3g} from one GPU (> {RTOL:g})"
        return f"losses within {diff:.2g} of one GPU ({ranks} ranks, NCCL)", _speed(rows)

    return check


def generate_pp(tmp):
    """Pipelined generation over NCCL (two message kinds between the same ranks) against mode dp."""
    run = tmp / "run"
    train(run, "--max-steps", "5")
    prompts = tmp / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a} + {b} ="}) + "\n" for a in range(7) for b in (3, 9)))
    outs = {}
    for mode, extra in (("dp", []), ("pp", ["--nproc", "2", "--micro-batches", "4"])):
        out = tmp / f"{mode}.jsonl"
        p = meshlm(
            "generate",
            "--checkpoint",
            run,
            "--prompts",
            prompts,
            "--out",
            out,
            "--max-new-tokens",
            "24",
            "--batch-size",
            "2",
            "--mode",
            mode,
            *extra,
            timeout=600,
        )
        if p.returncode:
            raise CheckFailed(f"generate --mode {mode} exited {p.returncode}: {p.stderr.strip()[-800:]}")
        outs[mode] = [json.loads(x)["token_ids"] for x in out.read_text().splitlines()]
    assert outs["pp"] == outs["dp"], "pp tokens differ from dp"
    return f"{len(outs['pp'])} prompts, same tokens as mode dp", {}


def resume_failure(tmp):
    """Rank 1 fails while resuming over NCCL: exit 1 with its error, promptly, not the exit-2 corrupt line."""
    train(tmp, "--max-steps", "2", "--strategy", "zero3", "--micro-batch-size", "4", nproc=2)
    p = meshlm(
        "train",
        "--nproc",
        "2",
        *MODEL,
        "--max-steps",
        "3",
        "--strategy",
        "zero3",
        "--micro-batch-size",
        "4",
        "--output-dir",
        tmp,
        env={"MESHLM_FAIL_IN_LOAD": "1"},
        timeout=240,
    )
    assert p.returncode == 1 and "injected fault while loading" in p.stderr and "corrupt" not in p.stderr, (
        f"exit {p.returncode}: {p.stderr.strip()[-500:]}"
    )
    return "exit 1 with rank 1's traceback, no timeout wait", {}


def verify(tmp):
    import torch

    n = min(4, torch.cuda.device_count())
    p = meshlm("verify", "--nproc", n, timeout=3600)
    tail = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    if p.returncode:
        raise CheckFailed(f"meshlm verify --nproc {n} exited {p.returncode}: {tail or p.stderr.strip()[-500:]}")
    return f"meshlm verify --nproc {n}: {tail}", {"verify_stdout": p.stdout[-6000:]}


@dataclass(frozen=True)
class Row:
    name: str
    check: Callable
    seconds: float  # estimated before it starts (gpu_check_jobs.estimate)
    lease: str  # "first": the first-lease set; "spare": after it, if time is left; "later": with --all or by name
    gpus: int = 1
    wheels: str = ""  # the gpu_check_jobs.WHEELS group it needs


HEADLINE, FLEX = "~1B bf16 sdpa seq 2048", "~1B bf16 flex seq 2048"
ONE_B, TOKENS = 0.974e9, 8 * 2048  # the ~1B job: parameters, tokens per step
JOB_S = estimate(1, 20, ONE_B, TOKENS, compiled=True)  # peer_torchtitan.GPU_JOB: 20 steps


def rows() -> list[Row]:
    """Every row, in the order they run."""
    first = [
        Row(HEADLINE, _job("sdpa"), JOB_S, "first"),
        Row(FLEX, _job("flex"), JOB_S, "first"),
        Row("~1B float8 tensorwise seq 2048", float8_tensorwise, JOB_S, "first", wheels="torchao"),
        Row("meshlm vs torchtitan 0.2.2 ~1B flex", torchtitan_peer, JOB_S, "first", wheels="torchtitan"),
    ]
    spare = [
        Row("default job fp32", default_fp32, estimate(1), "spare"),
        Row("default job bf16", default_bf16, estimate(2), "spare"),
        Row("compile", compiled, estimate(1) + estimate(1, compiled=True), "spare"),
        Row("zero3 cpu-offload 1 GPU", offload_one_gpu, estimate(2), "spare"),
        Row("initial weights GPU = CPU", initial_weights_cpu_gpu, estimate(2), "spare"),
        Row("plan --validate ~1B", plan_validate, estimate(3, 3, ONE_B, TOKENS), "spare"),
    ]
    mfu_s = estimate(2, 20, ONE_B, TOKENS) + estimate(2, 20, ONE_B, TOKENS, compiled=True)
    later = [
        Row("tests marked gpu", gpu_tests, estimate(10), "later"),
        Row("MFU table ~1B bf16 (target 45%)", mfu_benchmark, mfu_s, "later"),
        Row("~1B bf16 flex seq 8192", _job("flex", seq_length=8192, micro_batch=2), JOB_S, "later"),
        Row(
            "float8 >= 1.15x bf16 ~3B", float8_speed, estimate(3, 20, 3.2e9, 2 * 2048, True), "later", wheels="torchao"
        ),
        Row("64k tokens ~1B: chunked loss, ac, offload", long_sequence, estimate(1, 4, 1.24e9, 65536), "later"),
    ]
    many = [Row(f"parity {n}", parity(n), estimate(2), "later", gpus=ranks) for n, (ranks, _) in LAYOUTS.items()]
    many += [
        Row("dp (nn.DataParallel) 2+ GPUs", data_parallel, estimate(2), "later", gpus=2),
        Row("generate --mode pp over NCCL", generate_pp, estimate(3), "later", gpus=2),
        Row("resume failure over NCCL", resume_failure, estimate(2), "later", gpus=2),
        Row("meshlm verify", verify, estimate(30), "later", gpus=2),
    ]
    return first + spare + later + many
