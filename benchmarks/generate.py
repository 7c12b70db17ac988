"""Generation throughput: meshlm dp on 1 and 2 ranks, meshlm vs a plain transformers `generate` loop, tp and pp.

    python benchmarks/generate.py                      # CPU ranks, one thread each
    python benchmarks/generate.py --hidden 1024 --layers 8 --prompts 128

Every meshlm run is the real CLI (`meshlm generate --nproc N --omp-threads 1`),
timed by its own summary (decoding only: model loading excluded). Besides wall
time, tokens per CPU-second of the busiest rank are shown: on a machine shared
with other work, wall-clock ratios partly measure the neighbours. The baseline
is the loop a user would write: one process, one thread, batches of the same
size in file order, left padding, `model.generate(do_sample=False)`; a second
row sorts its prompts longest first, as meshlm does.
The model is a random Llama whose EOS is never produced in practice, so every
prompt generates --max-new-tokens tokens in every run and the counts match.

Targets: dp on 2 ranks >= 1.7x dp on 1 rank; meshlm dp per rank >= 0.95x the baseline.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build(d: Path, a) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from meshlm.data.builtin import byte_tokenizer

    tok = byte_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=a.hidden * 8 // 3 // 64 * 64,
        max_position_embeddings=1024,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    with open(d / "prompts.jsonl", "w") as f:
        for i in range(a.prompts):  # 16 to ~200 tokens, shuffled lengths
            f.write(json.dumps({"prompt": f"prompt {i}: " + "abcdefgh " * ((i * 7) % 23 + 1)}) + "\n")


def baseline(d: Path, a, longest_first: bool) -> dict:
    """The hand-written loop, in this (single-threaded) process; prompts in file order, or sorted longest first
    as meshlm batches them (separates the loop's own speed from the padding that sorting saves)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(d / "model")
    model = AutoModelForCausalLM.from_pretrained(d / "model", dtype=torch.float32).eval()
    prompts = [json.loads(line)["prompt"] for line in open(d / "prompts.jsonl")]
    if longest_first:
        prompts.sort(key=lambda p: -len(tok(p)["input_ids"]))
    new = 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    for s in range(0, len(prompts), a.batch_size):
        enc = tok(prompts[s : s + a.batch_size], return_tensors="pt", padding=True, padding_side="left")
        out = model.generate(**enc, max_new_tokens=a.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        for row in out[:, enc["input_ids"].shape[1] :].tolist():  # up to and including EOS, as meshlm counts
            new += row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"new_tokens": new, "wall_s": wall, "tokens_per_s": new / wall, "per_rank": [{"cpu_s": cpu}]}


def meshlm(d: Path, a, mode: str, nproc: int, *extra: str) -> dict:
    out = d / f"{mode}{nproc}.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "meshlm",
        "generate",
        "--model-name",
        str(d / "model"),
        "--prompts",
        str(d / "prompts.jsonl"),
        "--out",
        str(out),
        "--overwrite",
        "--mode",
        mode,
        "--nproc",
        str(nproc),
        "--omp-threads",
        "1",
        "--max-new-tokens",
        str(a.max_new_tokens),
        "--batch-size",
        str(a.batch_size),
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return json.loads(out.with_name(out.stem + ".summary.json").read_text())


def loop(d: Path, *flags: str) -> dict:
    """The baseline in a fresh single-threaded process (the same arguments, plus where the model is)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, __file__, "--baseline-in", str(d), *flags, *sys.argv[1:]]
    return json.loads(subprocess.run(cmd, check=True, env=env, capture_output=True, text=True).stdout.splitlines()[-1])


def per_cpu_s(r: dict) -> float:
    """Tokens per CPU-second of the busiest rank: what the run would reach on idle cores (for pp an upper bound:
    a stage waiting for its neighbour uses no CPU)."""
    return r["new_tokens"] / max(x["cpu_s"] for x in r["per_rank"])


def measure(d: Path, a) -> list[tuple[str, int, dict]]:
    def best(f):
        return max((f() for _ in range(a.repeat)), key=lambda r: r["tokens_per_s"])

    rows = [
        ("transformers generate loop (1 process)", 1, best(lambda: loop(d))),
        ("  same, prompts sorted longest first", 1, best(lambda: loop(d, "--baseline-sorted"))),
    ]
    runs = [
        ("meshlm dp", "dp", 1, ()),
        ("meshlm dp", "dp", 2, ()),
        ("meshlm tp", "tp", 2, ()),
        ("meshlm pp (2 micro-batches in flight)", "pp", 2, ()),
        ("meshlm pp, 1 in flight (no overlap)", "pp", 2, ("--micro-batches", "1")),
    ]
    for name, mode, n, extra in runs:
        try:
            rows.append((name, n, best(functools.partial(meshlm, d, a, mode, n, *extra))))
        except subprocess.CalledProcessError as e:
            print(f"{name} on {n} ranks failed (exit {e.returncode})", file=sys.stderr)
    return rows


def table(rows: list[tuple[str, int, dict]], a) -> None:
    base = rows[0][2]
    dp1 = next(r for name, n, r in rows if name == "meshlm dp" and n == 1)
    print(
        f"\nrandom Llama hidden {a.hidden}, {a.layers} layers; {a.prompts} prompts x {a.max_new_tokens} new "
        f"tokens, batch {a.batch_size}, fp32, one thread per rank ({os.cpu_count()} cores)\n"
    )
    print(
        f"{'run':<40} {'ranks':>5} {'tokens':>6} | {'tokens/s':>8} {'vs dp1':>6} {'/rank':>7} {'vs loop':>7} | "
        f"{'tok/CPU-s':>9} {'vs dp1':>6} {'/rank':>7} {'vs loop':>7} | {'tok p50 ms':>10}"
    )
    for name, n, r in rows:
        wall, cpu = r["tokens_per_s"], per_cpu_s(r)
        lat = f"{r['token_latency_p50_s'] * 1e3:.1f}" if r.get("token_latency_p50_s") else "-"
        print(
            f"{name:<40} {n:>5} {r['new_tokens']:>6} | {wall:>8.1f} {wall / dp1['tokens_per_s']:>5.2f}x "
            f"{wall / n:>7.1f} {wall / n / base['tokens_per_s']:>6.2f}x | {cpu:>9.1f} {cpu / per_cpu_s(dp1):>5.2f}x "
            f"{cpu / n:>7.1f} {cpu / n / per_cpu_s(base):>6.2f}x | {lat:>10}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeat", type=int, default=2, help="runs per row; the fastest is reported")
    p.add_argument("--baseline-in", default="", help=argparse.SUPPRESS)  # internal: run the baseline in DIR
    p.add_argument("--baseline-sorted", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.baseline_in:
        print(json.dumps(baseline(Path(a.baseline_in), a, a.baseline_sorted)))
        return
    sys.path.insert(0, str(ROOT / "src"))
    d = Path(tempfile.mkdtemp(prefix="meshlm-bench-gen-"))
    try:
        build(d, a)
        table(measure(d, a), a)
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
