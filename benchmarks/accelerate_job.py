"""meshlm's default job written the way Accelerate's own examples write it, for `benchmarks/vs_accelerate.py`.

    accelerate launch --multi_gpu --num_processes 2 benchmarks/accelerate_job.py --cpu --steps 60
    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 ... benchmarks/accelerate_job.py --cpu

(`accelerate launch --cpu` alone starts one process unless mpirun is set up; the torchrun-based
launcher with the script's --cpu, passed to Accelerator(cpu=...) as in accelerate's nlp_example.py,
gives 2 CPU processes with gloo.)

Accelerator, prepare(model, optimizer, dataloader, scheduler), accelerator.backward,
accelerator.clip_grad_norm_, as in accelerate's examples (nlp_example.py). The job matches
`meshlm train`'s defaults: the built-in model and corpus, AdamW with the same lr, betas and weight
decay, the same warm-up + cosine schedule, clipping at 1.0, micro-batch 8 per process. Only the
data order differs (Accelerate shards a shuffled DataLoader), so final losses agree in size, not
digit for digit.

With --model-name DIR --dataset-name FILE (an Alpaca JSONL) it is the classic recipe instead: each record
formatted with the Alpaca prompt plus its response and EOS, all of them concatenated and cut into blocks of
--seq-length tokens (run_clm's group_texts), labels = inputs, plain causal attention (documents see the ones
before them in a block), the model loaded from DIR.

Prints one JSON line: tokens/s after warm-up, rank 0's peak memory (RSS; allocated on CUDA, as meshlm reports
it), and the final loss (mean over the last warm-up-sized interval and the ranks, as meshlm's last metrics row).
"""

import argparse
import itertools
import json
import resource
import time

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshlm.config import Config
from meshlm.data.load import load_data
from meshlm.data.records import format_prompt
from meshlm.models.build import load_tokenizer, model_config
from meshlm.train.schedule import lr_lambda

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--warmup", type=int, default=10)
p.add_argument("--micro-batch", type=int, default=8)
p.add_argument("--seq-length", type=int, default=128)
p.add_argument("--model-name", default="", help="a local causal LM (with --dataset-name: the classic recipe)")
p.add_argument("--dataset-name", default="", help="an Alpaca JSONL, concatenated and cut into blocks")
p.add_argument("--cpu", action="store_true", help="run on CPU processes (as accelerate's examples' --cpu)")
args = p.parse_args()


def concatenated_blocks(path: str, tokenizer, seq: int) -> torch.Tensor:
    """run_clm's recipe: every record's text + EOS, concatenated, cut into blocks (the remainder dropped)."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    texts = [format_prompt(r) + r["output"] for r in records]
    ids = list(itertools.chain.from_iterable(x + [tokenizer.eos_token_id] for x in tokenizer(texts)["input_ids"]))
    return torch.tensor(ids[: len(ids) // seq * seq]).view(-1, seq)


accelerator = Accelerator(cpu=args.cpu)
cfg = Config(max_steps=args.steps, seq_length=args.seq_length)
torch.manual_seed(cfg.seed)
if args.dataset_name:
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    with accelerator.main_process_first():
        blocks = concatenated_blocks(args.dataset_name, tokenizer, args.seq_length)
    model = AutoModelForCausalLM.from_pretrained(args.model_name, attn_implementation="sdpa")
else:
    tok, tok_id = load_tokenizer(cfg)
    with accelerator.main_process_first():  # the examples' way of tokenising once
        blocks = load_data(cfg, tok, tok_id)[0].ids().long()
    model = AutoModelForCausalLM.from_config(model_config(cfg, len(tok)), attn_implementation="sdpa")
optimizer = torch.optim.AdamW(
    model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay
)
train_dataloader = DataLoader(blocks, batch_size=args.micro_batch, shuffle=True, drop_last=True)
# A prepared scheduler steps once per process per optimizer step (Accelerate counts the batches of all
# processes, as its examples size num_training_steps), so the schedule is written in those units: the
# same learning rate at every optimizer step as meshlm's.
per_step = lr_lambda(cfg)
lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: per_step(n // accelerator.num_processes))
model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(model, optimizer, train_dataloader, lr_scheduler)

model.train()
step, t0, last = 0, None, []
while step < args.steps:
    for batch in train_dataloader:
        if step == args.warmup:
            accelerator.wait_for_everyone()
            t0 = time.perf_counter()
        outputs = model(input_ids=batch, labels=batch)
        loss = outputs.loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        step += 1
        if step > args.steps - args.warmup:  # the last interval, as meshlm's last metrics row averages it
            last.append(loss.detach())
        if step == args.steps:
            break
loss = accelerator.reduce(torch.stack(last).mean(), reduction="mean").item()
dt = time.perf_counter() - t0
if accelerator.is_main_process:
    tokens = (args.steps - args.warmup) * args.micro_batch * accelerator.num_processes * blocks.shape[1]
    print(
        json.dumps(
            {
                "tokens_per_s": tokens / dt,
                "loss": loss,
                "world": accelerator.num_processes,
                "peak_bytes": torch.cuda.max_memory_allocated()
                if torch.cuda.is_available()
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "distributed_type": str(accelerator.distributed_type),
            }
        )
    )
accelerator.end_training()
