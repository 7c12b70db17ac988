"""The decoding loop: a batch of left-padded prompts, a KV cache, one new token per step for every row.

It mirrors what transformers' `generate` does for a decoder-only model, so that
greedy decoding gives the same tokens: position ids from the attention mask
(padding does not shift positions), the mask dropped when a batch has no
padding, logits of the last position only, finished rows fed the pad token
until the whole batch is done. How one forward step is computed (a whole
model, a tensor-parallel shard, layers on several devices) is the caller's
`forward` function; the pipeline mode runs its own loop over the same pieces.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from meshlm.models.families.forward import cache_keyword


@dataclass
class Sampling:
    """Greedy when temperature is 0; otherwise temperature then top-p (nucleus) sampling.

    Each prompt has its own generator seeded from seed + its index in the prompts
    file, so a prompt's sample does not depend on which rank or batch it lands in.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generators(self, indices: list[int], device: torch.device | str = "cpu") -> list[torch.Generator | None]:
        """One generator per prompt on the device the logits are on, so sampling never copies them off it."""
        if self.greedy:
            return [None] * len(indices)
        return [torch.Generator(device=device).manual_seed(self.seed + i) for i in indices]

    def pick(self, logits: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """Next token per row from last-position logits [B, V]."""
        if self.greedy:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the most likely token always stays)
            drop = sorted_p.cumsum(-1) - sorted_p >= self.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        rows = [torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)]
        return torch.cat(rows)


@dataclass
class PromptBatch:
    indices: list[int]  # positions of these prompts in the prompts file
    input_ids: torch.Tensor  # [B, L], left-padded
    attention_mask: torch.Tensor  # [B, L], 0 on padding


def make_batch(indices: list[int], token_ids: list[list[int]], pad_id: int, device) -> PromptBatch:
    width = max(len(t) for t in token_ids)
    ids = torch.full((len(token_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(token_ids), width), dtype=torch.long)
    for row, t in enumerate(token_ids):
        ids[row, width - len(t) :] = torch.tensor(t, dtype=torch.long)
        mask[row, width - len(t) :] = 1
    return PromptBatch(list(indices), ids.to(device), mask.to(device))


@dataclass
class Completion:
    index: int
    token_ids: list[int]
    finish: str  # "eos" or "length"
    time_s: float  # from the start of its batch until its last token


@dataclass
class Timings:
    """Wall times of one batch: the prefill (time to first token) and every decode step after it."""

    ttft_s: list[float] = field(default_factory=list)  # one per prompt
    token_s: list[float] = field(default_factory=list)  # one per decode step

    def extend(self, other: Timings) -> None:
        self.ttft_s += other.ttft_s
        self.token_s += other.token_s


class Decoder:
    """One batch in flight: its KV cache, the inputs of its next step, its tokens, finished rows and timings.

    pick() turns a step's logits into tokens (where the logits are); advance() applies tokens (on every
    rank that tracks the batch, so all of them agree on its inputs and on when it is finished).
    """

    def __init__(
        self, batch: PromptBatch, cache, max_new_tokens: int, eos_ids: list[int], pad_id: int, sampling: Sampling
    ):
        self.batch, self.cache, self.max_new, self.pad_id = batch, cache, max_new_tokens, pad_id
        self.sampling = sampling
        self.eos = torch.tensor(eos_ids or [-1], device=batch.input_ids.device)
        self.gens = None  # made on the device of the first logits (layer-split: not the inputs' device)
        n = len(batch.indices)
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.finish = ["length"] * n
        self.done_at = [0.0] * n
        self.done = torch.zeros(n, dtype=torch.bool, device=batch.input_ids.device)
        self.timings = Timings()
        self.steps = 0
        # transformers drops an all-ones mask (no padding): the attention takes its causal fast path
        mask = batch.attention_mask
        self.mask = None if bool(mask.all()) else mask
        self.position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        self.input_ids = batch.input_ids
        self.t0 = self.t_last = time.perf_counter()

    @property
    def finished(self) -> bool:
        return self.steps >= self.max_new or bool(self.done.all())

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Next token per row [B] from last-position logits [B, V]; finished rows get the pad token."""
        if self.gens is None:
            self.gens = self.sampling.generators(self.batch.indices, logits.device)
        nxt = self.sampling.pick(logits, self.gens)
        return torch.where(self.done, torch.full_like(nxt, self.pad_id), nxt)

    def advance(self, nxt: torch.Tensor) -> None:
        """Append one step's tokens [B]: they become the next step's inputs."""
        now = time.perf_counter()
        if self.steps == 0:
            self.timings.ttft_s += [now - self.t0] * len(self.tokens)
        else:
            self.timings.token_s.append(now - self.t_last)
        self.t_last, self.steps = now, self.steps + 1
        hit_eos = torch.isin(nxt, self.eos) & ~self.done
        for row, (tok, was_done, eos) in enumerate(zip(nxt.tolist(), self.done.tolist(), hit_eos.tolist())):
            if not was_done:
                self.tokens[row].append(tok)
                self.done_at[row] = now - self.t0
                if eos:
                    self.finish[row] = "eos"
        self.done |= hit_eos
        self.input_ids = nxt[:, None]
        if self.mask is not None:
            self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=-1)
        self.position_ids = self.position_ids[:, -1:] + 1

    def completions(self) -> list[Completion]:
        rows = zip(self.batch.indices, self.tokens, self.finish, self.done_at)
        return [Completion(i, t, f, d) for i, t, f, d in rows]


def kv_cache(config):
    """A batch's KV cache: transformers' `DynamicCache` laid out by the model's config, so a sliding-window layer
    (Mistral, Gemma 2/3's local layers, StarCoder 2) keeps only its window of keys and values while a global
    layer keeps them all. Under pp each stage's cache has every layer's slot and fills only its own layers'."""
    from transformers import DynamicCache

    return DynamicCache(config=config)


def generate_batch(
    forward, new_cache, batch: PromptBatch, max_new_tokens: int, eos_ids: list[int], pad_id: int, sampling: Sampling
) -> tuple[list[Completion], Timings]:
    """Decode one batch. forward(input_ids, attention_mask, position_ids, cache) -> last-position logits [B, V]."""
    dec = Decoder(batch, new_cache(), max_new_tokens, eos_ids, pad_id, sampling)
    while not dec.finished:
        logits = forward(dec.input_ids, dec.mask, dec.position_ids, dec.cache)
        dec.advance(dec.pick(logits))
    return dec.completions(), dec.timings


def model_forward(model, grad_mode=torch.inference_mode):
    """The forward step of a whole (possibly tensor-parallel) transformers causal LM, under `grad_mode`."""
    cache_kw = cache_keyword(model.forward)

    @grad_mode()
    def forward(input_ids, attention_mask, position_ids, cache):
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{cache_kw: cache},
        )
        return out.logits[:, -1, :]

    return forward


def stages_forward(stages, devices):
    """The forward step through pipeline stages placed on several devices in one process (layer split):
    one shared KV cache, each layer's entries on its own device; logits come back to the first device."""

    @torch.inference_mode()
    def forward(input_ids, attention_mask, position_ids, cache):
        x = input_ids
        for stage, d in zip(stages, devices):
            mask = attention_mask.to(d) if attention_mask is not None else None
            x = stage(
                x.to(d), position_ids=position_ids.to(d), attention_mask=mask, past_key_values=cache, logits_to_keep=1
            )
        return x[:, -1, :].to(devices[0])

    return forward
