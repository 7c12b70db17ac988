"""The family coverage table in docs/families.md: every causal-LM family of the installed transformers that has
a TP or PP plan (or a meshlm override), built tiny and random from its own config class, trained 3 steps in
one process and under zero3 2, tp 2 and pp 2 (1F1B), each compared with one process as `meshlm verify`
compares (max relative loss difference, 1e-4); and transformers' own tensor parallel (`tp_plan="auto"`)
against its one-process logits, so the table says where transformers runs a family that meshlm does not.

    python benchmarks/families.py                 # every family: about an hour on 2 CPU cores
    python benchmarks/families.py --only qwen3,phi3 --print
    python benchmarks/families.py --sp                # tp 2 with sequence parallel where the table's tp 2 is ok

A failure is a row that says why (the first line of the error), never a missing row. Runs go through
tests/helpers/family_runs.py: one launch per world size for a chunk of families; a launch that dies (a rank
crashed, a collective timed out) is run again one family per launch, so one family cannot hide another's row.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
import tempfile
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test suite's launcher of many runs per job, shared with this table
from helpers.family_runs import broken, launch  # noqa: E402

DOC = ROOT / "docs" / "families.md"
BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"
SMALL = dict(  # set where a config class has the field; everything else keeps the class's default
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    head_dim=16,
    qk_rope_head_dim=16,  # multi-head latent attention (DeepSeek-V2/V3 and kin): head sizes that agree
    qk_nope_head_dim=16,
    v_head_dim=16,
    kv_lora_rank=32,
    q_lora_rank=32,
    first_k_dense_replace=1,  # DeepSeek-V3 and kin: block 0 dense, block 1 experts (by default 3: both dense)
    n_group=1,  # routing groups of experts (DeepSeek): one group of the 4 experts
    topk_group=1,
    vocab_size=320,
    max_position_embeddings=128,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    initializer_range=0.2,
    attention_dropout=0.0,  # dropout draws differ between layouts: off, as in every parity run (Seed-OSS: 0.1)
    residual_dropout=0.0,
    hidden_dropout=0.0,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    pad_token_id=256,
    bos_token_id=None,
    eos_token_id=None,
)
LAYOUTS = {
    "zero3": ["--strategy", "zero3", "--micro-batch-size", "4"],
    "tp 2": ["--parallel.tp", "2", "--micro-batch-size", "8"],
    "pp 2": ["--parallel.pp", "2", "--parallel.schedule", "1f1b", "--micro-batch-size", "8"],
}
SP = ["--parallel.tp", "2", "--parallel.sequence-parallel", "true", "--micro-batch-size", "8"]
IDS = [[(7 * i + 3 * row) % 250 + 3 for i in range(16)] for row in range(2)]
CHUNK = 12  # families per launch


def families() -> list[str]:
    """Causal-LM model types whose family has a TP plan or a layer list (from transformers or an override)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from meshlm.models.families import family

    out = []
    for kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        if kind in CONFIG_MAPPING:
            fam = family(CONFIG_MAPPING[kind])
            if fam.tp_plan is not None or (fam.layers and fam.embed and fam.norm):
                out.append(kind)
    return out


def tiny(kind: str):
    cls = transformers.CONFIG_MAPPING[kind]
    default = cls()
    small = {k: v for k, v in SMALL.items() if hasattr(default, k)}
    if hasattr(default, "kv_lora_rank"):  # latent attention expands k and v to every head: no grouped kv heads
        small["num_key_value_heads"] = small["num_attention_heads"]
    config = cls(**small)
    if getattr(config, "num_layers", None) == 1:  # LongCat-Flash: num_hidden_layers counts 2 sublayers per block
        config.num_layers = 2
    types = getattr(config, "layer_types", None)
    if types and len(types) != config.num_hidden_layers:
        config.layer_types = list(types[: config.num_hidden_layers])
    return config


def save(kind: str, path: Path) -> str:
    """The tiny model and the byte tokenizer in `path`; '' or why it cannot be built."""
    from meshlm.data.builtin import byte_tokenizer

    try:
        config = tiny(kind)
        with torch.device("meta"):  # counted before anything is allocated
            n = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
        if n > 20_000_000:
            return f"the tiny config still has {n / 1e6:.0f}M parameters (a nested or unusual config)"
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        model.save_pretrained(path)
        byte_tokenizer().save_pretrained(path)
    except Exception as e:  # the row says why
        return f"cannot build a tiny model: {_first_line(e)}"
    try:  # a config the shrinking made inconsistent (MLA head sizes) fails in transformers itself: not meshlm's
        with torch.no_grad():
            model(input_ids=torch.tensor(IDS))
    except Exception as e:
        return f"transformers' own forward fails on the tiny config: {_first_line(e)}"
    return ""


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"


