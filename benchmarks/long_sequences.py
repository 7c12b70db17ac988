"""Long sequences on 4 CPU ranks: the longest sequence that trains within a fixed memory budget per rank
under ddp and under context parallel 4, the chunked loss's saving in one process at 8k tokens, and the planner's
prediction beside every measured peak.

A Llama of hidden 256, 4 blocks, 8 heads (8 key/value heads: cp 4 attends by ulysses), MLP 688, vocabulary
32000, untied (19.5M parameters), random, saved with the byte tokenizer; fp32, micro-batch 1, the built-in packed
documents (their document masks cross the cp boundaries). Each point is `meshlm plan --validate` of one layout:
2 training steps through the real trainer with --measure-step 2, so each rank measures its model states and the
step's activation peak (train/probe.py: torch's MemTracker); a rank's peak is their sum (the fullest rank), next
to the planner's states + activation peak for the same layout. Both layouts replicate the states (--strategy
ddp), so only the sequence's own memory differs. The budget is fixed before measuring: 900 MiB per rank.

    python benchmarks/long_sequences.py                 # the table (about 15 minutes on 2 idle cores)
    python benchmarks/long_sequences.py --quick         # ddp 4096 and 8192, cp4 16384, the chunked loss
    python benchmarks/long_sequences.py --ring [SEQ...] # 2 key/value heads under cp 4: ring against allgather

--ring: the same Llama with 2 key/value heads (fewer than the 4 cp ranks: no ulysses), cp 4 (ddp over the cp
ranks) at 16384 and 32768 tokens (or those given), attending by ring (parallel/ring.py) and by allgather, each
rank's peak measured as above and planned with `plan --cp-attention`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from transformers import LlamaConfig, LlamaForCausalLM

from meshlm.data.builtin import byte_tokenizer

BUDGET = 900 * 2**20  # bytes per rank: model states + the step's activation peak
LADDER = {"ddp": [2048, 4096, 8192], "cp4": [8192, 16384, 32768]}  # each layout's lengths, across its budget edge
QUICK = {"ddp": [4096, 8192], "cp4": [16384]}
MiB = 2**20


def save_model(path: Path, kv_heads: int = 8) -> None:
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        intermediate_size=688,
        max_position_embeddings=65536,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)


def validate(model: Path, nproc: int, cp: int, seq: int, chunked: str, out: Path, scheme: str = "auto") -> dict:
    """One `meshlm plan --validate` run of one layout: its measured and predicted bytes of the fullest rank."""
    strategy = "ddp" if nproc > 1 else "single"
    args = ["--model", str(model), "--nproc", str(nproc), "--strategy", strategy, "--precision", "fp32"]
    args += ["--tp", "1", "--pp", "1", "--cp", str(cp), "--cp-attention", scheme] * (nproc > 1)
    args += ["--seq-length", str(seq), "--global-batch-size", str(nproc // cp), "--chunked-loss", chunked]
    args += ["--activation-checkpointing", "none", "--steps", "2", "--output-dir", str(out), "--json"]
    p = subprocess.run([sys.executable, "-m", "meshlm", "plan", "--validate", *args], capture_output=True, text=True)
    results = json.loads(p.stdout)["results"] if p.stdout.strip().startswith("{") else []
    if not results or "error" in results[0]:
        raise RuntimeError(f"plan --validate {' '.join(args)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    r = results[0]
    rows = {row["quantity"]: row for row in r["rows"]}
    predicted = rows["model states"]["predicted"] + rows["activation peak"]["predicted"]
    return {"measured": r["measured_bytes"], "predicted": predicted, "command": r["command"]}


def ladder(model: Path, root: Path, lengths: dict) -> list[dict]:
    rows = []
    for name, seqs in lengths.items():
        cp = 4 if name == "cp4" else 1
        for seq in seqs:
            r = validate(model, 4, cp, seq, "auto", root / f"{name}-{seq}")
            rows.append({"layout": name, "seq": seq, **r})
            print(_line(rows[-1]), flush=True)
    return rows


def _line(r: dict) -> str:
    fits = "yes" if r["measured"] <= BUDGET else "no"
    ratio = r["predicted"] / r["measured"]
    return (
        f"{r['layout']:<22} {r['seq']:>7} {r['measured'] / MiB:>10.0f} {r['predicted'] / MiB:>10.0f} "
        f"{ratio:>7.3f} {fits:>5}"
    )


def longest(rows: list[dict], layout: str) -> int:
    return max((r["seq"] for r in rows if r["layout"] == layout and r["measured"] <= BUDGET), default=0)


def ring_against_allgather(root: Path, seqs: list[int]) -> None:
    save_model(root / "llama-kv2", kv_heads=2)
    print(f"{'layout':<22} {'seq':>7} {'measured':>10} {'planned':>10} {'ratio':>7} {'fits':>5}   (MiB per rank)")
    rows = []
    for seq in seqs:
        for scheme in ("ring", "allgather"):
            r = validate(root / "llama-kv2", 4, 4, seq, "auto", root / f"{scheme}-{seq}", scheme)
            rows.append({"layout": f"cp4 {scheme}", "seq": seq, **r})
            print(_line(rows[-1]), flush=True)
    print(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ring", type=int, nargs="*", help="ring against allgather only, at these lengths")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="long-seq-"))
    if args.ring is not None:
        return ring_against_allgather(root, args.ring or [16384, 32768])
    save_model(root / "llama")
    print(f"budget {BUDGET / MiB:.0f} MiB per rank (model states + activation peak, the fullest rank)")
    print(f"{'layout':<22} {'seq':>7} {'measured':>10} {'planned':>10} {'ratio':>7} {'fits':>5}   (MiB per rank)")
    lengths = QUICK if args.quick else LADDER
    rows = ladder(root / "llama", root, {name: seqs[:1] for name, seqs in lengths.items()})
    for chunked in ("off", "auto"):
        r = validate(root / "llama", 1, 1, 8192, chunked, root / f"single-{chunked}")
        rows.append({"layout": f"single chunked-loss {chunked}", "seq": 8192, **r})
        print(_line(rows[-1]), flush=True)
    rows += ladder(root / "llama", root, {name: seqs[1:] for name, seqs in lengths.items()})
    ddp, cp4 = longest(rows, "ddp"), longest(rows, "cp4")
    off, auto = (next(r for r in rows if r["layout"] == f"single chunked-loss {c}") for c in ("off", "auto"))
    logits = 8192 * 32000 * 4
    print(f"longest within budget: ddp {ddp}, cp4 {cp4} ({cp4 / max(ddp, 1):.2f}x; target >= 3.5x)")
    saved = off["measured"] - auto["measured"]
    print(f"chunked loss at 8192 tokens: peak {saved / MiB:.0f} MiB lower; the logits are {logits / MiB:.0f} MiB")
    worst = max(abs(r["predicted"] / r["measured"] - 1) for r in rows)
    print(f"planner: worst |planned / measured - 1| = {worst:.1%} (target <= 15%)")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
