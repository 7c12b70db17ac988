"""meshlm against torchtitan's Llama 3 trainer on the same device and the same job: tokens/s,
MFU and peak memory side by side, and the ratio of tokens/s (target on one H100: meshlm >= 1.0x).

    python benchmarks/peer_torchtitan.py [--repeats 3] [--python PATH]   # one GPU: the ~1B job of gpu_mfu.py
    python benchmarks/peer_torchtitan.py --device cpu --tiny              # smoke run of both sides on the CPU

One description (Job) gives both tools their options (options()): the model's body and vocabulary, sequence
length, micro-batch, steps, bf16 mixed precision (fp32 weights, bf16 compute), compile, activation
checkpointing and the attention kernel. Both train on the same documents (the built-in instruction records as
plain text, one JSONL) tokenised by the same byte tokenizer, and both keep attention inside each packed
document (torchtitan's block_causal mask; meshlm with --attention flex or varlen). torchtitan 0.2.2 is driven
through its own entry point (`torchrun -m torchtitan.train`, with the options benchmarks/torchtitan_job.py
writes from the settings) and read from its log lines.

Counted alike: tokens/s over the steps after the warm-up interval (time-weighted); MFU as both tools count it
densely (6 x non-embedding parameters + 12 x layers x hidden x sequence per token, PaLM appendix B, against the
same peak table), meshlm's `mfu` of the attention each document requires beside it; peak memory as CUDA's
allocator reserved it (torchtitan's log line) and, for meshlm, the peak it allocated. The sides take turns,
best of --repeats each. A python without torchtitan gets it in a venv over its own packages (its torch kept):
pip from the index, or only from ./.whl where that exists (the device machines fetch nothing: run
`make gpu-wheels` here first, then carry .whl). torchtitan does not run on the CPU
(tools/utils.py takes "cuda" when no accelerator is found; trainer.py then calls torch.cuda.set_device): the
CPU mode runs meshlm's side and shows torchtitan's error, exit 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import harness
import torchtitan_job

HERE = Path(__file__).resolve().parent
GIB = 2**30
VENV = Path(tempfile.gettempdir()) / "meshlm-torchtitan-venv"  # kept between runs: pip installs torchtitan once


@dataclass(frozen=True)
class Job:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int  # meshlm's built-in model rounds the byte tokenizer's 258 entries up to 320
    flavor: str  # torchtitan's llama3 flavor with this body, for the description (torchtitan_job.py builds it)
    seq_length: int
    micro_batch: int
    steps: int
    warmup: int  # steps in the first logged interval, left out of the timing
    compile: bool
    ac: str  # none or full
    attention: str  # flex or varlen: the document-aware kernel both sides use
    bf16: bool
    documents: int

    def params(self) -> int:
        """Parameters of the Llama this describes (untied head), as both tools build it."""
        kv = self.hidden // self.heads * self.kv_heads
        block = 2 * self.hidden + 2 * self.hidden * (self.hidden + kv) + 3 * self.hidden * self.mlp
        return self.layers * block + 2 * self.vocab * self.hidden + self.hidden


# gpu_mfu.py's job (the 87k tokens/s target): Llama 3.2 1B's body, torchtitan's "1B" flavor
GPU_JOB = Job(2048, 16, 32, 8, 8192, 320, "1B", 2048, 8, 20, 5, True, "none", "flex", True, 20000)
# torchtitan's "debugmodel" body; varlen because meshlm's flex has no backward on the CPU
TINY_JOB = Job(256, 6, 16, 16, 768, 320, "debugmodel", 256, 2, 6, 2, False, "none", "varlen", False, 400)


def options(job: Job, data: Path, out: Path) -> tuple[list[str], dict]:
    """`meshlm train`'s arguments and torchtitan_job.py's settings for `job`: every shared number from it."""
    meshlm = [
        *["--arch.hidden-size", str(job.hidden), "--arch.layers", str(job.layers)],
        *["--arch.heads", str(job.heads), "--arch.kv-heads", str(job.kv_heads)],
        *["--arch.intermediate-size", str(job.mlp), "--arch.max-positions", str(job.seq_length)],
        *["--dataset-name", str(data / "train.jsonl"), "--seq-length", str(job.seq_length)],
        *["--mixed-precision", "bf16" if job.bf16 else "no", "--compile", str(job.compile).lower()],
        *["--activation-checkpointing", job.ac, "--attention", job.attention],
        *["--lr", "3e-4", "--warmup-steps", str(job.warmup)],
    ]
    torchtitan = {
        "attn_backend": job.attention,
        "body": {
            "dim": job.hidden,
            "n_layers": job.layers,
            "n_heads": job.heads,
            "n_kv_heads": job.kv_heads,
            "hidden_dim": job.mlp,
        },
        "vocab_size": job.vocab,
        "tied": False,
        "seq_len": job.seq_length,
        "local_batch_size": job.micro_batch,
        "steps": job.steps,
        "log_freq": job.warmup,
        "lr": 3e-4,
        "warmup_steps": job.warmup,
        "mixed_precision_param": "bfloat16" if job.bf16 else "float32",
        "compile": job.compile,
        "ac": job.ac,
        "tokenizer_dir": str(data / "tokenizer"),
        "dataset_dir": str(data),
        "dump_folder": str(out),
    }
    return meshlm, torchtitan


def write_inputs(job: Job, where: Path) -> Path:
    """The documents (train.jsonl, the built-in records as text) and the byte tokenizer both sides read."""
    from meshlm.data.builtin import byte_tokenizer, corpus
    from meshlm.data.records import format_prompt

    where.mkdir(parents=True, exist_ok=True)
    byte_tokenizer().save_pretrained(where / "tokenizer")
    lines = (json.dumps({"text": format_prompt(r) + r["output"]}) for r in corpus(job.documents))
    (where / "train.jsonl").write_text("\n".join(lines) + "\n")
    return where


def run_meshlm(job: Job, args: list[str]) -> dict:
    """meshlm's side: peak_bytes is CUDA's peak allocated (on the CPU the peak resident set), reserved_bytes the most
    the caching allocator held."""
    return harness.train(1, job.steps, job.warmup, job.micro_batch, *args)


# torchtitan's own formats (0.2.2 and 0.3.0 alike): components/metrics.py MetricsProcessor.log ("step: ... mfu: ...")
# and trainer.py ("Model llama3 1B size: N total parameters"); colours off (disable_color_printing), stripped anyway
STEP_LINE = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)\s+grad_norm:\s*\S+\s+memory:\s*(?P<gib>[\d.]+)GiB\([\d.]+%\)\s+"
    r"tps:\s*(?P<tps>[\d,]+)\s+tflops:\s*[\d,.]+\s+mfu:\s*(?P<mfu>[\d.]+%|N/A)"
)
SIZE_LINE = re.compile(r"size:\s*(?P<n>[\d,]+) total parameters")
ERROR_LINE = re.compile(r"^\s*(?:[\w.]+\.)?\w*(?:Error|Exception|Exit)\b.*$", re.M)


def parse_torchtitan(log: str, warmup: int) -> dict:
    """tokens/s after the first `warmup` steps (each logged interval holds as many tokens: their harmonic mean),
    torchtitan's MFU at that rate, its peak reserved memory, its parameter count and last loss."""
    log = re.sub(r"\x1b\[[0-9;]*m", "", log)
    steps = [m.groupdict() for m in STEP_LINE.finditer(log)]
    timed = [s for s in steps if int(s["step"]) > warmup]
    size = SIZE_LINE.search(log)
    if not timed or not size:
        raise ValueError(f"torchtitan's log has {len(steps)} step lines after step {warmup} and no size line")
    tps = [float(s["tps"].replace(",", "")) for s in timed]
    mean = len(tps) / sum(1 / t for t in tps)
    last = timed[-1]
    mfu = math.nan if last["mfu"] == "N/A" else float(last["mfu"][:-1]) / 100 * mean / tps[-1]
    return {
        "tokens_per_s": mean,
        "mfu_dense": mfu,
        "reserved_bytes": max(float(s["gib"]) for s in steps) * GIB,
        "params": int(size["n"].replace(",", "")),
        "loss": float(last["loss"]),
    }


