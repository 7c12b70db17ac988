"""The chunked loss's time cost: one process, CPU step time with `--chunked-loss off` and `auto`.

The Llama of benchmarks/long_sequences.py (hidden 256, 4 blocks, 8 heads, MLP 688, a 32000 vocabulary, untied:
19.5M parameters, the head 8.2M of them, so the head is most of a step's FLOPs: the worst case for a loss that
does more head work), fp32, one OpenMP thread, micro-batch 1 of 2048 tokens (both settings fit; auto chunks:
the logits of 2048 tokens span 4 chunks of 524). Tokens/s after a warm-up interval (harness.summary) and the
run's CPU seconds (user + system of the child, start-up included: the same for both settings, so their
difference is the steps'; on a loaded machine CPU seconds move less than wall time), best of --repeats with
the two settings taking turns, and each run's peak resident memory.

    python benchmarks/chunked_loss_time.py [--seq 2048] [--steps 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from harness import summary, train_run
from long_sequences import save_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = Path(tempfile.mkdtemp(prefix="chunked-time-")) / "llama"
    save_model(model)
    best: dict[str, dict] = {}
    for i in range(args.repeats):
        for setting in ("off", "auto") if i % 2 == 0 else ("auto", "off"):
            extra = ["--model-name", str(model), "--seq-length", str(args.seq), "--chunked-loss", setting]
            job = train_run(1, args.steps, 2, 1, *extra)
            r = summary(job["rows"], 2) | {"cpu_s": job["cpu_s"]}
            load = os.getloadavg()[0]
            print(
                f"run {i + 1} chunked-loss {setting:<4} {r['tokens_per_s']:8.1f} tokens/s "
                f"{r['cpu_s']:6.1f} CPU s  load {load:.1f}"
            )
            kept = best.setdefault(setting, {})
            for key, better in (("tokens_per_s", max), ("cpu_s", min)):
                kept[key] = better(kept.get(key, r[key]), r[key])
            kept["peak_bytes"] = r["peak_bytes"]
    off, auto = best["off"], best["auto"]
    for setting, r in best.items():
        print(
            f"best chunked-loss {setting:<4} {r['tokens_per_s']:8.1f} tokens/s "
            f"{1e3 * args.seq / r['tokens_per_s']:7.0f} ms/step {r['cpu_s']:6.1f} CPU s  "
            f"peak RSS {r['peak_bytes'] / 2**20:7.0f} MiB"
        )
    print(
        f"auto / off: step time {off['tokens_per_s'] / auto['tokens_per_s']:.3f}, "
        f"CPU s {auto['cpu_s'] / off['cpu_s']:.3f}"
    )


if __name__ == "__main__":
    main()
