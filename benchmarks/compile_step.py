"""What `--compile` buys per training step, on one thread, in-process: eager, each block compiled
(meshlm's `--compile`), the whole model compiled, and blocks with max-autotune.

    python benchmarks/compile_step.py [--steps 40] [--repeats 2]

The job is `meshlm train`'s default model and data (micro-batch 8, fused AdamW, clipping). Each
variant runs in a fresh process with its own empty Inductor cache, so "first step" is a cold compile.
Printed per variant: the first step's seconds, and the median and best ms per step after 10 warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = ("eager", "blocks", "whole", "blocks-max-autotune")


def one(variant: str, steps: int) -> dict:
    import torch

    from meshlm.config import Config
    from meshlm.data.load import load_data
    from meshlm.models.build import build_model, load_tokenizer
    from meshlm.models.families import transformer_blocks
    from meshlm.parallel.compiling import apply_compile

    torch.set_num_threads(1)
    cfg = Config()
    tok, tok_id = load_tokenizer(cfg)
    data = load_data(cfg, tok, tok_id)[0].ids().long()
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, tok)  # the model `meshlm train` builds
    if variant == "blocks":
        apply_compile(model)  # what --compile does
    elif variant == "whole":
        model.compile()
    elif variant == "blocks-max-autotune":
        for block in transformer_blocks(model):
            block.compile(mode="max-autotune-no-cudagraphs")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True)
    times = []
    for i in range(steps):
        ids = data[i * 8 : (i + 1) * 8]
        t = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    after = sorted(times[10:])
    return {"first_s": times[0], "median_ms": 1000 * after[len(after) // 2], "best_ms": 1000 * after[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.steps)))
        return
    print(
        f"compile_step: built-in model, micro-batch 8, one thread, {args.steps} steps (10 warm-up), "
        f"{args.repeats} runs per variant, each with an empty Inductor cache"
    )
    print(f"{'variant':<22}{'first step s':>14}{'median ms/step':>16}{'best ms/step':>14}")
    for _ in range(args.repeats):
        for v in VARIANTS:
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": cache}
                p = subprocess.run(
                    [sys.executable, __file__, "--one", v, "--steps", str(args.steps)],
                    capture_output=True,
                    text=True,
                    env=env,
                )
            if p.returncode:
                raise RuntimeError(f"{v} failed:\n{p.stderr[-3000:]}")
            x = json.loads(p.stdout.strip().splitlines()[-1])
            print(f"{v:<22}{x['first_s']:>14.1f}{x['median_ms']:>16.1f}{x['best_ms']:>14.1f}", flush=True)


if __name__ == "__main__":
    main()
