"""What a run keeps from the run it continues (a resume, or `--config outputs/x/config.toml` on other ranks).

- The global batch: the number of sequences per optimizer step is what the loss, the learning rate and the
  data order depend on, so on another rank count the accumulation follows (2 ranks x accumulation 1 ->
  1 rank x accumulation 2). `--global-batch-size` sets it explicitly; a change is said in one line, and a
  global batch the new ranks cannot hold is refused.
- The learning-rate schedule's span: extending `--max-steps` on resume keeps the warm-up + cosine schedule the
  run started with (the rate stays at its minimum past its end) unless `--lr-schedule-steps` says otherwise.

- The place in the data: a resumed run goes on at the same position of the same epoch's order when its blocks
  are the ones the checkpoint trained on. When they are not (the dataset, the tokenizer or meshlm's packing
  changed), a position in an order of other blocks would train some twice and skip others, and past the end of
  a smaller epoch there is none: the run starts the next epoch over the new blocks, and says so.

The first two are resolved into the config (grad_accum, global_batch_size, lr_schedule_steps) before anything reads it,
so config.toml and every checkpoint record them.
"""

from __future__ import annotations

from meshlm.errors import MeshlmError


def keep_global_batch(cfg, dp: int, resumed: dict | None) -> str | None:
    """Set cfg.grad_accum (and cfg.global_batch_size) for `dp` data-parallel ranks; the line saying what
    changed, if anything did."""
    before = resumed.get("global_batch") if resumed else None
    target, source = (cfg.global_batch_size, "--global-batch-size") if cfg.global_batch_size else (before, "resumed")
    per_step = cfg.micro_batch_size * dp
    if target is None:
        cfg.global_batch_size = per_step * cfg.grad_accum
        return None
    if target % per_step:
        raise MeshlmError(
            f"the global batch of {target} ({'the checkpoint' if source == 'resumed' else source}) is not a multiple "
            f"of micro-batch {cfg.micro_batch_size} x {dp} data-parallel ranks; use a rank count or "
            f"--micro-batch-size that divides it, or set --global-batch-size"
        )
    accum, note = target // per_step, []
    if before is not None and before != target:
        note.append(f"global batch {before} -> {target} ({source}; the loss and the learning rate change with it)")
    if accum != cfg.grad_accum:
        note.append(
            f"accumulation {cfg.grad_accum} -> {accum} keeps the global batch of {target} on {dp} data-parallel "
            f"rank(s) with micro-batch {cfg.micro_batch_size}"
        )
    cfg.grad_accum, cfg.global_batch_size = accum, target
    return "; ".join(note) or None


def keep_schedule(cfg, resumed: dict | None, lr_at) -> str | None:
    """Set cfg.lr_schedule_steps; the line saying what a resumed run's new --max-steps does to the schedule.
    lr_at(span, step): the learning rate at `step` of a schedule spanning `span` steps."""
    before = resumed.get("lr_schedule_steps") if resumed else None
    span = cfg.lr_schedule_steps or before or cfg.max_steps
    cfg.lr_schedule_steps = span
    if resumed is None or before is None:
        return None
    step = resumed["state"]["step"]
    if span != before:
        return (
            f"--lr-schedule-steps {span}: the schedule spans {span} steps instead of {before}; the learning rate "
            f"goes from {lr_at(before, step):.3g} to {lr_at(span, step):.3g} at step {step}"
        )
    if cfg.max_steps > span:
        return (
            f"--max-steps {cfg.max_steps} goes past the schedule's {span} steps: the learning rate stays at its "
            f"minimum {lr_at(span, span):.3g} after step {span} (--lr-schedule-steps {cfg.max_steps} stretches "
            f"the schedule instead: the rate at step {step} becomes {lr_at(cfg.max_steps, step):.3g})"
        )
    return None


def keep_data_order(resumed: dict | None, data: dict, state, steps_per_epoch: int) -> str | None:
    """Move `state` (epoch, step in epoch) to the start of the next epoch when the training blocks are not the ones
    the checkpoint trained on (`data`: Blocks.identity()); the line saying so. A checkpoint that did not record
    its blocks (meshlm before this) is taken as the same data unless its position is past this epoch's end."""
    before = resumed.get("data") if resumed else None
    same = before == data if before is not None else state.step_in_epoch < steps_per_epoch
    if resumed is None or same:
        return None
    was = f"{before['blocks']} blocks" if before is not None else "blocks it did not record"
    epoch, position = state.epoch, state.step_in_epoch
    state.epoch, state.step_in_epoch = state.epoch + 1, 0
    return (
        f"the training data is not what step {state.step} trained on ({was}; now {data['blocks']}: the dataset, "
        f"tokenizer or packing changed): the run goes on from the start of epoch {state.epoch} over the new "
        f"blocks, not from step {position} of epoch {epoch}"
    )
