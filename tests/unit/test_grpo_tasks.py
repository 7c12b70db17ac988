"""--grpo.tasks: the built-in corpus's prompts restricted to some of its tasks (objectives/grpo_data.py), each
prompt with its exact answer, in the Alpaca layout the supervised run learned."""

from __future__ import annotations

import dataclasses

import pytest

from meshlm.config import BUILTIN_TASKS, Config, GRPOConfig, validate
from meshlm.data.builtin import byte_tokenizer, corpus, task_of
from meshlm.data.records import format_prompt
from meshlm.errors import MeshlmError
from meshlm.objectives.grpo_data import load_prompts


def _cfg(tasks: str, **kw) -> Config:
    return Config(objective="grpo", builtin_samples=200, seq_length=160, grpo=GRPOConfig(tasks=tasks), **kw)


def test_every_builtin_record_has_a_named_task():
    assert {task_of(r) for r in corpus(300)} == set(BUILTIN_TASKS)


def test_prompts_of_the_chosen_tasks_only():
    cfg = _cfg("copy, reverse")
    records = [r for r in corpus(cfg.builtin_samples, cfg.seed) if task_of(r) in ("copy", "reverse")]
    got = load_prompts(cfg, byte_tokenizer())
    assert got.texts == [format_prompt(r) for r in records]  # as the supervised run formats them
    assert [c["answer"] for c in got.columns] == [r["output"] for r in records]
    assert len(load_prompts(_cfg(""), byte_tokenizer())) == cfg.builtin_samples


@pytest.mark.parametrize(
    "cfg,expect",
    [
        (_cfg("copy,add,nope"), "--grpo.tasks must be built-in task names"),
        (dataclasses.replace(_cfg("copy"), dataset_name="p.jsonl"), "read only with --objective grpo on the built-in"),
        (Config(grpo=GRPOConfig(tasks="copy")), "read only with --objective grpo on the built-in"),
    ],
)
def test_refused(cfg, expect):
    with pytest.raises(MeshlmError, match=expect):
        validate(cfg)
