"""Ring attention for context parallel (parallel/context.py's "ring" scheme): the head count need not divide by cp.

Each of the C ranks of the cp group holds S/C tokens' q, k and v: zig-zag (parallel/context.py SequenceSplit: chunks
r and 2C-1-r of 2C, so causal work is even over the ranks) or consecutive. The k/v blocks travel around the
ring (rank r sends to r + 1 and receives from r - 1, torch.distributed's batch_isend_irecv, the next block in
flight while this one is computed): after C steps every rank has attended with its own queries to every block,
and no rank ever holds more than two blocks of one layer. Each block gives a partial output and the
log-sum-exp of its scores per query; partials merge exactly (out = sum_i exp(lse_i - lse) out_i,
lse = logsumexp_i lse_i), as in torch's context_parallel and torchtitan.

Backward is the reverse pass of flash attention over the same ring: only the rank's own q, k, v, the merged output
and its log-sum-exp are saved; each block's scores are recomputed as the blocks go round a second time, and
each block's dk and dv travel with it, so they reach their owner after the C-th step.

Masks are made here, per (query tile, key block), from the whole sequence's document ids (packed documents: the
position ids restart) and token indices: causal, same document, and a sliding window counted in indices, the
rules of transformers' causal_mask_function, packed_sequence_compatibility_function and sliding_window_overlay.
Blocks a mask rules out entirely (the later ranks' under causality, the far ones under a window) are skipped, and
a tile of queries is scored only against the span of keys its mask reaches (causal, window, documents).
Scores are computed over tiles of query rows so the transient is ~TILE_ELEMENTS, not [B, H, S/C, S/C].
k and v travel in their own dtype; scores, outputs and gradients accumulate in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

TILE_ELEMENTS = 2**23  # fp32 scores per tile (32 MiB): a tile's transients stay a few of these


def _tiles(q: torch.Tensor, keys: int, zigzag: bool):
    """Query-row ranges [q0, q1) of q [B, KV, G, S/C, D] whose scores against `keys` keys hold ~TILE_ELEMENTS; under
    zig-zag none spans both of the rank's chunks (they are far apart in the sequence)."""
    b, kv, g, n, _ = q.shape
    rows = max(16, TILE_ELEMENTS // (b * kv * g * keys))
    runs = [(0, n // 2), (n // 2, n)] if zigzag else [(0, n)]
    return [(q0, min(q0 + rows, end)) for start, end in runs for q0 in range(start, end, rows)]


@dataclass(frozen=True)
class RingShape:
    """What one attention call shares with its backward: the group, this rank's place, the masks' inputs and the
    score's scale and soft cap (a tanh capping, None without)."""

    group: object
    rank: int
    size: int
    documents: torch.Tensor  # [B, S] document index of every token of the whole sequence
    window: int | None
    scale: float
    softcap: float | None
    zigzag: bool = False  # rank r holds chunks r and 2C-1-r of 2C (parallel/context.py SequenceSplit)

    def index(self, rank: int, i: int) -> int:
        """The position in the whole sequence of rank `rank`'s i-th token (increasing in i)."""
        n = self.documents.shape[1] // self.size
        if not self.zigzag:
            return rank * n + i
        half = n // 2
        return rank * half + i if i < half else (2 * self.size - 1 - rank) * half + i - half

    def indices(self, rank: int, a: int, b: int) -> torch.Tensor:
        """index(rank, i) for i in [a, b), a tensor on the documents' device."""
        i = torch.arange(a, b, device=self.documents.device)
        n = self.documents.shape[1] // self.size
        if not self.zigzag:
            return rank * n + i
        half = n // 2
        return torch.where(i < half, rank * half + i, (2 * self.size - 1 - rank) * half + i - half)

    def visible_tiles(self, q: torch.Tensor, keys: int, src: int):
        """The tiles of this rank's queries q that attend to any of block `src`'s `keys` keys, each as (q0, q1, ok,
        span): its rows and what `allowed` says of them (forward and backward walk the same tiles)."""
        for q0, q1 in _tiles(q, keys, self.zigzag):
            allowed = self.allowed(q0, q1, src)
            if allowed is not None:
                yield q0, q1, *allowed

    def allowed(self, q0: int, q1: int, src: int) -> tuple[torch.Tensor, slice] | None:
        """Which of block `src`'s keys this rank's query rows [q0, q1) attend to: the span of the block's keys
        that any of them does, and [B, 1, 1, q1 - q0, span] whether each does; None when none does."""
        n = self.documents.shape[1] // self.size
        if self.index(src, 0) > self.index(self.rank, q1 - 1):  # every key after every query: causal rules it out
            return None
        if self.window and self.index(self.rank, q0) - self.index(src, n - 1) >= self.window:  # all out of window
            return None
        qi, ki = self.indices(self.rank, q0, q1)[:, None], self.indices(src, 0, n)[None, :]
        ok = ki <= qi
        if self.window:
            ok = ok & (ki > qi - self.window)
        docs_q, docs_k = self.documents[:, qi[:, 0]], self.documents[:, ki[0]]
        ok = ok & (docs_q[:, :, None] == docs_k[:, None, :])
        cols = ok.any(dim=1).any(dim=0).nonzero()
        if not len(cols):
            return None
        span = slice(int(cols[0]), int(cols[-1]) + 1)  # causal blocks, windows and documents attend to a band
        return ok[:, None, None, :, span], span

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q [B, KV, G, T, D] x k [B, KV, 1, N, D] -> the scores [B, KV, G, T, N] and tanh(raw / cap) when capped."""
        s = q @ k.transpose(-1, -2) * self.scale
        if not self.softcap:
            return s, None
        capped = torch.tanh(s / self.softcap)
        return capped * self.softcap, capped


def _pass_on(tensors: list[torch.Tensor], shape: RingShape) -> tuple[list, list[torch.Tensor]]:
    """Send `tensors` to the next rank of the ring and receive as many from the previous one: (requests, buffers)."""
    nxt = dist.get_global_rank(shape.group, (shape.rank + 1) % shape.size)
    prev = dist.get_global_rank(shape.group, (shape.rank - 1) % shape.size)
    tensors = [t.contiguous() for t in tensors]
    bufs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, shape.group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, b, prev, shape.group) for b in bufs]
    return dist.batch_isend_irecv(ops), bufs


def _wait(requests: list) -> None:
    for r in requests:
        r.wait()


def _safe(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows that see nothing yet) as 0, so exp(-inf - lse) is 0 rather than NaN."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _merge_block(shape: RingShape, q, k, v, out, lse, src: int) -> None:
    """Attend this rank's queries q [B, KV, G, S/C, D] to block `src` (k, v [B, KV, 1, S/C, D]) and merge the
    partial output into out and lse (fp32, in place)."""
    k, v = k.float(), v.float()
    for q0, q1, ok, span in shape.visible_tiles(q, k.shape[3], src):
        s = shape.scores(q[:, :, :, q0:q1], k[:, :, :, span])[0].masked_fill(~ok, float("-inf"))
        part_lse = torch.logsumexp(s, dim=-1)
        part = torch.exp(s - _safe(part_lse)[..., None]) @ v[:, :, :, span]
        new = torch.logaddexp(lse[..., q0:q1], part_lse)
        keep, add = torch.exp(lse[..., q0:q1] - _safe(new)), torch.exp(part_lse - _safe(new))
        out[..., q0:q1, :] = out[..., q0:q1, :] * keep[..., None] + part * add[..., None]
        lse[..., q0:q1] = new


def _grad_block(shape: RingShape, saved, k, v, dq, dk, dv, src: int) -> None:
    """The gradients of block `src`'s attention: dq (this rank's) and the block's dk, dv (fp32, in place)."""
    q, out, lse, grad = saved
    k, v = k.float(), v.float()
    for q0, q1, ok, span in shape.visible_tiles(q, k.shape[3], src):
        tile = slice(q0, q1)
        s, capped = shape.scores(q[:, :, :, tile], k[:, :, :, span])
        p = torch.exp(s.masked_fill(~ok, float("-inf")) - lse[..., tile, None])
        g = grad[:, :, :, tile]
        dv[:, :, :, span] += (p.transpose(-1, -2) @ g).sum(2, keepdim=True)
        ds = p * (g @ v[:, :, :, span].transpose(-1, -2) - (g * out[:, :, :, tile]).sum(-1, keepdim=True))
        if capped is not None:
            ds = ds * (1 - capped * capped)
        dq[:, :, :, tile] += ds @ k[:, :, :, span] * shape.scale
        dk[:, :, :, span] += (ds.transpose(-1, -2) @ q[:, :, :, tile]).sum(2, keepdim=True) * shape.scale


class RingAttention(torch.autograd.Function):
    """q [B, H, S/C, D], k and v [B, KV, S/C, D] of this rank's tokens -> this rank's output [B, H, S/C, D]."""

    @staticmethod
    def forward(ctx, query, key, value, shape: RingShape):
        b, h, n, d = query.shape
        kv = key.shape[1]
        q = query.float().reshape(b, kv, h // kv, n, d)
        k, v = key.unsqueeze(2), value.unsqueeze(2)  # travel in their own dtype
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(shape.size):
            pending, nxt = _pass_on([k, v], shape) if step < shape.size - 1 else ([], [])
            _merge_block(shape, q, k, v, out, lse, (shape.rank - step) % shape.size)
            _wait(pending)
            if nxt:
                k, v = nxt
        ctx.shape, ctx.dtypes = shape, (query.dtype, key.dtype, value.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        return out.reshape(b, h, n, d).to(query.dtype)

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        shape: RingShape = ctx.shape
        b, h, n, d = query.shape
        q = query.float().reshape(out.shape)
        saved = (q, out, lse, grad.float().reshape(out.shape))
        k, v = key.unsqueeze(2), value.unsqueeze(2)
        dq = torch.zeros_like(q)
        dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        for step in range(shape.size):
            pending, nxt = _pass_on([k, v], shape) if step < shape.size - 1 else ([], [])
            _grad_block(shape, saved, k, v, dq, dk, dv, (shape.rank - step) % shape.size)
            moved, (dk, dv) = _pass_on([dk, dv], shape)  # block's gradients go on with it; the last step home
            _wait(pending + moved)
            if nxt:
                k, v = nxt
        dtypes = ctx.dtypes
        return dq.reshape(b, h, n, d).to(dtypes[0]), dk.squeeze(2).to(dtypes[1]), dv.squeeze(2).to(dtypes[2]), None
