"""A transformers decoder cut into stages: embeddings + first blocks | ... | last blocks + final norm + LM head.

Pipeline parallel puts one stage (or several, interleaved) on each rank, layer split puts one
on each device of one process, and generation runs them under no_grad with a KV cache. A stage
holds the model's own modules (nothing is copied) and runs like the model's own forward: it makes
positions, rotary embeddings and the causal mask itself, so every stage has them.
"""

from __future__ import annotations

import inspect
from functools import cache

import torch
from torch import nn

from meshlm.errors import MeshlmError
from meshlm.models.families import Family, decoder, head_name, pipeline_parts, tied
from meshlm.models.families.forward import (
    attention_scaling,
    cache_argument,
    cache_index,
    cache_keyword,
    final_logits,
    layer_type,
    mask_function,
    masks_see_positions,
    scaled_embeddings,
)


class Stage(nn.Module):
    """Blocks `layer_ids` of a transformers decoder, with the embeddings when first and the final norm and
    LM head when last. It holds the model's own modules (nothing is copied) and runs like the model's own
    forward: positions, rotary embeddings and the causal mask are made here, so every stage has them.
    Works under no_grad with a KV cache (past_key_values) for generation."""

    def __init__(self, model: nn.Module, p: Family, index: int, layer_ids: list[int], last: bool):
        super().__init__()
        dec = decoder(model)
        self.config, self.family, self.index, self.layer_ids = model.config, p, index, layer_ids
        self.is_first, self.is_last = index == 0, last
        self.embed = nn.ModuleDict({n: getattr(dec, n) for n in p.embed}) if self.is_first else None
        self.layers = nn.ModuleList([getattr(dec, p.layers)[i] for i in layer_ids])
        self.rotary = getattr(dec, p.rotary, None) if p.rotary else None
        self.norm = getattr(dec, p.norm) if last else None
        self.cache_arg = cache_argument(self.layers[0])
        self.cache_ids = [cache_index(layer, i) for i, layer in zip(layer_ids, self.layers)]
        self.mask_positions = masks_see_positions(model)
        kinds = {layer_type(self.config, i) for i in layer_ids}
        self.mask_functions = {kind: mask_function(model, kind) for kind in kinds}
        # the keyword each takes the KV cache under, read once here rather than on every forward
        self.cache_keywords = {kind: cache_keyword(fn) for kind, fn in self.mask_functions.items()}
        self.head = model.get_output_embeddings() if last else None
        # A head tied to the token embedding: the last stage keeps a reference to the embedding module
        # too, so wrappers that swap parameters (FSDP) see every module holding the weight.
        self.tied_embed = model.get_input_embeddings() if last and not self.is_first and tied(model) else None

    def get_input_embeddings(self):
        return self.embed[self.family.embed[0]] if self.embed is not None else self.tied_embed

    def get_output_embeddings(self):
        return self.head

    def forward(self, x, position_ids=None, attention_mask=None, past_key_values=None, logits_to_keep: int = 0):
        """x: token ids on the first stage, hidden states after it. Returns hidden states, or logits if last:
        of the last `logits_to_keep` positions (0: all), as the model's own forward (decoding needs one)."""
        if position_ids is None:  # a stage's cache may hold only its own layers: ask the first of them
            past = past_key_values.get_seq_length(self.cache_ids[0]) if past_key_values is not None else 0
            position_ids = torch.arange(past, past + x.shape[1], device=x.device).unsqueeze(0)
        h = x if self.embed is None else self._embed(x, position_ids)
        kw = {"position_ids": position_ids, self.cache_arg: past_key_values, "use_cache": past_key_values is not None}
        rotary = _Rotary(self.rotary, self.config, h, position_ids)
        mask_positions = position_ids if self.mask_positions else None
        masks = _Masks(
            self.mask_functions, self.cache_keywords, self.config, h, attention_mask, past_key_values, mask_positions
        )
        for i, entry, layer in zip(self.layer_ids, self.cache_ids, self.layers):
            kind = layer_type(self.config, i)
            h = layer(h, attention_mask=masks.of(entry, kind), **kw, **rotary.of(kind))
        if self.is_last:
            h = self.norm(h)
            if logits_to_keep:  # decoding; training (0) keeps every position and its tensor as it is
                h = h[:, -logits_to_keep:]
            h = self.head(h.to(self.head.weight.device))  # layer split: a tied head lives with the embedding
            h = final_logits(self.config, h)
        return h

    def _embed(self, ids, position_ids):
        """The token embedding, then what the decoder's forward adds: learned positions (GPT-2), dropout modules,
        a multiplier (Granite)."""
        h = self.embed[self.family.embed[0]](ids)
        for name in self.family.embed[1:]:
            h = h + self.embed[name](position_ids) if name == self.family.positions else self.embed[name](h)
        return scaled_embeddings(self.config, h)


class _Rotary:
    """The rotary embedding's (cos, sin) for each attention type a stage's layers use, made once per forward:
    one for all layers, or one per layer type where the family rotates each type its own way (Gemma 3); a
    layer type without rotary gets what the decoder's forward gives it instead (Beam: a query scaling)."""

    def __init__(self, rotary, config, h, position_ids):
        self.rotary, self.config, self.h, self.position_ids, self.made = rotary, config, h, position_ids, {}
        self.per_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters

    def of(self, kind: str) -> dict:
        if self.rotary is None:
            return {}
        key = kind if self.per_type else None
        if key not in self.made:
            scaling = attention_scaling(self.config, self.rotary, kind, self.position_ids) if self.per_type else None
            extra = (kind,) if self.per_type else ()
            if scaling is not None:
                self.made[key] = {"position_embeddings": None, "attention_scaling": scaling}
            else:
                self.made[key] = {"position_embeddings": self.rotary(self.h, self.position_ids, *extra)}
        return self.made[key]


