"""--eval-samples: a few prompts decoded greedily by the model being trained, at every evaluation.

The prompts are read and encoded once, as `meshlm generate --prompts` reads them (a .jsonl or .txt file), or
taken from the first N held-out records. Decoding is meshlm generate's own loop (infer/decode.py) over the
trained model without its data-parallel wrapper: the chunked-loss head returns logits while no targets are set.
Every rank decodes every prompt, the same tokens in the same steps, so under FSDP each forward's all-gathers pair
up; the layouts that split one forward over ranks are refused by config.py. The tokens are the EOS of a meshlm
checkpoint (the tokenizer's), so a sample equals `meshlm generate --checkpoint` on that step's checkpoint.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from meshlm.errors import MeshlmError
from meshlm.models.build import max_positions
from meshlm.runtime import log

FILE = "samples.jsonl"  # in the run directory: one row per prompt and evaluation (step, prompt, completion)


@dataclass
class EvalSamples:
    prompts: list[str]
    token_ids: list[list[int]]
    tokenizer: object
    max_new_tokens: int

    @staticmethod
    def of(cfg, tokenizer, model_config) -> EvalSamples:
        """The encoded prompts of --eval-samples (the trainer asks only with it); bad prompts are one line here,
        before the run directory is written."""
        from meshlm.infer.prompts import encode, render

        prompts, templated = render(_prompts(cfg), tokenizer)
        positions = max_positions(model_config)
        if positions is not None and cfg.eval_sample_tokens >= positions:
            raise MeshlmError(
                f"--eval-sample-tokens {cfg.eval_sample_tokens} leaves no room for a prompt in the model's "
                f"{positions} positions; use --eval-sample-tokens {positions - 1} or less"
            )
        ids, _ = encode(prompts, tokenizer, positions, cfg.eval_sample_tokens, True, templated)
        return EvalSamples(prompts, ids, tokenizer, cfg.eval_sample_tokens)

    def generate(self, engine, device: torch.device) -> list[dict]:
        """{"prompt", "completion"} per prompt, on every rank (each rank takes part in every forward)."""
        from meshlm.infer.decode import Sampling, generate_batch, kv_cache, make_batch, model_forward
        from meshlm.infer.generate import pad_id
        from meshlm.infer.load import eos_ids

        model = engine.module
        eos = eos_ids(model, self.tokenizer, from_checkpoint=True)
        pad = pad_id(self.tokenizer, eos)
        batch = make_batch(list(range(len(self.prompts))), self.token_ids, pad, device)
        was_training = model.training
        model.eval()
        try:
            with engine.autocast():
                new_cache = lambda: kv_cache(model.config)  # noqa: E731
                comps, _ = generate_batch(
                    model_forward(model), new_cache, batch, self.max_new_tokens, eos, pad, Sampling()
                )
        finally:
            model.train(was_training)
        return [
            {
                "prompt": self.prompts[c.index],
                "completion": self.tokenizer.decode(c.token_ids, skip_special_tokens=True),
            }
            for c in comps
        ]


def _prompts(cfg) -> list:
    """The prompts file's, or the first N held-out records' prompts (as generate reads a record)."""
    from meshlm.infer.prompts import prompt_of, read_prompts

    if not cfg.eval_samples.isdigit():
        return read_prompts(cfg.eval_samples)
    from meshlm.data.load import split_records

    n = int(cfg.eval_samples)
    held = itertools.islice((prompt_of(rec, where) for out, rec, where in split_records(cfg) if out), n)
    prompts = list(held)
    if len(prompts) < n:
        raise MeshlmError(
            f"--eval-samples {n}: the held-out part has {len(prompts)} records; use {len(prompts)} or fewer"
        )
    return prompts


def write(out: Path, step: int, rows: list[dict], wandb) -> None:
    """Rank 0: the rows into samples.jsonl, the console and the rank log; a W&B table when --wandb is on."""
    with open(out / FILE, "a", encoding="utf-8") as f:
        f.writelines(json.dumps({"step": step, **r}, ensure_ascii=False) + "\n" for r in rows)
    for i, r in enumerate(rows):
        log.info(f"step {step}: sample {i}: {r['prompt']!r} -> {r['completion']!r}")
    if wandb is not None:
        import wandb as wb

        table = wb.Table(
            columns=["step", "prompt", "completion"], data=[[step, r["prompt"], r["completion"]] for r in rows]
        )
        wandb.log({"eval_samples": table}, step=step)
