"""--grpo.reward's functions (objectives/grpo_rewards.py): the built-ins, TRL's signature, and each way a user's
function can fail as one line naming it and the record."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from meshlm.errors import MeshlmError
from meshlm.objectives.grpo_rewards import Reward, exact_match, format_check, rewards_of, score

WHERE = ["p.jsonl record 3", "p.jsonl record 3"]


def _cfg(reward: str, weights: str = "") -> SimpleNamespace:
    return SimpleNamespace(grpo=SimpleNamespace(reward=reward, reward_weights=weights))


def test_builtins():
    assert exact_match(["q", "q"], [" 42\n", "41"], answer=["42", "42"]) == [1.0, 0.0]
    assert format_check(["q"] * 3, ["ok", "two\nlines", "cut"], terminated=[True, True, False]) == [1.0, 0.0, 0.0]


def test_names_weights_and_imports(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def good(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"
        "def positional(prompts, completions):\n    return []\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    got = rewards_of(_cfg("exact_match, my_rewards:good", "1,0.5"))
    assert [(r.name, r.weight) for r in got] == [("exact_match", 1.0), ("my_rewards:good", 0.5)]
    for spec, weights, line in [
        ("my_rewards:positional", "", "must accept (prompts, completions, **kwargs)"),
        ("my_rewards:missing", "", "cannot be imported: AttributeError"),
        ("nowhere_module:f", "", "cannot be imported: ModuleNotFoundError"),
        ("nonsense", "", "use a built-in (exact_match, format) or MODULE:FUNCTION"),
        ("exact_match", "1,2", "one finite weight per --grpo.reward function (1)"),
        ("exact_match", "x", "comma-separated numbers"),
        ("", "", "--grpo.reward is empty"),
    ]:
        with pytest.raises(MeshlmError) as e:
            rewards_of(_cfg(spec, weights))
        assert line in str(e.value), (spec, str(e.value))


@pytest.mark.parametrize(
    "fn,line",
    [
        (
            lambda prompts, completions, **kw: 1 / 0,
            "raised ZeroDivisionError: division by zero (scoring p.jsonl record",
        ),
        (lambda prompts, completions, **kw: [1.0], "returned 1 rewards for 2 completions (scoring p.jsonl record 3)"),
        (lambda prompts, completions, **kw: 3.0, "returned float rewards for 2 completions"),
        (lambda prompts, completions, **kw: [1.0, math.inf], "returned inf for p.jsonl record 3"),
        (lambda prompts, completions, **kw: [1.0, "high"], "returned 'high' for p.jsonl record 3"),
    ],
)
def test_a_failing_reward_is_one_line(fn, line):
    values, error = score(Reward("mod:f", fn, 1.0), ["p", "p"], ["a", "b"], {}, WHERE)
    assert values is None and error.startswith("--grpo.reward mod:f ") and line in error, error


def test_none_is_nan_and_columns_reach_the_function():
    seen = {}

    def fn(prompts, completions, answer, **kw):
        seen.update(answer=answer, **kw)
        return [None, 2]

    values, error = score(Reward("f", fn, 1.0), ["p", "p"], ["a", "b"], {"answer": ["x", "y"], "k": [1, 2]}, WHERE)
    assert error is None and math.isnan(values[0]) and values[1] == 2.0
    assert seen == {"answer": ["x", "y"], "k": [1, 2]}
