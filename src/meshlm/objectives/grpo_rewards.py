"""--grpo.reward: the functions that score completions, with TRL's signature
`f(prompts, completions, **columns) -> list[float | None]` (columns: the prompt records' other fields, one value per
completion, and `completion_ids`). Built in: `exact_match` (1 when the completion, stripped, is the record's
`answer`) and `format` (1 for one non-empty line that ended with EOS); any other is MODULE:FUNCTION, imported once.

Each rank scores its own completions, outside any collective: an error becomes a line (naming the function and the
record) that the caller makes every rank raise at the same point (runtime.agree_on_error), so none of them hangs.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
from dataclasses import dataclass

from meshlm.errors import MeshlmError


def exact_match(prompts, completions, answer=None, **_) -> list[float]:
    """1.0 where the completion, stripped, equals the record's answer, stripped."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


def format_check(prompts, completions, terminated=None, **_) -> list[float]:
    """1.0 for a completion that ended with EOS (not cut at --grpo.max-new-tokens) and is one non-empty line."""
    ended = terminated if terminated is not None else [True] * len(completions)
    return [float(bool(c.strip()) and "\n" not in c.strip() and e) for c, e in zip(completions, ended)]


BUILTIN = {"exact_match": exact_match, "format": format_check}
NEEDS = {"exact_match": "answer"}  # the record field a built-in reads


@dataclass
class Reward:
    name: str  # as given: a built-in name or MODULE:FUNCTION
    fn: object
    weight: float


def _import(spec: str):
    """MODULE:FUNCTION, imported from the working directory too (where a user's reward file usually is)."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise MeshlmError(f"--grpo.reward {spec}: use a built-in ({', '.join(BUILTIN)}) or MODULE:FUNCTION")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        fn = getattr(importlib.import_module(module), attr)
    except Exception as e:  # any failure to import is the user's to fix: one line
        raise MeshlmError(f"--grpo.reward {spec} cannot be imported: {type(e).__name__}: {e}") from None
    _check_signature(spec, fn)
    return fn


def _check_signature(spec: str, fn) -> None:
    """TRL's signature: prompts and completions by keyword, and the columns as **kwargs."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        raise MeshlmError(f"--grpo.reward {spec} is not a function") from None
    names = {p.name for p in params}
    if not any(p.kind is p.VAR_KEYWORD for p in params) or not {"prompts", "completions"} <= names:
        raise MeshlmError(
            f"--grpo.reward {spec} must accept (prompts, completions, **kwargs) (TRL's signature), "
            f"not {fn.__name__}{inspect.signature(fn)}"
        )


def rewards_of(cfg) -> list[Reward]:
    """The functions and weights of --grpo.reward / --grpo.reward-weights, checked (names, imports, signatures)."""
    names = [n.strip() for n in cfg.grpo.reward.split(",") if n.strip()]
    if not names:
        raise MeshlmError("--grpo.reward is empty: name one or more reward functions (e.g. exact_match)")
    weights = [1.0] * len(names)
    if cfg.grpo.reward_weights.strip():
        try:
            weights = [float(w) for w in cfg.grpo.reward_weights.split(",")]
        except ValueError:
            raise MeshlmError(f"--grpo.reward-weights {cfg.grpo.reward_weights}: comma-separated numbers") from None
        if len(weights) != len(names) or not all(math.isfinite(w) for w in weights):
            raise MeshlmError(
                f"--grpo.reward-weights {cfg.grpo.reward_weights}: one finite weight per --grpo.reward function "
                f"({len(names)})"
            )
    return [Reward(n, BUILTIN[n] if n in BUILTIN else _import(n), w) for n, w in zip(names, weights)]


def score(reward: Reward, prompts: list[str], completions: list[str], columns: dict, where: list[str]):
    """(the function's rewards, one float per completion (NaN for None), or None; the error line, or None)."""
    try:
        out = reward.fn(prompts=prompts, completions=completions, **columns)
    except Exception as e:  # the user's function: its failure is one line naming it and the records
        return None, f"--grpo.reward {reward.name} raised {type(e).__name__}: {e} (scoring {where[0]})"
    try:
        values = list(out)
    except TypeError:
        values = None
    if values is None or len(values) != len(completions):
        got = len(values) if values is not None else type(out).__name__
        return None, (
            f"--grpo.reward {reward.name} returned {got} rewards for {len(completions)} completions "
            f"(scoring {where[0]}); return one float or None per completion"
        )
    floats = []
    for value, w in zip(values, where):
        if value is None:
            floats.append(math.nan)
            continue
        try:
            f = float(value)
        except (TypeError, ValueError):
            f = math.nan
        if not math.isfinite(f):
            return None, f"--grpo.reward {reward.name} returned {value!r} for {w}; return a finite float or None"
        floats.append(f)
    return floats, None
