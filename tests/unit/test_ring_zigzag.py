"""Ring attention's zig-zag split in this process: rank r holds chunks r and 2C-1-r of 2C, the whole sequence is
put back in order, and each rank's queries attending block by block to every rank's keys (parallel/ring.py, the
blocks met here without communication) give the rows of one attention over the whole sequence, with packed
documents (one crossing every cp boundary) and a sliding window, forward and backward."""

from __future__ import annotations

import pytest
import torch

from meshlm.parallel.context import SequenceSplit
from meshlm.parallel.ring import RingShape, _grad_block, _merge_block


def test_zigzag_split_and_whole():
    t = torch.arange(16).reshape(1, 16)
    split = [SequenceSplit(None, r, 4, zigzag=True) for r in range(4)]
    assert split[0].local(t).tolist() == [[0, 1, 14, 15]] and split[3].local(t).tolist() == [[6, 7, 8, 9]]
    assert torch.equal(split[0].whole([s.local(t) for s in split]), t)
    shape = RingShape(None, 1, 4, torch.zeros(1, 16, dtype=torch.long), None, 1.0, None, zigzag=True)
    assert [shape.index(1, i) for i in range(4)] == split[1].local(t)[0].tolist() == shape.indices(1, 0, 4).tolist()


def _reference(q, k, v, documents, window):
    """One attention over the whole sequence: q [B, H, S, D], k and v [B, H, S, D]."""
    s = q.shape[2]
    i = torch.arange(s)
    ok = (i[None, :] <= i[:, None]) & (documents[:, :, None] == documents[:, None, :])[:, None]
    if window:
        ok = ok & (i[None, :] > i[:, None] - window)
    return torch.softmax((q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~ok, float("-inf")), -1) @ v


@pytest.mark.parametrize("zigzag", [True, False])
@pytest.mark.parametrize("window", [None, 5])
def test_ring_blocks_equal_whole_attention(zigzag, window):
    torch.manual_seed(0)
    b, h, s, d, c = 2, 2, 48, 8, 4
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    documents = torch.tensor([[0] * 20 + [1] * 28, [0] * 5 + [1] * 40 + [2] * 3])  # crossing every boundary
    want = _reference(q, k, v, documents, window)
    grad = torch.randn_like(want)
    want.backward(grad)
    splits = [SequenceSplit(None, r, c, zigzag) for r in range(c)]
    local = [[sp.local(t.detach().transpose(1, 2)).transpose(1, 2).unsqueeze(2) for t in (q, k, v)] for sp in splits]
    outs, dqs = [], []
    dks, dvs = ([torch.zeros_like(local[r][1]) for r in range(c)] for _ in range(2))
    for r in range(c):
        shape = RingShape(None, r, c, documents, window, d**-0.5, None, zigzag)
        ql = local[r][0]
        out, lse = torch.zeros_like(ql), torch.full(ql.shape[:-1], float("-inf"), dtype=ql.dtype)
        for src in range(c):
            _merge_block(shape, ql, local[src][1], local[src][2], out, lse, src)
        g = splits[r].local(grad.transpose(1, 2)).transpose(1, 2).unsqueeze(2)
        dq = torch.zeros_like(ql)
        for src in range(c):
            _grad_block(shape, (ql, out, lse, g), local[src][1], local[src][2], dq, dks[src], dvs[src], src)
        outs.append(out.squeeze(2).transpose(1, 2))
        dqs.append(dq.squeeze(2).transpose(1, 2))
    whole = splits[0].whole(outs).transpose(1, 2)
    assert (whole - want).abs().max() <= 1e-5
    assert (splits[0].whole(dqs).transpose(1, 2) - q.grad).abs().max() <= 1e-5
    for got, want_grad in ((dks, k.grad), (dvs, v.grad)):
        whole_grad = splits[0].whole([x.squeeze(2).transpose(1, 2) for x in got]).transpose(1, 2)
        assert (whole_grad - want_grad).abs().max() <= 1e-5
