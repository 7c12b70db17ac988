"""`meshlm plan --device cpu`: the ranks are CPU processes of this machine, planned and named as such."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from meshlm.cli import main


def _plan(capsys, *args) -> str:
    with pytest.raises(SystemExit) as e:
        main(["plan", "--device", "cpu", "--gpus-per-node", "2", *args])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_cpu_ranks_are_priced_with_this_machine(capsys):
    table = _plan(capsys)
    assert "H100" not in table and "GPU" not in table, table
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert f"2 CPU rank(s) on this machine ({ram / 2 / 2**30:.1f} GiB of its RAM" in table, table
    assert "+offload" not in table  # CPU ranks are the host: nothing to offload to
    rows = json.loads(_plan(capsys, "--json"))["layouts"]
    # an H100 pair plans this model at ~50M tokens/s; no CPU computes a tenth of that
    assert rows and max(r["tokens_per_s"] for r in rows) < 5e6, [r["tokens_per_s"] for r in rows]


# two gloo ranks: how far each collective raises the resident high-water mark above its own input and output
GLOO_COPIES = """
import sys, torch, torch.distributed as dist, torch.multiprocessing as mp

def hwm():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))

def rank(r, store):
    dist.init_process_group("gloo", init_method="file://" + store, rank=r, world_size=2)
    inp, out = torch.ones(2**23), torch.zeros(2**24)  # 64 MiB gathered (fp32), resident before the collective
    before = hwm()
    dist.all_gather_into_tensor(out, inp)
    gather = hwm() - before
    grads, shard = torch.ones(2**24), torch.zeros(2**23)  # kept beside the first two: above the first peak
    before = hwm()
    dist.reduce_scatter_tensor(shard, grads)
    if r == 0:
        print(gather, hwm() - before)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.start_processes(rank, args=(sys.argv[1],), nprocs=2, start_method="spawn")
"""


def test_cpu_ranks_price_gloos_own_collective_buffers(tmp_path):
    """gloo all-gathers into a flat tensor of its own and copies it into the output after, and reduce-scatters by
    all-reducing a clone of its input: measured on two ranks, each collective of 64 MiB raises the resident peak
    by 64 MiB beyond its input and output. `--device cpu` prices both (plan/memory.py GLOO_GATHER): one more
    gathered unit beside FSDP's two, and the clone beside the fp32 reduce-scatter input; GPUs (NCCL writes in
    place) and a pipeline's stage gathered once for the step (no all-gather at the backward peak) do not."""
    from meshlm.plan.activations import activations
    from meshlm.plan.job import Job
    from meshlm.plan.memory import GLOO_GATHER, memory
    from meshlm.plan.shape import StageShape
    from meshlm.plan.spec import load_model

    script = tmp_path / "gloo_copies.py"  # a file: spawned ranks import their function from it
    script.write_text(GLOO_COPIES)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    gather, scatter = map(int, out.stdout.split())
    assert gather > 60 * 2**20 and scatter > 60 * 2**20, out.stdout
    spec = load_model("tiny")
    stage = StageShape(spec.layers, True, True, 1, 1)
    gpu, cpu = (
        memory(spec, Job(seq_length=128, precision="bf16", cpu_ranks=c), stage, "zero3", 4, 4, 1, False, False)
        for c in (False, True)
    )
    unit = stage.gathered_unit(spec)  # the largest unit here: a block (its parameters gathered in bf16)
    assert GLOO_GATHER not in gpu.temp and cpu.temp[GLOO_GATHER] == 2 * unit == gpu.temp["gathered units"] // 2
    reduced = activations(spec, Job(seq_length=128, precision="bf16"), stage, 1, False, True, 2 * 4 * unit)
    assert cpu.act.peak == reduced.peak > gpu.act.peak
    piped = memory(spec, Job(seq_length=128, cpu_ranks=True), stage, "zero3", 4, 4, 1, False, False, pipelined=True)
    assert GLOO_GATHER not in piped.temp
