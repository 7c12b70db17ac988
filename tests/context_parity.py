"""One launch of 4 ranks that trains one step of every context-parallel layout of tests/test_context.py
through meshlm's own resolve -> build_model -> parallelize -> Engine.train_step, and compares each with one process
on the same global batch: the step's loss (relative) and every parameter's gradient (max |a - b| / max |b|).

Usage: python tests/context_parity.py --nproc 4 MODEL_DIR[,MODEL_DIR...] DATASET OUT.json [LAYOUT ...]
(the ranks forked from one process that imported meshlm, tests/helpers/family_runs.py; or run as torchrun's ranks
without --nproc)
Each MODEL_DIR holds a config saved from transformers' config class (random weights: meshlm's seeded init) and a
byte tokenizer; every rank builds the single-process reference itself (same seed, same weights).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from meshlm import runtime
from meshlm.config import load
from meshlm.data.load import load_data
from meshlm.engines.base import local
from meshlm.layout import resolve
from meshlm.models.build import build_model, load_tokenizer, model_config
from meshlm.parallel.apply import parallelize

BATCH = 4  # sequences in the global batch (one step, one micro-batch per data-parallel rank)
# name -> config keys over the common ones. "cp 2" runs as cp 2 x dp 2 (ddp) on the 4 ranks.
LAYOUTS = {
    "cp4": {"parallel.cp": 4},
    "cp4-allgather": {"parallel.cp": 4, "parallel.cp_attention": "allgather"},
    "cp2-ddp2": {"parallel.cp": 2, "strategy": "ddp"},
    "cp2-fsdp2-checkpointed": {"parallel.cp": 2, "strategy": "fsdp", "activation_checkpointing": "full"},
    "cp2-tp2-chunked": {"parallel.cp": 2, "parallel.tp": 2, "chunked_loss": "16"},
    "cp2-pp2-chunked": {"parallel.cp": 2, "parallel.pp": 2, "parallel.micro_batches": 2, "chunked_loss": "16"},
    "cp2-ddp2-lora": {"parallel.cp": 2, "strategy": "ddp", "lora.r": 4},
    # ring (zig-zag: rank r holds chunks r and 2C-1-r of 2C) where the heads would allow ulysses
    "cp4-ring": {"parallel.cp": 4, "parallel.cp_attention": "ring"},
    "cp2-ddp2-ring": {"parallel.cp": 2, "strategy": "ddp", "parallel.cp_attention": "ring"},
}


def config(model_dir: str, dataset: str, keys: dict):
    base = {
        "model_name": model_dir,
        "dataset_name": dataset,
        "seq_length": 64,
        "progress": False,
        "seed": 1234,
    }
    lora = {"lora.alpha": 8} if "lora.r" in keys else {}  # read only with adapters: refused without them
    return load(None, [(k, str(v)) for k, v in {**base, **lora, **keys}.items()])


def clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def scheme(model) -> str:
    """How the model's attention crosses the cp ranks (parallel/context.py), '' without cp."""
    return next((m.context_parallel.scheme for m in model.modules() if hasattr(m, "context_parallel")), "")


def step(cfg, rt, world: int, rows: slice | None = None):
    """One training step of `cfg` on `world` ranks: (the step's loss, {parameter: whole gradient}, layout)."""
    tokenizer, tokenizer_id = load_tokenizer(cfg)
    layout = resolve(cfg, world, model_config(cfg, len(tokenizer)))
    blocks, _ = load_data(cfg, tokenizer, tokenizer_id)
    torch.manual_seed(cfg.seed)
    engine = parallelize(build_model(cfg, tokenizer, "meta"), cfg, rt, layout)
    per_rank = BATCH // layout.dp
    batch = blocks.batch(list(range(BATCH))[engine.dp_rank * per_rank : (engine.dp_rank + 1) * per_rank])
    loss = engine.mean_over_dp(engine.train_step([batch.to(rt.device)]))
    grads = {}
    for name, p in engine.module.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else local(p.grad)
            grads[clean(name)] = g.detach().clone()
    pieces = layout.cp * (2 if engine.split is not None and engine.split.zigzag else 1)
    return loss.item(), grads, (layout, scheme(engine.module), pieces), blocks


def compare(ref: dict, grads: dict) -> float:
    missing = [n for n in grads if n not in ref]
    if missing:
        raise AssertionError(f"gradients of parameters the reference lacks: {missing[:3]}")
    return max(((g - ref[n]).abs().max() / ref[n].abs().max().clamp(min=1e-30)).item() for n, g in grads.items())


def crossing(blocks, pieces: int) -> bool:
    """Some block of the batch has a document running across every boundary between the `pieces` the cp ranks
    hold (cp consecutive ones, or 2 cp zig-zag chunks): its position there is not 0."""
    positions = blocks.batch(list(range(BATCH))).positions
    s = positions.shape[1]
    return all(bool((positions[:, k * s // pieces] > 0).any()) for k in range(1, pieces))


def main(model_dirs: str, dataset: str, out: str, names: list[str]) -> None:
    rt = runtime.init("gloo", 300.0, want_cuda=False)
    results = []
    for model_dir in model_dirs.split(","):
        results += family(model_dir, dataset, names, rt)
    if rt.rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    runtime.shutdown()


def family(model_dir: str, dataset: str, names: list[str], rt) -> list[dict]:
    results, references = [], {}
    for name in names:
        keys = LAYOUTS[name]
        lora = {"lora.r": keys["lora.r"]} if "lora.r" in keys else {}
        if str(lora) not in references:  # the one-process run: every rank computes it alone
            references[str(lora)] = step(config(model_dir, dataset, {"strategy": "single", **lora}), rt, 1)
        ref_loss, ref_grads, _, blocks = references[str(lora)]
        cfg = config(model_dir, dataset, keys)
        loss, grads, (layout, how, pieces), _ = step(cfg, rt, rt.world_size)
        worst = torch.tensor(compare(ref_grads, grads))
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        results.append(
            {
                "model": model_dir,
                "layout": name,
                "describe": layout.describe(),
                "attention": how,
                "loss": loss,
                "reference_loss": ref_loss,
                "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
                "grad_rel": worst.item(),
                "zigzag": pieces == 2 * layout.cp,
                "documents_cross_cp_boundaries": crossing(blocks, pieces),
            }
        )
    return results


if __name__ == "__main__":
    if sys.argv[1] == "--nproc":
        import context_parity  # the ranks unpickle context_parity.main, not __main__'s
        from helpers.family_runs import launch_ranks

        world, (models, dataset, out, *names) = int(sys.argv[2]), sys.argv[3:]
        launch_ranks(world, context_parity.main, models, dataset, out, names or list(LAYOUTS))
    else:
        main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:] or list(LAYOUTS))
