"""Decoding with the model cut into pipeline stages over ranks (`meshlm generate --mode pp`; GRPO's rollout under
--parallel.pp, from the training stages themselves).

Every rank builds the same micro-batches (--batch-size prompts each, longest
first) and follows the same schedule, so the only messages are activations
(stage s -> s + 1) and each step's new tokens (last stage -> every other rank,
which all track every micro-batch's inputs and finished rows). Up to
--micro-batches of them are in flight and each stage visits them round-robin:
while the last stage samples micro-batch m, the first already runs m + 1, so
with at least as many micro-batches as stages every stage has work. A finished
micro-batch's slot goes to the next one waiting. Each in-flight micro-batch has
its own KV cache on every stage, holding that stage's layers. A rank may hold
several stages (an interleaved schedule's V: stage i on rank i mod ranks): a step
then goes around the ranks V times.

The stages are models/stages.py's (`build_stages`, `keep_only`), as in training. The
torch.distributed.pipelining schedules (engines/pipeline.py) are not used here: they push one batch
of equally shaped micro-batches forward (and backward) per step, while decoding
needs a KV cache per micro-batch, shapes that change from prefill to decode,
and a feedback edge from the last stage back to the first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshlm.infer.decode import Completion, Decoder, PromptBatch, Timings


@dataclass
class Ring:
    """This rank's place in one pipeline: its stages as (index, module) in order (stage i on rank i mod `size`),
    its rank within the pipeline, and the two groups of the pipeline's ranks that carry activations and tokens
    (ranks below are the groups' own)."""

    stages: list
    rank: int
    size: int
    activations: dist.ProcessGroup
    tokens: dist.ProcessGroup

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    @staticmethod
    def of_world(stage, rank: int, size: int) -> Ring:
        # Two kinds of message cross the same pairs of ranks in opposite directions (activations s -> s + 1,
        # tokens last -> s). NCCL ignores tags and runs a pair's sends and receives in issue order on one
        # stream, so under one group stage n-2's "send activations of m + 1" could wait on the last stage's
        # "receive" queued behind its "send tokens of m", which waits on n-2's "receive tokens of m", queued
        # behind that send: a deadlock. A group per kind gives each its own ordered channel (what the tags
        # gave under gloo), in which both ends issue the messages in the same order: the slot order.
        return Ring([(rank, stage)], rank, size, dist.new_group(), dist.new_group())


class _Sends:
    """Outstanding isends: their tensors must stay alive (and unchanged) until they complete."""

    def __init__(self):
        self.works = []

    def send(self, t: torch.Tensor, dst: int, group) -> None:
        self.works = [w for w in self.works if not w[0].is_completed()]
        self.works.append((dist.isend(t, group_dst=dst, group=group), t))

    def wait(self) -> None:
        for w, _ in self.works:
            w.wait()
        self.works = []


def decode_pipelined(
    ring: Ring,
    batches: list[PromptBatch],
    new_decoder,
    hidden_size: int,
    dtype: torch.dtype,
    in_flight: int,
    grad_mode=torch.inference_mode,
) -> tuple[list[Completion], Timings]:
    """Run every batch through this rank's stages, under `grad_mode`. Only the last rank returns completions and
    timings.

    new_decoder(batch) -> Decoder with a fresh KV cache; `stage(x, position_ids, attention_mask, past_key_values)`
    maps token ids (first stage) or hidden states to hidden states, or to logits on the last stage. Activations
    travel as `dtype`."""
    with grad_mode():
        return _decode(ring, batches, new_decoder, hidden_size, dtype, in_flight)


def _decode(ring: Ring, batches, new_decoder, hidden_size: int, dtype, in_flight: int):
    queue = deque(batches)
    slots: list[Decoder] = [new_decoder(queue.popleft()) for _ in range(min(in_flight, len(queue)))]
    sent = [False] * len(slots)  # a step of this slot is out whose tokens this rank has not applied yet
    sends = _Sends()
    done: list[Completion] = []
    timings = Timings()
    k = 0
    while slots:
        dec = slots[k]
        if sent[k]:  # the last stage applied its tokens when it made them
            tokens = torch.empty(len(dec.batch.indices), dtype=torch.long, device=dec.input_ids.device)
            dist.recv(tokens, group_src=ring.size - 1, group=ring.tokens)
            dec.advance(tokens)
            sent[k] = False
        if dec.finished:
            if ring.last:
                done += dec.completions()
                timings.extend(dec.timings)
            if queue:
                slots[k] = new_decoder(queue.popleft())
            else:
                del slots[k], sent[k]
            if slots:
                k %= len(slots)
            continue
        sent[k] = _step(ring, dec, hidden_size, dtype, sends)
        k = (k + 1) % len(slots)
    sends.wait()
    return done, timings


def _step(ring: Ring, dec: Decoder, hidden_size: int, dtype: torch.dtype, sends: _Sends) -> bool:
    """One decoding step of `dec` through this rank's stages: each one's input received (token ids on the first
    stage), the stage run, and the output sent on to the next stage, or sampled into tokens sent to every other
    rank (last stage). True when this rank has yet to receive the step's tokens."""
    n_stages = ring.size * len(ring.stages)
    for index, stage in ring.stages:
        if index == 0:
            x = dec.input_ids
        else:
            x = torch.empty((*dec.input_ids.shape, hidden_size), dtype=dtype, device=dec.input_ids.device)
            dist.recv(x, group_src=(index - 1) % ring.size, group=ring.activations)
        out = stage(
            x, position_ids=dec.position_ids, attention_mask=dec.mask, past_key_values=dec.cache, logits_to_keep=1
        )  # the last stage's logits: the last position's, all that sampling reads
        if index < n_stages - 1:
            sends.send(out.to(dtype).contiguous(), (index + 1) % ring.size, ring.activations)
    if not ring.last:
        return True
    if isinstance(out, DTensor):  # tensor parallel within the stage: the vocabulary's shards, gathered
        out = out.full_tensor()
    tokens = dec.pick(out[:, -1, :])
    for r in range(ring.size - 1):
        sends.send(tokens, r, ring.tokens)
    dec.advance(tokens)
    return False
