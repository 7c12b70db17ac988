"""The minimal hand-written baseline meshlm is measured against: DDP + DistributedSampler + AdamW, nothing else.

Run with torchrun: `torchrun --nproc-per-node 2 benchmarks/handwritten_ddp.py --steps 60 --micro-batch 8`.
Data and model are the same as `meshlm train`'s built-in default (same blocks, same LlamaConfig);
preparing them is not timed. Prints one JSON line with tokens/s measured after warm-up.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM

from meshlm.config import Config
from meshlm.data.load import load_blocks
from meshlm.models.build import load_tokenizer, model_config

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--warmup", type=int, default=10)
p.add_argument("--micro-batch", type=int, default=8)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
cfg = Config()
tok, tok_id = load_tokenizer(cfg)
blocks = load_blocks(cfg, tok, tok_id).long()
torch.manual_seed(cfg.seed)
model = AutoModelForCausalLM.from_config(model_config(cfg, len(tok)), attn_implementation="sdpa")
model = DDP(model)
opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
sampler = DistributedSampler(blocks, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True)
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
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step == args.steps:
            break
    epoch += 1
loss.item()
dt = time.perf_counter() - t0
if rank == 0:
    tokens = (args.steps - args.warmup) * args.micro_batch * world * blocks.shape[1]
    print(json.dumps({"tokens_per_s": tokens / dt, "loss": loss.item(), "world": world,
                      "threads": int(os.environ.get("OMP_NUM_THREADS", "0"))}))
dist.destroy_process_group()
