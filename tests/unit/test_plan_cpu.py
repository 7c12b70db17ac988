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


# two gloo ranks: how far a 64 MiB all-gather raises the resident high-water mark above its input and output
GLOO_COPY = """
import sys, torch, torch.distributed as dist, torch.multiprocessing as mp
from meshlm.compat import all_gather_single

def hwm():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))

def rank(r, store):
    dist.init_process_group("gloo", init_method="file://" + store, rank=r, world_size=2)
    inp, out = torch.ones(2**23), torch.zeros(2**24)  # 64 MiB gathered (fp32), resident before the collective
    before = hwm()
    all_gather_single(out, inp)  # as parallel/fsdp.py's BlockingAllGather calls it
    if r == 0:
        print(hwm() - before)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.start_processes(rank, args=(sys.argv[1],), nprocs=2, start_method="spawn")
"""


def test_cpu_ranks_price_gloos_copy_of_the_prefetched_unit(tmp_path):
    """gloo all-gathers into a flat tensor of its own and then copies it into the output: measured on two ranks,
    a 64 MiB all-gather raises the resident peak by 64 MiB beyond its input and output. `--device cpu` prices the
    moment backward prefetches a unit (plan/memory.py gloo_gathering): the units gathered, that copy and the
    stored activations. It is the peak under LoRA, whose units make small gradients; full fine-tuning peaks when
    a unit makes its whole gradients, GPUs gather in place and a pipeline's stage is gathered once for the step."""
    from meshlm.plan.job import Job
    from meshlm.plan.memory import memory
    from meshlm.plan.shape import StageShape
    from meshlm.plan.spec import load_model

    script = tmp_path / "gloo_copy.py"  # a file: spawned ranks import their function from it
    script.write_text(GLOO_COPY)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout) > 60 * 2**20, out.stdout
    spec = load_model("tiny")
    stage = StageShape(spec.layers, True, True, 1, 1)
    plan = lambda lora_r, cpu, piped=False: memory(  # noqa: E731
        spec, Job(seq_length=128, precision="bf16", lora_r=lora_r, cpu_ranks=cpu), stage, "zero3", 4, 4, 1, False,
        False, pipelined=piped
    )  # fmt: skip
    gpu, cpu = plan(8, False), plan(8, True)
    unit = 2 * stage.gathered_unit(spec)  # a block's parameters in bf16, the largest unit here
    stored = cpu.act.peak - cpu.act.transient
    assert gpu.gathering == 0 and cpu.gathering == cpu.temp["gathered units"] + unit + stored
    # beside the gradients made by then, the head's and the last block's (unmade_gradients): above the activations'
    backward = sum(cpu.states.values()) - cpu.unmade
    assert cpu.gpu_total == backward + cpu.gathering > backward + sum(cpu.temp.values()) + cpu.act.peak
    full = plan(0, True)
    assert full.gathering and sum(full.temp.values()) + full.act.peak > full.gathering  # its unit's whole gradients
    assert plan(8, True, piped=True).gathering == 0


def test_cpu_ranks_price_the_gradients_as_far_as_they_exist():
    """The trainer frees the gradients after each step and FSDP's backward makes a unit's shards only after it freed
    that unit's activations (plan/memory.py unmade_gradients): on CPU ranks GRPO's generation is priced without
    them, and a step of one micro-batch peaks in backward with only the head's and the last block's made (measured:
    benchmarks/suites.py grpo-plan-memory-zero3-x4, the planner's peak 1.15 of the measured one with them whole).
    With accumulation they are whole from the first micro-batch on, and where a block's gradient shards outweigh its
    activations backward peaks near its end; GPU plans and pipelines price them whole."""
    import dataclasses

    from meshlm.plan.job import Job
    from meshlm.plan.memory import memory
    from meshlm.plan.shape import StageShape
    from meshlm.plan.spec import load_model

    spec = load_model("llama-7b")
    stage = StageShape(spec.layers, True, True, 1, 1)
    job = Job(seq_length=1024, micro_batch=8, precision="bf16", objective="grpo", grpo_group=8, cpu_ranks=True)
    plan = lambda job, **kw: memory(spec, job, stage, "zero3", 8, 8, 8, False, False, **kw)  # noqa: E731
    cpu, gpu = plan(job), plan(dataclasses.replace(job, cpu_ranks=False))
    grads = cpu.states["gradients"]
    assert grads == 4 * stage.params(spec) // 8 and cpu.freed == grads
    head = spec.vocab * spec.hidden  # untied: the root unit's, made by the head's backward first
    assert cpu.unmade == grads - 4 * (spec.layer_params + head) // 8
    states, temp = sum(cpu.states.values()), sum(cpu.temp.values())
    backward = states - cpu.unmade + temp + cpu.act.peak
    generating = states - grads + temp + sum(cpu.generation.values())
    assert cpu.gpu_total == max(backward, states - cpu.unmade + cpu.gathering, states + cpu.step, generating)
    whole = max(states + temp + cpu.act.peak, states + cpu.gathering, states + cpu.step, generating + grads)
    assert cpu.gpu_total < whole
    assert (gpu.freed, gpu.unmade) == (0, 0)
    accumulated = plan(job, accumulating=True)
    assert (accumulated.freed, accumulated.unmade) == (grads, 0)
    piped = plan(job, pipelined=True)
    assert (piped.freed, piped.unmade) == (0, 0)
    # short rows: a block's gradient shards outweigh its activations, so backward peaks near its end, with them whole
    short = memory(spec, dataclasses.replace(job, seq_length=64, micro_batch=1), stage, "zero3", 8, 8, 1, False, False)
    assert 4 * spec.layer_params // 8 > short.act.per_layer and (short.freed, short.unmade) == (grads, 0)
