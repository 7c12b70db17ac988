"""Where a training step's time goes: torch.profiler around the last steps of `meshlm train`, in this process.

    python benchmarks/profile_step.py [--steps 20] [--profile-steps 10] [--threads 1] [-- TRAIN OPTIONS]

The built-in model on one CPU thread: `python benchmarks/profile_step.py`.
The ~1B model of gpu_mfu.py on one GPU (bf16, compiled, micro-batch 4):
`python benchmarks/profile_step.py --gpu-mfu-model --steps 13 --profile-steps 3 -- --micro-batch-size 4
--compile true`.

The job is meshlm's own trainer in one process (`meshlm train` without --nproc), so the step is the one users
run: forward, backward, clipping, fused AdamW, the scheduler, logging. The last --profile-steps steps run under
torch.profiler. Each operator's own time (CPU time on CPU, kernel time on CUDA) goes into a group by its name;
on CPU the self time of the framework's annotated regions (optimizer step, autograd) is Python and bookkeeping.
Printed: ms per step and share per group, the device's busy share (CUDA), and the wall time per step inside
the trainer's train_step (forward, backward, clip, optimizer) and outside it (data, scheduler, logging).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time

# name pattern -> group; the first that matches wins (names lower-cased). On CPU, a name that is not an aten
# operator is a region the framework annotates (the optimizer step, an autograd node): its own time is Python.
BOOKKEEPING = "Python and bookkeeping (annotated regions' own time)"
GROUPS = [
    (r"adam", "optimizer (AdamW)"),
    (r"_foreach_norm|linalg_vector_norm|_foreach_mul|clip", "gradient norm and clipping"),
    (r"scaled_dot_product|flash|fmha|cudnn|attention|sdpa", "attention (SDPA)"),
    (r"aten::(mm|addmm|bmm|baddbmm)\b|gemm|cutlass|xmma|nvjet|cublas", "matrix multiplications"),
    (r"triton|inductor|compiled", "compiled kernels (Inductor)"),
    (r"", "element-wise and other kernels"),
]
GPU_MFU_MODEL = [  # benchmarks/gpu_mfu.py's ~1B Llama, bf16, sequences of 2048
    *("--arch.hidden-size", "2048", "--arch.layers", "16", "--arch.heads", "32", "--arch.kv-heads", "8"),
    *("--arch.intermediate-size", "8192", "--arch.max-positions", "4096", "--builtin-samples", "20000"),
    *("--seq-length", "2048", "--mixed-precision", "bf16"),
]


def group(name: str, cuda: bool) -> str:
    if not cuda and not name.startswith("aten::"):
        return BOOKKEEPING
    return next(g for pattern, g in GROUPS if re.search(pattern, name.lower()))


def profiled_trainer(first: int, cuda: bool):
    """meshlm's Trainer that profiles from step `first` to the end and times the inside of each train_step."""
    import torch

    from meshlm.train.trainer import Trainer

    class ProfiledTrainer(Trainer):
        inside = wall = 0.0
        profiled = 0

        def train_step(self, micro):
            if self.state.step + 1 == first:
                activities = [torch.profiler.ProfilerActivity.CPU]
                activities += [torch.profiler.ProfilerActivity.CUDA] if cuda else []
                ProfiledTrainer.profiler = torch.profiler.profile(activities=activities)
                ProfiledTrainer.profiler.__enter__()
                ProfiledTrainer.started = time.perf_counter()
            t = time.perf_counter()
            out = super().train_step(micro)
            if self.state.step + 1 >= first:
                if cuda:
                    torch.cuda.synchronize()
                ProfiledTrainer.inside += time.perf_counter() - t
                ProfiledTrainer.profiled += 1
            return out

        def train(self):
            row = super().train()
            if cuda:
                torch.cuda.synchronize()
            ProfiledTrainer.wall = time.perf_counter() - ProfiledTrainer.started
            ProfiledTrainer.profiler.__exit__(None, None, None)
            return row

    return ProfiledTrainer


def report(cls, cuda: bool) -> None:
    from torch.autograd import DeviceType

    n = cls.profiled
    totals: dict[str, float] = {}
    for e in cls.profiler.key_averages():
        on_device = e.device_type == DeviceType.CUDA
        if on_device != cuda:
            continue
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        g = group(e.key, cuda)
        totals[g] = totals.get(g, 0.0) + us / 1e3
    counted = sum(totals.values())
    what = "kernel time on the GPU" if cuda else "operators' own CPU time"
    print(f"{n} profiled steps; wall {1e3 * cls.wall / n:.1f} ms per step, {1e3 * cls.inside / n:.1f} ms of it inside")
    print(f"train_step, {1e3 * (cls.wall - cls.inside) / n:.1f} ms outside (data, scheduler, logging)")
    if cuda:
        print(f"GPU busy {counted / (1e3 * cls.wall):.0%} of the wall time")
    print(f"{'group (' + what + ')':<56} {'ms/step':>9} {'share':>7}")
    for g, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"{g:<56} {ms / n:>9.2f} {ms / counted:>7.1%}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile-steps", type=int, default=10, help="the last N steps run under the profiler")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (OMP_NUM_THREADS) [1]")
    ap.add_argument("--gpu-mfu-model", action="store_true", help="gpu_mfu.py's ~1B model in bf16")
    ap.add_argument("train", nargs="*", help="meshlm train options after --")
    args = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    from meshlm import config as config_mod
    from meshlm.train import trainer as trainer_mod

    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as out:
        options = [*(GPU_MFU_MODEL if args.gpu_mfu_model else []), *args.train]
        options += ["--max-steps", str(args.steps), "--progress", "false", "--save-final", "false"]
        cfg = config_mod.load(None, config_mod.parse_args([*options, "--output-dir", out]))
        cls = profiled_trainer(args.steps - args.profile_steps + 1, cuda)
        trainer_mod.Trainer = cls  # trainer_mod.train builds this subclass: the job is otherwise unchanged
        trainer_mod.train(cfg)
    print(
        f"profile_step: meshlm train {' '.join(options)}; "
        f"{torch.get_num_threads()} thread(s), {'cuda' if cuda else 'cpu'}"
    )
    report(cls, cuda)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
