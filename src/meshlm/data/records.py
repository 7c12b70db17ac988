"""Records -> documents: token ids and which of them are learned.

Four shapes, told apart by their fields:
- Alpaca: `instruction`, optional `input`, `output` (formatted with the Alpaca prompt, as `generate` does);
- prompt/completion: `prompt`, `completion`;
- chat: `messages`, a list of {role, content}, formatted with the tokenizer's own chat template;
- plain text: `text`.
A document starts with the tokens the tokenizer itself adds (BOS for Llama, nothing for GPT-2: the same
call `meshlm generate` makes) and ends with EOS. With loss-on "response" only the response (and its EOS),
or the assistant turns, are learned; plain text always learns every token.
"""

from __future__ import annotations

from meshlm.errors import MeshlmError

PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
SHAPES = "Alpaca 'instruction'/'output' (optional 'input'), 'prompt'/'completion', chat 'messages', or 'text'"
ROLES = ("system", "user", "assistant", "tool")


def format_prompt(rec: dict) -> str:
    """The Alpaca prompt, without the response: what generation is given."""
    if rec.get("input"):
        return PROMPT_WITH_INPUT.format(instruction=rec["instruction"], input=rec["input"])
    return PROMPT.format(instruction=rec["instruction"])


def shape_of(rec, where: str) -> str:
    if not isinstance(rec, dict):
        raise MeshlmError(f"{where}: expected a JSON object per record, got {type(rec).__name__}")
    if "instruction" in rec and "output" in rec:
        return "alpaca"
    if "prompt" in rec and "completion" in rec:
        return "prompt"
    if "messages" in rec:
        return "chat"
    if "text" in rec:
        return "text"
    raise MeshlmError(f"{where}: a record of unknown shape: found fields {sorted(rec)[:8]}; expected {SHAPES}")


def encode(rec: dict, tokenizer, loss_on: str, where: str) -> tuple[list[int], list[bool]]:
    """(token ids, learned?) of one record."""
    shape = shape_of(rec, where)
    if shape == "chat":
        ids, learned = _chat(rec["messages"], tokenizer, where)
    elif shape == "text":
        ids = _with_eos(tokenizer(_text(rec, "text", where))["input_ids"], tokenizer)
        return ids, [True] * len(ids)
    else:
        alpaca = shape == "alpaca"
        if alpaca:
            _text(rec, "instruction", where)
            if rec.get("input") is not None:  # a null input is no input, as an empty one is
                _text(rec, "input", where)
        prompt = format_prompt(rec) if alpaca else _text(rec, "prompt", where)
        response = _text(rec, "output" if alpaca else "completion", where)
        head = tokenizer(prompt)["input_ids"]
        tail = _with_eos(tokenizer(response, add_special_tokens=False)["input_ids"], tokenizer)
        ids, learned = head + tail, [False] * len(head) + [True] * len(tail)
    return ids, [True] * len(ids) if loss_on == "all" else learned


def _text(rec: dict, key: str, where: str) -> str:
    """A record's text field as a string: a number is its digits; null, a list or an object is refused, since
    str() of them would train on the text "None" or a Python repr."""
    value = rec[key]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        found = "null" if value is None else type(value).__name__
        raise MeshlmError(f"{where}: field {key!r} is {found}, not text; give it a string or drop the record")
    return str(value)


def _with_eos(ids: list[int], tokenizer) -> list[int]:
    eos = tokenizer.eos_token_id
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def _chat(messages, tokenizer, where: str) -> tuple[list[int], list[bool]]:
    """The template applied to ever longer prefixes of the conversation: the tokens each message adds are
    learned when it is an assistant turn. Works with any template whose rendering of a prefix is a prefix."""
    if not getattr(tokenizer, "chat_template", None):
        raise MeshlmError(
            f"{where}: chat records need a tokenizer with a chat template; this one has none "
            f"(use --tokenizer-name with an instruct model's tokenizer, or Alpaca/prompt records)"
        )
    if not isinstance(messages, list) or not messages:
        raise MeshlmError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    ids: list[int] = []
    learned: list[bool] = []
    for k, msg in enumerate(messages, 1):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ROLES:
            raise MeshlmError(f"{where}: message {k} has role {role!r}; expected one of {', '.join(ROLES)}")
        upto = tokenizer.apply_chat_template(messages[:k], tokenize=True, return_dict=True)["input_ids"]
        if upto[: len(ids)] != ids:
            raise MeshlmError(
                f"{where}: this tokenizer's chat template renders a conversation's prefix differently "
                f"from the whole; its assistant turns cannot be located"
            )
        learned += [role == "assistant"] * (len(upto) - len(ids))
        ids = list(upto)
    return ids, learned
