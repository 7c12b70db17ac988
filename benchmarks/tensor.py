"""Tensor parallel: tokens/s and communication per step for tp = 1, 2, 4 on the same global batch.

    python benchmarks/tensor.py [--steps 30] [--log-every 10] [--hidden 512] [--communication-only]

tokens/s: real `meshlm train --nproc T --parallel.tp T` runs (one thread per rank), read from
metrics.jsonl after the warm-up interval. Communication: a worker applies the same `apply_tp` and
runs one training step (forward + backward) under torch's CommDebugMode, which sees every DTensor
collective; it reports the collectives per transformer block in forward and backward and the bytes
each rank sends per step (ring algorithms). Megatron-style TP needs 2 all-reduces forward and 2
backward per block; with sequence parallel each all-reduce becomes a reduce-scatter + all-gather
pair, and GPT-2's fused q/k/v adds one all-gather forward and one reduce-scatter backward.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
from collections import Counter

from harness import train

ARCH = ["--arch.layers", "4", "--arch.heads", "8", "--arch.kv-heads", "8", "--seq-length", "128"]


def tokens_per_s(tp: int, args) -> float:
    model = [*ARCH, "--arch.hidden-size", str(args.hidden), "--arch.intermediate-size", str(4 * args.hidden)]
    tp_args = ["--parallel.tp", str(tp)] if tp > 1 else []
    return train(tp, args.steps, args.log_every, 8, *model, "--builtin-samples", "2000", *tp_args)["tokens_per_s"]


def communication(tp: int, family: str, sequence_parallel: bool, hidden: int) -> dict:
    """Run the worker below on `tp` ranks; returns its JSON report."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={tp}",
        __file__,
        "--worker",
        family,
        str(hidden),
        "1" if sequence_parallel else "0",
    ]
    p = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(p.stdout.strip().splitlines()[-1])


def worker(family: str, hidden: int, sequence_parallel: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel
    from transformers import AutoModelForCausalLM

    from meshlm.config import Config
    from meshlm.models.build import model_config
    from meshlm.parallel.loss import token_loss_sum
    from meshlm.parallel.tensor import apply_tp

    class CommBytes(CommDebugMode):
        """CommDebugMode that also adds up the bytes this rank sends, as ring algorithms do: an all-reduce
        of n bytes sends 2 (T-1)/T n, a reduce-scatter of n bytes (T-1)/T n, an all-gather of an n-byte
        shard (T-1) n."""

        bytes = 0.0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            packet = getattr(func, "_overloadpacket", None)
            if out is not NotImplemented and packet in self.comm_registry:
                n = args[0].numel() * args[0].element_size()
                name = packet.__name__
                factor = (
                    2 * (tp - 1) / tp if "all_reduce" in name else (tp - 1) if "all_gather" in name else (tp - 1) / tp
                )
                self.bytes += factor * n
            return out

    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    cfg = Config()
    cfg.arch.family, cfg.arch.hidden_size, cfg.arch.layers = family, hidden, 4
    cfg.arch.heads, cfg.arch.kv_heads, cfg.arch.intermediate_size = 8, 8, 4 * hidden
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(cfg, 258), attn_implementation="sdpa")
    if tp > 1:  # as meshlm trains: vocabulary-parallel embedding and head, the loss on vocabulary-sharded logits
        apply_tp(model, init_device_mesh("cpu", (tp,)), sequence_parallel, sharded_logits=True)
    ids = torch.randint(0, 258, (8, 128))
    mode = CommBytes()
    with mode, loss_parallel() if tp > 1 else contextlib.nullcontext():
        loss = token_loss_sum(model(input_ids=ids).logits, ids)
        (loss.to_local() if hasattr(loss, "to_local") else loss).backward()
    per_block = {}
    for key, counts in mode.comm_module_counts.items():
        if key.endswith(".0") and key.rsplit(".", 2)[-2] in ("layers", "h"):  # block 0: all blocks are alike
            per_block = {
                phase: {op.__name__: n for op, n in counts[phase].items()} for phase in ("forward", "backward")
            }
    total = Counter({op.__name__: n for op, n in mode.get_comm_counts().items()})
    if dist.get_rank() == 0:
        print(json.dumps({"per_block": per_block, "total": dict(total), "bytes": mode.bytes}))
    dist.destroy_process_group()


def fmt(counts: dict) -> str:
    return " + ".join(f"{n} {op}" for op, n in sorted(counts.items())) or "none"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--communication-only", action="store_true", help="the bytes and collectives, no tokens/s runs")
    args = ap.parse_args()
    print(
        f"tensor parallel: Llama, 4 layers, hidden {args.hidden}, 8 heads, seq 128, global batch 8, "
        f"CPU ranks ({os.cpu_count()} cores), one thread each"
    )
    base = None
    print(
        f"{'tp':>3} {'tokens/s':>10} {'speed-up':>9} {'MB sent/rank':>13}   collectives per block (forward | backward)"
    )
    for tp in (1, 2, 4):
        tps = math.nan if args.communication_only else tokens_per_s(tp, args)
        base = base or tps
        c = communication(tp, "llama", False, args.hidden) if tp > 1 else {"bytes": 0, "per_block": {}}
        blk = c["per_block"]
        speed = ("-", "-") if math.isnan(tps) else (f"{tps:,.0f}", f"{tps / base:.2f}")
        print(
            f"{tp:>3} {speed[0]:>10} {speed[1]:>9} {c['bytes'] / 2**20:>13.2f}   "
            f"{fmt(blk.get('forward', {}))} | {fmt(blk.get('backward', {}))}",
            flush=True,
        )
    print("communication variants at tp 2 (one step):")
    for family, sp in (("llama", True), ("gpt2", False), ("gpt2", True)):
        c = communication(2, family, sp, args.hidden)
        blk = c["per_block"]
        name = f"{family}{' + sequence parallel' if sp else ''}"
        print(
            f"  {name:<26} {c['bytes'] / 2**20:>7.2f} MB sent/rank/step   "
            f"{fmt(blk['forward'])} | {fmt(blk['backward'])}",
            flush=True,
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1")
    else:
        main()
