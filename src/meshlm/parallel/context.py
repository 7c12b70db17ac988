"""Context parallel (--parallel.cp C): every sequence split over the C ranks of the cp mesh dimension.

Each rank holds C-th of the tokens of every sequence (consecutive: rank r has tokens [r S/C, (r+1) S/C); zig-zag
chunks under ring, below),
so embeddings, norms, MLPs, the LM head and the loss run on S/C tokens and their activations shrink C
times. Position ids are those of the whole sequence (the data's, restarting at each packed document), so
rotary embeddings are unchanged. Only attention needs the other ranks' tokens; one of two schemes,
both exact, brings them (`scheme_for` picks):

  ulysses    (DeepSpeed Ulysses) an all-to-all turns this rank's [S/C tokens, H heads] of q, k and v
             into [S tokens, H/C heads]; any attention kernel then runs on whole sequences, and a second
             all-to-all brings the output back to [S/C tokens, H heads]. Needs the heads (and key/value
             heads) of a tensor-parallel rank to divide by C. Moves 4 x activations / C per rank and layer.
  ring       (parallel/ring.py) where the heads do not divide by C: the k/v blocks travel around the cp
             ranks, each rank attending with its own queries to one block at a time and merging the
             partial outputs exactly by their log-sum-exp; backward sends the blocks round again with
             their gradients. A rank holds at most two blocks of k and v: any head count.
  allgather  (chosen explicitly) k and v are all-gathered over the cp ranks (their gradients
             reduce-scattered back) and each rank attends with its own queries to the whole sequence with
             the model's kernel: a rank holds the whole k and v of every layer until its backward.
Causal work is uneven over consecutive tokens (the last rank's queries see the most keys), so ring's ranks hold
zig-zag halves instead (`zigzag`, as torchtitan and ring-flash-attn): the sequence is cut into 2C chunks and rank
r holds chunks r and 2C-1-r, an early and a late one, so every rank does the same causal work. ulysses and
allgather keep consecutive tokens: their kernels see the whole sequence in rank order (allgather stays uneven).

Masks: the model is switched to the attention function registered here, for which transformers' own
mask creation makes no mask. The mask each rank needs (the whole sequence's for ulysses, its query rows'
for allgather) is made here with transformers' mask functions for the kernel that does the local work
(sdpa: boolean or None for plain causal; eager: additive; flex: a BlockMask), from the position ids of the
whole sequence, gathered once per forward. So packed documents keep their block-diagonal masks across
the split, a document crossing a cp boundary included, and sliding windows count per-document positions,
exactly as on one rank. Kernels that take no mask but position ids (flash/varlen) get the whole
sequence's under ulysses.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshlm.compat_transformers import (
    ALL_ATTENTION_FUNCTIONS,
    ALL_MASK_ATTENTION_FUNCTIONS,
    causal_mask_function,
    find_packed_sequence_indices,
    packed_sequence_compatibility_function,
    sliding_window_causal_mask_function,
)
from meshlm.errors import MeshlmError
from meshlm.models.attention import MASKED
from meshlm.parallel.ring import RingAttention, RingShape

CP_ATTENTION = "meshlm_cp"  # the attention implementation name a cp model runs under
MASKED_KERNELS = ("sdpa", "eager", "flex_attention", MASKED)  # take a mask: allgather needs one; ring its own


def scheme_for(choice: str, heads: int, kv_heads: int, cp: int) -> str:
    """ulysses where the heads of one tensor-parallel rank split over the cp ranks, else ring."""
    if choice != "auto":
        return choice
    return "ulysses" if heads % cp == 0 and kv_heads % cp == 0 else "ring"


def zigzag(scheme: str) -> bool:
    """Whether the cp ranks hold zig-zag halves of each sequence (module docstring): ring's causal work is then
    even over the ranks; the other schemes need consecutive tokens."""
    return scheme == "ring"


def check_context(cfg, model_config, tp: int) -> str:
    """The scheme `--parallel.cp` runs for this model, or a one-line error for what it cannot split (called by
    layout.resolve, before any rank starts)."""
    from meshlm.models.families import attention, supports_attention_interface

    cp = cfg.parallel.cp
    if not supports_attention_interface(model_config):
        raise MeshlmError(
            f"--parallel.cp needs a model whose attention runs through transformers' attention interface; "
            f"model family {model_config.model_type!r} does not: train it without --parallel.cp"
        )
    scheme = scheme_checked(cp, cfg.parallel.cp_attention, model_config, tp, attention(model_config))
    pieces = 2 * cp if zigzag(scheme) else cp
    if cfg.seq_length % pieces:
        how = f"into {pieces} zig-zag chunks (attention by {scheme})" if zigzag(scheme) else f"over {cp} ranks"
        raise MeshlmError(
            f"--parallel.cp {cp} splits each sequence {how}; --seq-length {cfg.seq_length} is not a "
            f"multiple of {pieces}"
        )
    return scheme


def scheme_checked(cp: int, choice: str, model_config, tp: int, kernel: str) -> str:
    """The scheme for `cp` ranks (choice: auto, ulysses, allgather), checked against the heads a
    tensor-parallel rank holds and the attention kernel."""
    heads = model_config.num_attention_heads // tp
    kv = (getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads) // tp
    scheme = scheme_for(choice, heads, kv, cp)
    if scheme == "ulysses" and (heads % cp or kv % cp):
        raise MeshlmError(
            f"--parallel.cp-attention ulysses splits the heads over cp = {cp} ranks; a tensor-parallel rank has "
            f"{heads} heads and {kv} key/value heads: pick a cp dividing both, or --parallel.cp-attention ring"
        )
    if scheme == "allgather" and kernel not in MASKED_KERNELS:
        raise MeshlmError(
            f"--parallel.cp-attention allgather needs an attention kernel that takes a mask "
            f"({', '.join(MASKED_KERNELS)}), not {kernel}; use --parallel.cp-attention ring"
        )
    return scheme


# ------------------------------------------------------------------ collectives with their gradients


class _AllToAll(torch.autograd.Function):
    """Dim-0 chunk j of x goes to rank j of the group; chunk i of the result came from rank i. The exchange
    is its own transpose, so the gradient goes back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.group), None