def train_case(work: Path, kind: str, layout: str) -> dict:
    args = [
        *("--model-name", str(work / kind), "--pretrained", "true", "--seq-length", "64", "--max-steps", "3"),
        *("--log-every", "1", "--progress", "false", "--builtin-samples", "200", "--dropout-off", "true"),
        *("--warmup-steps", "1", "--save-final", "false", "--output-dir", str(work / "runs" / f"{kind}-{layout}")),
        *(LAYOUTS.get(layout) or ["--strategy", "single", "--micro-batch-size", "8"]),
    ]
    return {"id": f"{kind}/{layout}", "kind": "train", "args": args}


def _launch_rows(world: int, cases: list[dict], work: Path, timeout: float) -> dict:
    """`cases` in one launch; a launch that dies gives each case a row saying so."""
    try:
        return launch(world, {"cases": cases}, work / "launch", timeout)
    except Exception as e:
        lines = [x for x in str(e).splitlines() if "Error" in x] or [str(e).splitlines()[0]]
        return {c["id"]: {"error": f"the launch died: {lines[-1][:160]}"} for c in cases}


def run_chunked(world: int, cases_of, kinds: list[str], work: Path) -> dict:
    """Cases of `kinds` on `world` ranks, CHUNK families per launch. A case that fails on one rank only (a
    pipeline stage) leaves the other in a collective until the 120 s timeout and breaks the process group for
    every later case of its launch: those run again one family per launch, then one case per launch, so one
    family cannot hide another's row."""
    results = {}
    for i in range(0, len(kinds), CHUNK):
        chunk = kinds[i : i + CHUNK]
        results |= _launch_rows(world, [c for k in chunk for c in cases_of(k)], work, 3600)
        for kind in chunk:
            again = [c for c in cases_of(kind) if broken(results[c["id"]])]
            if again:
                results |= _launch_rows(world, again, work, 900)
            for case in [c for c in again if broken(results[c["id"]])]:
                results |= _launch_rows(world, [case], work, 900)
        print(f"{world} rank(s): {min(i + CHUNK, len(kinds))} of {len(kinds)} families", file=sys.stderr)
    return results


def layouts_of(kind: str) -> list[str]:
    from meshlm.models.families import family

    fam = family(transformers.CONFIG_MAPPING[kind])
    return ["zero3"] + ["tp 2"] * (fam.tp_plan is not None) + ["pp 2"] * bool(fam.layers and fam.embed and fam.norm)


def cell(results: dict, kind: str, layout: str, reference: list | None) -> str:
    from meshlm.models.families import family

    fam = family(transformers.CONFIG_MAPPING[kind])
    if layout == "tp 2" and fam.tp_plan is None:
        return "no TP plan"
    if layout == "pp 2" and not (fam.layers and fam.embed and fam.norm):
        return "no layer list (base_model_pp_plan)"
    r = results.get(f"{kind}/{layout}", {"error": "not run"})
    if "error" in r:
        return _escape(r["error"])
    if reference is None:
        return "ran; no reference"
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], reference))
    return "ok" if worst <= 1e-4 else f"differs: max rel {worst:.1e}"


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def transformers_tp_cell(results: dict, kind: str) -> str:
    r = results.get(f"{kind}/transformers tp", {"error": "not run"})
    if "error" in r:
        return _escape(r["error"])
    return "ok" if r["max_diff"] <= 1e-4 else f"differs: logits {r['max_diff']:.1e}"


COLUMNS = ["| family | single | zero3 | tp 2 | pp 2 | transformers' own tp 2 |", "|---|---|---|---|---|---|"]


def table(kinds: list[str], built: dict[str, str], results: dict) -> list[str]:
    rows = []
    for kind in kinds:
        if built[kind]:
            rows.append(f"| {kind} | {_escape(built[kind])} | | | | |")
            continue
        single = results.get(f"{kind}/single", {"error": "not run"})
        reference = single.get("losses")
        cells = [_escape(single["error"]) if "error" in single else "ran"]
        cells += [cell(results, kind, lay, reference) for lay in LAYOUTS]
        cells.append(transformers_tp_cell(results, kind))
        rows.append(f"| {kind} | " + " | ".join(cells) + " |")
    return rows


def _cells(row: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]


