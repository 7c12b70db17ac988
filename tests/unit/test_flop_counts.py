"""metrics: `mfu` counts the attention scores each packed document needs (n(n+1)/2 per document), `mfu_dense`
PaLM's every-token-against-every-key figure."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from meshlm.data.batch import Batch
from meshlm.train.metrics import LogWindow, document_scores, train_flops


def _positions(*rows: list[int]) -> torch.Tensor:
    return torch.tensor([[i for n in row for i in range(n)] for row in rows])


def test_document_scores():
    assert document_scores(_positions([8])) == 36  # one document of 8: causal, 8 * 9 / 2
    assert document_scores(_positions([3, 1, 4], [8])) == 6 + 1 + 10 + 36
    assert document_scores(_positions([1, 1, 1, 1])) == 4  # documents of one token see only themselves
    cont = torch.tensor([[5, 6, 7, 0, 1, 2, 3, 4]])  # a document's second piece (positions go on), then one of 5
    assert document_scores(cont) == 6 + 15


def test_mfu_counts_required_scores_and_mfu_dense_palm(monkeypatch):
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2)
    flops = train_flops(cfg, num_params=1000, embedding_params=200, seq_length=8)
    assert flops.weights_per_token == 6 * 800 and flops.per_score == 12 * 2 * 64
    assert flops.dense_per_token == 6 * 800 + 12 * 2 * 64 * 8
    window = LogWindow(torch.device("cpu"), 16, flops, peak=1e9, world=1)
    positions = _positions([3, 1, 4], [8])
    window.add(torch.tensor(1.0), [Batch(positions, positions, positions)])
    row = window.row(1, 1.0, 1e-3, 1.0, {})
    required = 6 * 800 + 12 * 2 * 64 * (6 + 1 + 10 + 36) / 16
    assert row["mfu"] / row["mfu_dense"] == pytest.approx(required / flops.dense_per_token)
    assert row["mfu"] < row["mfu_dense"]


def test_mfu_counts_the_head_only_for_positions_with_a_target():
    """An untied LM head's 6 x params per token count in `mfu` for the positions with a target (the others need no
    logits: parallel/loss.py skips them); `mfu_dense` counts every token."""
    from meshlm.data.batch import IGNORE

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2)
    flops = train_flops(cfg, num_params=1000, embedding_params=200, seq_length=8, head_params=300)
    assert flops.head_per_token == 6 * 300 and flops.weights_per_token == 6 * 800
    window = LogWindow(torch.device("cpu"), 8, flops, peak=1e9, world=1)
    positions = _positions([8])
    labels = torch.tensor([[IGNORE, IGNORE, IGNORE, IGNORE, 5, 6, 7, 8]])  # a prompt of 4, then 4 targets
    window.add(torch.tensor(1.0), [Batch(positions, labels, positions)])
    row = window.row(1, 1.0, 1e-3, 1.0, {})
    required = 6 * 800 - 6 * 300 * (1 - 4 / 8) + 12 * 2 * 64 * 36 / 8
    assert row["mfu"] / row["mfu_dense"] == pytest.approx(required / flops.dense_per_token)