class _GatherSequence(torch.autograd.Function):
    """[B, H, S/C, D] -> [B, H, S, D] in rank order; backward adds every rank's gradient of this rank's part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        parts = [p.contiguous() for p in grad.chunk(dist.get_world_size(ctx.group), dim=2)]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=ctx.group)
        return out, None


def heads_to_sequence(x: torch.Tensor, group, c: int) -> torch.Tensor:
    """[B, H, S/C, D] on each rank -> [B, H/C, S, D]: rank j gets heads j H/C .. of every rank's tokens."""
    b, h, s, d = x.shape
    y = _AllToAll.apply(x.reshape(b, c, h // c, s, d).transpose(0, 1), group)  # [C = token slice, B, H/C, S/C, D]
    return y.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * s, d)


def sequence_to_heads(x: torch.Tensor, group, c: int) -> torch.Tensor:
    """The inverse for an attention output in transformers' layout: [B, S, H/C, D] -> [B, S/C, H, D]."""
    b, n, h, d = x.shape
    y = _AllToAll.apply(x.reshape(b, c, n // c, h, d).transpose(0, 1), group)  # [C = head group, B, S/C, H/C, D]
    return y.permute(1, 2, 0, 3, 4).reshape(b, n // c, c * h, d)


# ------------------------------------------------------------------ the attention function


class ContextGroup:
    """What the attention modules of one cp model share: the group, the scheme, the kernel doing the local
    work, and this forward's whole-sequence position ids and masks (made once, reused by every layer)."""

    def __init__(self, group, scheme: str, kernel: str, config):
        self.group, self.scheme, self.kernel, self.config = group, scheme, kernel, config
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.split = SequenceSplit(group, self.rank, self.size, zigzag(scheme))  # which tokens this rank holds
        self._forward: tuple | None = None  # (local position ids, whole position ids, masks by window)

    def whole(self, local: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The whole sequence's position ids and this forward's mask cache. A forward passes the same
        position-id tensor to every layer (and to a checkpointed layer's recomputation), so it keys the cache."""
        if self._forward is None or self._forward[0] is not local:
            parts = [torch.empty_like(local) for _ in range(self.size)]
            dist.all_gather(parts, local.contiguous(), group=self.group)
            self._forward = (local, self.split.whole(parts), {})
        return self._forward[1], self._forward[2]

    def mask(self, positions: torch.Tensor, masks: dict, window: int | None, q_len: int, dtype: torch.dtype):
        """The kernel's mask for queries [q_offset, q_offset + q_len) of the whole sequence (this rank's rows
        under allgather, all of them under ulysses) against all its keys."""
        if window not in masks:
            make = ALL_MASK_ATTENTION_FUNCTIONS[self.kernel] if self.kernel in ALL_MASK_ATTENTION_FUNCTIONS else None
            fn = sliding_window_causal_mask_function(window) if window else causal_mask_function
            packed = find_packed_sequence_indices(positions)
            if packed is not None:  # documents of a packed block: as transformers' create_causal_mask does
                fn = packed_sequence_compatibility_function(fn, positions, packed)
            b, n = positions.shape
            masks[window] = make and make(
                batch_size=b,
                q_length=q_len,
                kv_length=n,
                q_offset=0 if q_len == n else self.rank * q_len,
                kv_offset=0,
                mask_function=fn,
                attention_mask=None,
                allow_is_causal_skip=packed is None,
                local_size=window,
                dtype=dtype,
                config=self.config,
                use_vmap=False,
                device=positions.device,
            )
        return masks[window]


def _kernel(module, name: str):
    if name == "eager":  # each modeling file has its own eager attention
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def cp_attention(module, query, key, value, attention_mask, position_ids=None, **kwargs):
    """transformers' attention interface: q [B, H, S/C, D], k and v [B, KV, S/C, D] of this rank's tokens;
    returns this rank's tokens' output [B, S/C, H, D]. The model's own (None) mask is not used."""
    cp: ContextGroup = module.context_parallel
    if position_ids is None:
        raise RuntimeError("context parallel needs the position ids of each forward in the attention call")
    positions, masks = cp.whole(position_ids)
    window = kwargs.pop("sliding_window", None)
    kernel = _kernel(module, cp.kernel)
    if cp.scheme == "ulysses":
        q, k, v = (heads_to_sequence(t, cp.group, cp.size) for t in (query, key, value))
        mask = cp.mask(positions, masks, window, positions.shape[1], q.dtype)
        out, _ = kernel(module, q, k, v, mask, position_ids=positions, sliding_window=window, **kwargs)
        return sequence_to_heads(out, cp.group, cp.size), None
    if cp.scheme == "ring":
        return ring_attention(cp, query, key, value, positions, masks, window, kwargs), None
    k, v = _GatherSequence.apply(key, cp.group), _GatherSequence.apply(value, cp.group)
    mask = cp.mask(positions, masks, window, query.shape[2], query.dtype)
    return kernel(module, query, k, v, mask, position_ids=position_ids, sliding_window=window, **kwargs)


def ring_attention(cp: ContextGroup, query, key, value, positions, masks: dict, window, kwargs) -> torch.Tensor:
    """parallel/ring.py's attention in transformers' output layout [B, S/C, H, D]; the documents of the whole
    sequence are found once per forward."""
    if kwargs.get("dropout") or kwargs.get("s_aux") is not None:
        raise MeshlmError(
            "--parallel.cp-attention ring computes attention without dropout or attention sinks: train with "
            "--dropout-off true, or a cp dividing the heads (ulysses)"
        )
    if "documents" not in masks:
        packed = find_packed_sequence_indices(positions)
        masks["documents"] = torch.zeros_like(positions) if packed is None else packed
    scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
    softcap, zigzag = kwargs.get("softcap"), cp.split.zigzag
    shape = RingShape(cp.group, cp.rank, cp.size, masks["documents"], window, scale, softcap, zigzag)
    return RingAttention.apply(query, key, value, shape).transpose(1, 2)


ALL_ATTENTION_FUNCTIONS.register(CP_ATTENTION, cp_attention)


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that call the attention interface: those holding the model's attention projections."""
    return [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "config") and hasattr(m, "layer_idx")]


def apply_cp(model: torch.nn.Module, group, choice: str, tp: int = 1) -> str:
    """Make every attention of `model` (a whole model or a pipeline-pruned one) attend across `group`;
    returns the scheme. Parameters are untouched, so it goes anywhere after tensor parallel (which sets the
    heads a rank holds) and before the wrappers."""
    config = model.config
    kernel = config._attn_implementation
    scheme = scheme_checked(dist.get_world_size(group), choice, config, tp, kernel)
    cp = ContextGroup(group, scheme, kernel, config)
    modules = attention_modules(model)
    if not modules:
        raise MeshlmError(f"context parallel found no attention modules in {type(model).__name__}")
    for m in modules:
        m.context_parallel = cp
        # tensor parallel may have given a module a config of its own (per-rank head counts): it reads its
        # attention implementation from there
        for c in {id(config): config, id(m.config): m.config}.values():
            c._attn_implementation = CP_ATTENTION
    return scheme


@dataclass(frozen=True)
class SequenceSplit:
    """This rank's place in its cp group: which tokens of every sequence it computes, S/C consecutive ones in cp
    rank order, or under `zigzag` the chunks r and 2C-1-r of 2C (the module docstring)."""

    group: object
    rank: int
    size: int
    zigzag: bool = False

    @staticmethod
    def of(model: torch.nn.Module) -> SequenceSplit:
        """The split apply_cp chose for `model` (its scheme decides: `zigzag`)."""
        return next(m.context_parallel.split for m in attention_modules(model) if hasattr(m, "context_parallel"))

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of [B, S, ...]."""
        if not self.zigzag:
            return t.chunk(self.size, dim=1)[self.rank]
        chunks = t.chunk(2 * self.size, dim=1)
        return torch.cat([chunks[self.rank], chunks[2 * self.size - 1 - self.rank]], dim=1)

    def whole(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The whole [B, S, ...] from every rank's local part (in cp rank order)."""
        if not self.zigzag:
            return torch.cat(parts, dim=1)
        halves = [p.chunk(2, dim=1) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=1)
