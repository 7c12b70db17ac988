"""Objectives: what a step's loss is. Each is one object the engines compute their loss through (`units`, what
the loss is a mean over; `loss_sum`, a micro-batch's sum; `prepare`, what a step needs before its forwards; the
metrics and held-out rows): `sft.TokenMean` (next-token), `dpo.Preference` (DPO against a reference) and
`grpo.Reinforce` (GRPO on rewards of completions the model generates). The rule they share is the engines'
(engines/base.py `Engine.count`): count the global units first, then every micro-batch backpropagates sum x dp /
count."""

from __future__ import annotations


def objective(cfg, rt, engine, frozen_copy, blocks: list):
    """What the engine's loss is for this run (--objective). `frozen_copy()` builds DPO's reference engine when one
    is needed; `blocks` (training, held-out or None) get a precomputed reference when asked for."""
    if cfg.objective == "sft":
        from meshlm.objectives.sft import TokenMean  # the engines' default: imported with them

        return TokenMean()
    if cfg.objective == "grpo":
        from meshlm.objectives.grpo import reinforce  # generation in the loop: only when asked for

        return reinforce(cfg, rt, engine, frozen_copy)
    from meshlm.objectives.dpo import preference  # DPO's reference and its precomputation: only when asked for

    return preference(cfg, rt, engine, frozen_copy, blocks)


def training_data(cfg, tokenizer, tok_id: str) -> tuple:
    """(training data, held-out blocks or None): token blocks, or GRPO's prompts (its completions are generated)."""
    if cfg.objective == "grpo":
        from meshlm.objectives.grpo_data import load_prompts

        return load_prompts(cfg, tokenizer), load_prompts(cfg, tokenizer, held_out=True) if cfg.eval_every else None
    from meshlm.data.load import load_data

    return load_data(cfg, tokenizer, tok_id)