def summary(rows: list[str]) -> str:
    """The table's counts, read from its rows (so a re-run of a few families keeps them right)."""
    cells = [_cells(r) for r in rows]
    ran = [c for c in cells if c[1] == "ran"]
    every = [c for c in ran if c[2:5] == ["ok"] * 3]
    theirs = [c for c in cells if c[5] == "ok"]
    return (
        f"Written by `python benchmarks/families.py` on {datetime.date.today()} with transformers "
        f"{transformers.__version__} and torch {torch.__version__} (CPU, gloo; `--only a,b` re-runs those rows and "
        f"keeps the others): {len(cells)} causal-LM families with a TP plan or a layer list. A cell is `ok` when the "
        f"3 losses are within 1e-4 (relative) of one process; otherwise it says why. {len(every)} families run zero3 "
        f"2, tp 2 and pp 2 equal to one process; {sum(c[3] == 'ok' for c in ran)} run tp 2, "
        f'{sum(c[4] == "ok" for c in ran)} pp 2. The last column is transformers\' own `tp_plan="auto"` on the '
        f"same model, its logits against its own one-process ones: it runs {len(theirs)} families, and meshlm's tp 2 "
        f"matches one process on {sum(c[3] == 'ok' for c in theirs)} of those; the other rows say why."
    )


def write(rows: list[str]) -> None:
    """`rows` into docs/families.md's coverage table, replacing the rows of the same families."""
    text = DOC.read_text()
    old = []
    if BEGIN in text:
        block = text[text.index(BEGIN) : text.index(END)].splitlines()
        old = [line for line in block if line.startswith("| ") and line not in COLUMNS]
    by_family = {_cells(r)[0]: r for r in old} | {_cells(r)[0]: r for r in rows}
    merged = [by_family[k] for k in sorted(by_family)]
    head = [BEGIN, summary(merged), "", *COLUMNS, *merged, END]
    if BEGIN in text:
        text = text[: text.index(BEGIN)] + "\n".join(head) + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip() + "\n\n## Coverage\n\n" + "\n".join(head) + "\n"
    DOC.write_text(text)


def table_tp_ok() -> list[str]:
    """The families whose tp 2 cell in docs/families.md's table is ok."""
    text = DOC.read_text()
    rows = [_cells(r) for r in text[text.index(BEGIN) : text.index(END)].splitlines() if r.startswith("| ")]
    return [c[0] for c in rows if len(c) > 3 and c[3] == "ok"]


def sequence_parallel(kinds: list[str], work: Path) -> None:
    """--sp: tp 2 with sequence parallel against one process, printed (not a column of the table)."""
    LAYOUTS["tp 2 + sp"] = SP
    built = {k: save(k, work / k) for k in kinds}
    ready = [k for k in kinds if not built[k]]
    results = run_chunked(1, lambda k: [train_case(work, k, "single")], ready, work)
    results |= run_chunked(2, lambda k: [train_case(work, k, "tp 2 + sp")], ready, work)
    cells = {k: cell(results, k, "tp 2 + sp", results.get(f"{k}/single", {}).get("losses")) for k in ready}
    print(f"tp 2 + sequence parallel equal to one process: {sum(c == 'ok' for c in cells.values())} of {len(cells)}")
    print("\n".join(f"| {k} | {c} |" for k, c in cells.items() if c != "ok"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated model types (default: every family)")
    p.add_argument("--print", action="store_true", help="print the table instead of writing docs/families.md")
    p.add_argument("--sp", action="store_true", help="tp 2 with sequence parallel, printed (default: tp 2 ok rows)")
    args = p.parse_args()
    if args.sp:
        with tempfile.TemporaryDirectory() as tmp:
            return sequence_parallel([k.strip() for k in args.only.split(",") if k.strip()] or table_tp_ok(), Path(tmp))
    kinds = [k.strip() for k in args.only.split(",") if k.strip()] or families()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        built = {k: save(k, work / k) for k in kinds}
        ready = [k for k in kinds if not built[k]]
        results = run_chunked(1, lambda k: [train_case(work, k, "single")], ready, work)

        def parallel(k):
            tp_check = {"id": f"{k}/transformers tp", "kind": "transformers_tp"}
            tp_check["args"] = {"model_name": str(work / k), "ids": IDS}
            return [train_case(work, k, lay) for lay in layouts_of(k)] + [tp_check]

        results |= run_chunked(2, parallel, ready, work)
    rows = table(kinds, built, results)
    if args.print:
        print("\n".join([*COLUMNS, *rows]))
    else:
        write(rows)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
