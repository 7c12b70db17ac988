"""--keep-best and --early-stopping-patience: what each evaluation's eval_loss decides.

A new lowest eval_loss is remembered in TrainState (so a resumed run keeps it); with --keep-best the step is
checkpointed, unless it already was, and checkpoints/best moves to it only once that checkpoint is complete.
--keep-last never deletes what `best` names. With a patience of N, the N-th evaluation in a row without a new
lowest stops training. eval_loss is reduced over the ranks, so every rank decides the same.
"""

from __future__ import annotations

from meshlm.checkpoint.saving import SaveAndResume
from meshlm.checkpoint.store import TrainState
from meshlm.config import Config
from meshlm.runtime import log


def after_eval(cfg: Config, state: TrainState, checkpoints: SaveAndResume, eval_loss: float) -> bool:
    """Record this evaluation; True when training should stop early."""
    if state.best_eval_loss is None or eval_loss < state.best_eval_loss:
        state.best_eval_loss, state.best_step, state.evals_since_best = eval_loss, state.step, 0
        if cfg.keep_best:  # saved after the state changed: the checkpoint records its own best
            path = checkpoints.save_once(state.step)
            checkpoints.store.point_best(path)
            log.info(f"best eval_loss {eval_loss:.4f} so far: checkpoints/best -> {path.name}")
        return False
    state.evals_since_best += 1
    patience = cfg.early_stopping_patience
    if patience and state.evals_since_best >= patience:
        log.info(
            f"early stopping at step {state.step}: eval_loss has not gone below {state.best_eval_loss:.4f} "
            f"(step {state.best_step}) in {patience} evaluation(s) (--early-stopping-patience)"
        )
        return True
    return False