def run_torchtitan(python: str, settings: dict, warmup: int) -> dict:
    """torchtitan's Llama 3 trainer on one device with `settings`; RuntimeError with its first error line."""
    env = {
        **harness.ENV,
        "PYTHONPATH": ":".join(filter(None, [str(HERE), harness.ENV.get("PYTHONPATH")])),
        "MESHLM_PEER_JOB": json.dumps(settings),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    cmd = [*harness.torchrun(1, python), "-m", "torchtitan.train", *torchtitan_job.command_line(settings)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=False)
    log = p.stdout + p.stderr
    if p.returncode:
        first = ERROR_LINE.search(log)
        raise RuntimeError(first.group(0).strip() if first else f"exit {p.returncode}: {log.strip()[-300:]}")
    return parse_torchtitan(log, warmup)


def torchtitan_python(venv: Path) -> str:
    """A python that imports torchtitan: this one, or a venv that sees this python's packages (a .pth file: its
    CUDA torch is kept, pinned) where pip installs torchtitan (from ./.whl too where that exists); RuntimeError
    with pip's last words."""
    import site

    import torch

    python = str(venv / "bin" / "python")
    for py in (sys.executable, python):
        if Path(py).exists() and not subprocess.run([py, "-c", "import torchtitan"], capture_output=True).returncode:
            return py
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    where = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True)
    Path(where.stdout.decode().strip(), "meshlm_base.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    wheels = HERE.parent / ".whl"  # carried to a machine that cannot fetch: then pip looks nowhere else
    links = ["--no-index", "--find-links", str(wheels)] if wheels.is_dir() else []
    pip = [python, "-m", "pip", "install", "-q", *links, "torchtitan", f"torch=={torch.__version__}"]
    p = subprocess.run(pip, capture_output=True, text=True, check=False)
    if p.returncode:
        raise RuntimeError(f"pip install torchtitan failed: {(p.stderr or p.stdout).strip()[-300:]}")
    return python


def compare(job: Job, where: Path, python: str, repeats: int, meshlm_side: dict | None = None) -> dict:
    """Both sides in turn, `repeats` times; the fastest run of each, or its error (a failed side is not retried).
    `meshlm_side`: meshlm's numbers on this job measured already (gpu-check's flex row), then run only torchtitan."""
    data = write_inputs(job, where / "inputs")
    args, settings = options(job, data, where / "torchtitan")
    sides = {
        "meshlm": lambda: meshlm_side or run_meshlm(job, args),
        "torchtitan": lambda: run_torchtitan(python, settings, job.warmup),
    }
    runs, errors = {name: [] for name in sides}, {}
    for _ in range(repeats):
        for name, run in sides.items():
            if name in errors:
                continue
            try:
                runs[name].append(run())
            except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
                errors[name] = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    result = {n: max(r, key=lambda x: x["tokens_per_s"]) if r else {"error": errors[n]} for n, r in runs.items()}
    titan = result["torchtitan"]
    if "params" in titan and titan["params"] != job.params():
        result["torchtitan"] = {"error": f"torchtitan built {titan['params']:,} parameters, the job {job.params():,}"}
    if "error" not in result["meshlm"] and "error" not in result["torchtitan"]:
        result["ratio"] = result["meshlm"]["tokens_per_s"] / result["torchtitan"]["tokens_per_s"]
    return result


def describe(job: Job) -> str:
    return (
        f"Llama {job.params() / 1e6:,.1f}M (hidden {job.hidden}, {job.layers} blocks, {job.heads}/{job.kv_heads} "
        f"heads, MLP {job.mlp}, vocab {job.vocab}; torchtitan flavor {job.flavor}), seq {job.seq_length} x "
        f"micro-batch {job.micro_batch}, {'bf16' if job.bf16 else 'fp32'}, compile {job.compile}, ac {job.ac}, "
        f"attention {job.attention}; {job.steps} steps ({job.warmup} warm-up)"
    )


def table(result: dict) -> list[str]:
    def gib(r, key):
        return f"{r[key] / GIB:.1f}" if key in r and r[key] == r[key] else "n/a"

    lines = [f"{'side':<12}{'tokens/s':>10}{'mfu %':>8}{'mfu_dense %':>13}{'peak GiB':>10}{'reserved GiB':>14}"]
    for side in ("meshlm", "torchtitan"):
        r = result[side]
        if "error" in r:
            lines.append(f"{side:<12}  failed: {r['error']}")
            continue
        mfu = f"{100 * r['mfu']:.1f}" if "mfu" in r else "n/a"
        lines.append(
            f"{side:<12}{r['tokens_per_s']:>10,.0f}{mfu:>8}{100 * r['mfu_dense']:>13.1f}"
            f"{gib(r, 'peak_bytes'):>10}{gib(r, 'reserved_bytes'):>14}"
        )
    if "ratio" in result:
        lines.append(f"meshlm / torchtitan tokens/s: {result['ratio']:.2f}x (target >= 1.0x)")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="torchtitan's debugmodel body, a few steps: a smoke run")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each side, taking turns; the fastest counts")
    ap.add_argument("--python", default="", help="a python with torchtitan [this one, else a venv it installs]")
    args = ap.parse_args()
    job = TINY_JOB if args.tiny else GPU_JOB
    if args.device == "cpu":
        harness.ENV["CUDA_VISIBLE_DEVICES"] = ""
    else:
        import torch

        if not torch.cuda.is_available():
            print("peer_torchtitan: skipped: no CUDA device visible (--device cpu --tiny runs the smoke run)")
            return 0
    print(f"peer_torchtitan on {args.device}: {describe(job)}; best of {args.repeats}, sides taking turns")
    try:
        python = args.python or torchtitan_python(VENV)
    except RuntimeError as e:
        print(f"peer_torchtitan: {e}")
        return 1
    with tempfile.TemporaryDirectory(prefix="peer-torchtitan-") as tmp:
        result = compare(job, Path(tmp), python, args.repeats)
    print("\n".join(table(result)))
    print(json.dumps({"job": dataclasses.asdict(job), **result}))
    return 0 if "ratio" in result else 1


if __name__ == "__main__":
    sys.exit(main())
