"""What a GRPO step (objectives/grpo.py) adds to the planner's price: its generation phase, and the reference model
when --grpo.beta > 0 (priced as DPO's: job.py reference_copy).

A rank decodes its step's groups a batch at a time: up to --micro-batch-size rows of groups whose prompts have one
length, or one group (--grpo.group-size copies of a prompt) when a group is larger (objectives/grpo.py
decode_rows), with a KV cache of --seq-length positions (prompt + --grpo.max-new-tokens). Under zero3/hsdp the
whole model is gathered on every rank while decoding (--grpo.gather-for-generation, objectives/grpo_gather.py:
memory.py prices it in the generation phase; false: the same gathered units as a training forward). Under pp
through the training stages, a batch in flight per stage at most, each with its KV cache on every stage for that
stage's layers only (infer/pipelined.py). The cache is dropped before any training forward, so the generation
phase's peak stands beside the states and the gathered units, not beside the training activations (memory.py
Memory.gpu_total takes the larger).
The training forward is the sft one's over rows of --seq-length with the whole logits (the completions'
log-probabilities read them a chunk at a time: one chunk of fp32 log-softmax, its exponent and gradient).
"""

from __future__ import annotations

from meshlm.objectives.grpo import decode_rows
from meshlm.parallel.loss import CHUNK_ELEMENTS
from meshlm.plan.job import Job
from meshlm.plan.shape import StageShape
from meshlm.plan.spec import ModelSpec


def decode_batches(job: Job, micro: int) -> int:
    """The fewest decode batches of a step's `micro` micro-batches of completions on one rank (more when its prompts
    differ in length)."""
    return max(1, -(-micro * job.micro_batch // decode_rows(job.grpo_group, job.micro_batch)))


def in_flight(job: Job, pp: int, micro: int) -> int:
    """Decode batches a rank holds a KV cache for at once: one, or under pp one per stage while the step has as many
    (infer/pipelined.py: each in flight keeps its cache on every stage, for that stage's layers)."""
    return min(pp, decode_batches(job, micro)) if job.objective == "grpo" and pp > 1 else 1


def generation_bytes(spec: ModelSpec, job: Job, stage: StageShape, half: int, batches: int = 1) -> dict[str, int]:
    """The generation phase's buffers per rank (bytes), by part, with `batches` decode batches in flight
    (`in_flight`); empty for other objectives."""
    if job.objective != "grpo":
        return {}
    g, prompt = decode_rows(job.grpo_group, job.micro_batch), job.seq_length - job.grpo_new_tokens
    kv = 2 * stage.layers * g * job.seq_length * spec.kv_heads * spec.head_dim // stage.tp * half
    vocab = spec.vocab // stage.tp if stage.last else 0
    parts = {
        "KV cache (a decode batch x seq length)": kv,
        # the prompt's forward returns every position's logits; then a decode step's fp32 logits and probabilities
        "prefill logits": g * prompt * vocab * half,
        "sampling logits and probabilities": 2 * 4 * g * vocab,
    }
    if batches > 1:
        parts["KV caches of the other decode batches in flight (pp)"] = (batches - 1) * kv
    return parts


def logp_chunk(spec: ModelSpec, job: Job, stage: StageShape) -> dict[str, int]:
    """One chunk of the completions' fp32 log-softmax, its exponent and its gradient (objectives/grpo.py
    completion_logps), on the last stage: a temporary buffer of the training phase."""
    if job.objective != "grpo" or not stage.last:
        return {}
    chunk = min(CHUNK_ELEMENTS, job.micro_batch * job.seq_length * spec.vocab // stage.tp)
    return {"completion log-probabilities, one chunk (grpo)": 3 * 4 * chunk}


def generation_seconds(
    job: Job, micro: int, stage_params: int, active: int, half: int, hbm_bw: float, flops: float, pp: int = 1
) -> float:
    """A rank's generation time per step (`micro` micro-batches of completions): each decode batch's prefill
    (compute-bound) and its decode steps, each reading the stage's weights once (memory-bound at a batch's few
    rows) or computing, whichever is slower. Under pp a token goes around all the stages before the next: with
    fewer batches than stages each stage waits for the round."""
    if job.objective != "grpo":
        return 0.0
    rows = decode_rows(job.grpo_group, job.micro_batch)
    prompt = job.seq_length - job.grpo_new_tokens
    prefill = 2 * active * rows * prompt / flops
    decode = job.grpo_new_tokens * max(stage_params * half / hbm_bw, 2 * active * rows / flops)
    return max(decode_batches(job, micro), pp) * (prefill + decode)


def generation_gathers(
    add, job: Job, strategy: str, dp: int, shard: int, pp: int, micro: int, gathered: int, units: int
) -> None:
    """The parameter all-gathers of a rank's decoding under zero3/hsdp outside a pipeline (a stage stays gathered
    for the step), `gathered` bytes each time: the whole model once before decoding (--grpo.gather-for-generation,
    objectives/grpo_gather.py), or every unit again for each token of each decode batch (false). Neither hides
    behind compute: a decoding forward's few rows compute far less than its gathers move."""
    if job.objective != "grpo" or pp > 1 or strategy not in ("zero3", "hsdp"):
        return
    group, ranks = ("dp_shard", shard) if strategy == "hsdp" else ("dp", dp)
    if job.grpo_gather:
        add("all_gather", "whole model for generation, once a step (grpo)", group, ranks, gathered, units, False)
        return
    forwards = decode_batches(job, micro) * job.grpo_new_tokens  # the prompt's forward gives the first token
    what = "parameters, every decoded token's forward (grpo, --grpo.gather-for-generation false)"
    add("all_gather", what, group, ranks, forwards * gathered, forwards * units, False)
