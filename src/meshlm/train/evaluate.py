"""Held-out evaluation: the token-mean loss over every held-out block, and its perplexity.

Every data-parallel rank takes a share of each global batch of blocks; every rank runs the same number
of forwards with the same shapes (a rank short of blocks fills its batch with rows that have no targets),
so sharded layouts' collectives line up and pipeline micro-batches divide evenly. Loss sums and target
counts are added over the dp ranks: the same number in every layout, up to float rounding. Dropout is
off while evaluating, and no gradient is made, so training is unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshlm.data.batch import IGNORE, Batch


def rows_of(blocks, idx: list[int], rows: int) -> Batch:
    """Blocks `idx`, filled up to `rows` with copies of block 0 whose labels are all ignored."""
    batch = blocks.batch(idx or [0])
    if not idx:
        batch.labels.fill_(IGNORE)
    short = rows - batch.ids.shape[0]
    if short > 0:
        fill = blocks.batch([0] * short)
        fill.labels.fill_(IGNORE)
        batch = Batch.cat([batch, fill])
    return batch


def evaluate(engine, blocks, micro_batch_size: int, device) -> dict:
    """The objective's held-out row ({"eval_loss", "eval_ppl"} for sft) over all of `blocks`, on every rank."""
    dp, rank, objective = engine.dp_size, engine.dp_rank, engine.objective
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, units (targets, or DPO's pairs)
    was_training = engine.model.training
    engine.model.eval()
    try:
        with torch.no_grad(), objective.held_out():
            step = dp * micro_batch_size
            for start in range(0, len(blocks), step):
                mine = list(range(start, min(start + step, len(blocks))))[rank::dp]
                batch = rows_of(blocks, mine, micro_batch_size).to(device)
                objective.prepare(engine, [batch])
                totals[0] += engine.eval_sum(batch).double().to(device)
                totals[1] += objective.units(batch)
            if engine.dp_group is not None:
                dist.all_reduce(totals, group=engine.dp_group)
            return objective.eval_row((totals[0] / totals[1].clamp(min=1)).item(), engine)
    finally:
        engine.model.train(was_training)
