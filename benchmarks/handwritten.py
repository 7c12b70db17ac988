"""The minimal hand-written baselines meshlm is measured against: plain PyTorch, nothing else.

    torchrun --nproc-per-node 2 benchmarks/handwritten.py --layout ddp|zero3|tp --steps 60 --micro-batch 8

ddp:   DistributedDataParallel + DistributedSampler + AdamW
zero3: FSDP2 `fully_shard` on every decoder block, then the root (parameters, gradients and
       optimizer states sharded over all ranks)
tp:    DTensor `parallelize_module` (Megatron plan: q/k/v and gate/up column-wise, o/down
       row-wise), one data-parallel rank: every rank sees the same batch
Data and model are the same as `meshlm train`'s built-in default (same blocks, same LlamaConfig);
preparing them is not timed. Prints one JSON line with tokens/s measured after warm-up and the
peak resident memory of rank 0.
"""

import argparse
import json
import os
import resource
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM

from meshlm.config import Config
from meshlm.data.load import load_data
from meshlm.models.build import load_tokenizer, model_config

p = argparse.ArgumentParser()
p.add_argument("--layout", choices=("ddp", "zero3", "tp"), default="ddp")
p.add_argument("--steps", type=int, default=60)
p.add_argument("--warmup", type=int, default=10)
p.add_argument("--micro-batch", type=int, default=8)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
cfg = Config()
tok, tok_id = load_tokenizer(cfg)
blocks = load_data(cfg, tok, tok_id)[0].ids().long()
torch.manual_seed(cfg.seed)
model = AutoModelForCausalLM.from_config(model_config(cfg, len(tok)), attn_implementation="sdpa")
dp_ranks = world
if args.layout == "ddp":
    model = DDP(model)
elif args.layout == "zero3":
    mesh = init_device_mesh("cpu", (world,))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
else:
    mesh, dp_ranks = init_device_mesh("cpu", (world,)), 1
    plan = {}
    for i in range(len(model.model.layers)):
        plan.update({f"model.layers.{i}.self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")})
        plan.update({f"model.layers.{i}.mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)


def clip_grad_norm(max_norm: float) -> None:
    """clip_grad_norm_ for a model holding both DTensor (tp-sharded) and plain (replicated) gradients,
    which one foreach kernel cannot take together: norm each kind, combine, scale."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    kinds = [[g for g in grads if isinstance(g, DTensor)], [g for g in grads if not isinstance(g, DTensor)]]
    norms = [torch.nn.utils.get_total_norm(k) for k in kinds if k]
    total = torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]).norm()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)


sampler = DistributedSampler(
    blocks, num_replicas=dp_ranks, rank=rank % dp_ranks, shuffle=True, seed=cfg.seed, drop_last=True
)
loader = DataLoader(blocks, batch_size=args.micro_batch, sampler=sampler, drop_last=True)

step, epoch, t0 = 0, 0, None
while step < args.steps:
    sampler.set_epoch(epoch)
    for ids in loader:
        if step == args.warmup:
            dist.barrier()
            t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if args.layout == "tp":
            clip_grad_norm(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step == args.steps:
            break
    epoch += 1
loss = loss.item()
dt = time.perf_counter() - t0
if rank == 0:
    tokens = (args.steps - args.warmup) * args.micro_batch * dp_ranks * blocks.shape[1]
    print(
        json.dumps(
            {
                "layout": args.layout,
                "tokens_per_s": tokens / dt,
                "loss": loss,
                "world": world,
                "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "threads": int(os.environ.get("OMP_NUM_THREADS", "0")),
            }
        )
    )
dist.destroy_process_group()