class _Masks:
    """The mask each layer's attention type needs, made once per forward (as the model's own forward does)."""

    def __init__(self, functions: dict, keywords: dict, config, h, attention_mask, past_key_values, position_ids):
        self.functions, self.keywords, self.made = functions, keywords, {}
        self.kw = {
            "config": config,
            "inputs_embeds": h,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
        }
        self.cache = past_key_values

    def of(self, entry: int, kind: str):
        if kind not in self.made:
            make = self.functions[kind]  # families.mask_function: as the decoder's own forward picks it
            # Sizes come from this layer's cache entry: the default (the model's first layer) is empty on
            # later stages, and already holds this step's keys when stages share one cache (layer split).
            self.made[kind] = make(**self.kw, **{self.keywords[kind]: self.cache}, layer_idx=entry)
        return self.made[kind]


def _numel(*modules) -> int:
    return sum(p.numel() for m in modules if m is not None for p in m.parameters())


def stage_layers(model: nn.Module, n_stages: int, pp_split: str = "") -> list[list[int]]:
    """Layer indices of each stage: `pp_split` ("4,8,12": first layer of each stage after the first) or
    balanced so the largest stage holds as few parameters as possible (embeddings count for the first
    stage, final norm and LM head for the last)."""
    p = pipeline_parts(model.config, "pipeline parallel")
    dec = decoder(model)
    layers = getattr(dec, p.layers)
    n = len(layers)
    if n_stages > n:
        raise MeshlmError(f"{n_stages} stages need at least {n_stages} layers; the model has {n}")
    if pp_split:
        starts = parse_split(pp_split, n_stages, n)
    else:
        first = _numel(*(getattr(dec, e) for e in p.embed))
        last = _numel(getattr(dec, p.norm), model.get_output_embeddings())
        starts = balanced_starts([_numel(layer) for layer in layers], n_stages, first, last)
    bounds = [0, *starts, n]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def parse_split(pp_split: str, n_stages: int, n_layers: int) -> list[int]:
    """--parallel.pp-split "4,8,12" -> [4, 8, 12], checked against the stage and layer counts."""
    try:
        starts = [int(s) for s in pp_split.split(",")]
    except ValueError:
        raise MeshlmError(f"--parallel.pp-split must be comma-separated layer indices, got {pp_split!r}") from None
    if len(starts) != n_stages - 1 or starts != sorted(set(starts)) or not all(0 < s < n_layers for s in starts):
        count = "1 layer index" if n_stages == 2 else f"{n_stages - 1} increasing layer indices"
        raise MeshlmError(
            f"--parallel.pp-split needs {count} between 1 and {n_layers - 1} "
            f"(the first layer of each stage after the first), got {pp_split!r}"
        )
    return starts


def balanced_starts(costs: list[int], n_stages: int, first: int, last: int) -> list[int]:
    """Contiguous split of `costs` into n_stages non-empty runs: the smallest possible largest run, and
    among splits that reach it the most even one (least sum of squares). Two exact DPs over the layers."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(a, b, s):
        return prefix[b] - prefix[a] + (first if s == 0 else 0) + (last if s == n_stages - 1 else 0)

    def solve(score, combine, limit=float("inf")):
        @cache
        def best(s, a):  # stages s.. over layers a..: (score, starts of stages s+1..)
            if s == n_stages - 1:
                c = cost(a, n, s)
                return (score(c), ()) if c <= limit else (float("inf"), ())
            options = [
                (combine(score(cost(a, b, s)), best(s + 1, b)[0]), (b, *best(s + 1, b)[1]))
                for b in range(a + 1, n - (n_stages - 2 - s))
                if cost(a, b, s) <= limit
            ]
            return min(options, default=(float("inf"), ()))

        return best(0, 0)

    largest, _ = solve(lambda c: c, max)
    return list(solve(lambda c: c * c, lambda x, y: x + y, limit=largest)[1])


def build_stages(model: nn.Module, n_stages: int, pp_split: str = "") -> list[Stage]:
    """All stages of `model` (the model itself is left whole)."""
    p = pipeline_parts(model.config, "pipeline parallel")
    runs = stage_layers(model, n_stages, pp_split)
    return [Stage(model, p, i, run, last=i == n_stages - 1) for i, run in enumerate(runs)]


def keep_only(model: nn.Module, stages: list[Stage]) -> nn.Module:
    """Drop the parts of `model` that no local stage uses. Names stay those of the whole model (blocks are
    kept in a ModuleDict under their original index), so checkpoints from any layout line up."""
    p = stages[0].family
    dec = decoder(model)
    head = head_name(model)
    layers = getattr(dec, p.layers)
    setattr(dec, p.layers, nn.ModuleDict({str(i): layers[i] for s in stages for i in s.layer_ids}))
    keep_embed = any(s.is_first for s in stages)
    for name in p.embed:
        if not keep_embed and not (name == p.embed[0] and any(s.tied_embed is not None for s in stages)):
            setattr(dec, name, None)
    if not any(s.is_last for s in stages):
        setattr(dec, p.norm, None)
        if head:
            setattr(model, head, None)
    return model
