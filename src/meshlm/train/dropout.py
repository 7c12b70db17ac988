"""`--dropout-off`: every dropout probability of the model set to 0.

Layouts draw dropout masks differently (another shard, another order of random draws), so two layouts of
a model with dropout (GPT-2 ships 0.1) cannot agree step for step. `meshlm verify` compares with dropout
off; training keeps the model's dropout unless asked.
"""

from __future__ import annotations

from torch import nn

# Attributes transformers' attention modules read as a probability at call time (sdpa's dropout_p).
_PROBABILITIES = ("attention_dropout", "dropout", "attn_dropout_p")


def dropout_off(model: nn.Module) -> int:
    """Set every nn.Dropout's p and every attention module's dropout probability to 0; returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p, n = 0.0, n + 1
        for name in _PROBABILITIES:
            if isinstance(getattr(m, name, None), float) and getattr(m, name):
                setattr(m, name, 0.0)
                n += 1
    return n
