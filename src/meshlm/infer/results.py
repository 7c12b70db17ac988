"""What `meshlm generate` hands back: one record per prompt in input order, gathered to rank 0, the summary of the
run's throughput and latency, the lines it logs, and the files written whole (a reader never sees half of one)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch.distributed as dist

from meshlm.infer.decode import Completion, Timings
from meshlm.runtime import log


def gather(obj) -> list:
    """Every rank's `obj` on rank 0, in rank order (None elsewhere); [obj] without a process group."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)  # readers never see half a file


def records(comps: list[Completion], work) -> list[dict]:
    """One record per prompt (`work`: generate's PreparedPrompts), in input order; each prompt must have been
    generated exactly once."""
    got = sorted(c.index for c in comps)
    if got != list(range(len(work.prompts))):
        raise RuntimeError(
            f"generation lost or duplicated prompts: {len(got)} completions for {len(work.prompts)} prompts"
        )
    tok = work.model.tokenizer
    return [
        {
            "index": c.index,
            "prompt": work.prompts[c.index],
            "completion": tok.decode(c.token_ids, skip_special_tokens=True),
            "token_ids": c.token_ids,
            "new_tokens": len(c.token_ids),
            "finish": c.finish,
            "time_s": round(c.time_s, 6),
            "truncated": work.truncated[c.index],
        }
        for c in sorted(comps, key=lambda c: c.index)
    ]


def summarize(opts, recs: list[dict], timings: Timings, ranks: list[dict], wall: float, world: int) -> dict:
    """The run's summary (`opts`: its GenerateOptions): throughput, latency percentiles, each rank's memory."""
    new_tokens = sum(r["new_tokens"] for r in recs)
    return {
        "mode": opts.mode,
        "attention": opts.model.attention,
        "ranks": world,
        "prompts": len(recs),
        "new_tokens": new_tokens,
        "batch_size": opts.batch_size,
        "max_new_tokens": opts.max_new_tokens,
        "greedy": opts.sampling.greedy,
        "wall_s": wall,
        "prompts_per_s": len(recs) / wall,
        "tokens_per_s": new_tokens / wall,
        "ttft_p50_s": _pct(timings.ttft_s, 50),
        "ttft_p99_s": _pct(timings.ttft_s, 99),
        "token_latency_p50_s": _pct(timings.token_s, 50),
        "token_latency_p99_s": _pct(timings.token_s, 99),
        "per_rank": ranks,
    }


def report(s: dict) -> None:
    def ms(x):
        return "-" if x is None else f"{x * 1e3:.1f} ms"

    log.info(
        f"generated {s['prompts']} prompts, {s['new_tokens']} new tokens in {s['wall_s']:.2f} s "
        f"({s['mode']}, {s['ranks']} rank(s)): {s['prompts_per_s']:.2f} prompts/s, "
        f"{s['tokens_per_s']:.1f} tokens/s"
    )
    log.info(
        f"time to first token p50 {ms(s['ttft_p50_s'])}, p99 {ms(s['ttft_p99_s'])}; "
        f"per-token latency p50 {ms(s['token_latency_p50_s'])}, p99 {ms(s['token_latency_p99_s'])}"
    )
    for r in s["per_rank"]:
        log.info(
            f"rank {r['rank']} ({r['device']}): peak memory {r.get('mem_peak_bytes', 0) / 2**20:.0f} MiB, "
            f"{r['cpu_s']:.2f} CPU-s decoding"
        )
