"""Pictures (PNG, matplotlib): a run's metrics, verify's loss curves, pipeline timelines, planned memory.

Every function takes plain measured or predicted numbers and a path, draws, and returns
the path, so the commands that own the numbers (`meshlm report`, `verify --plot`,
`train --trace-pipeline`, `plan --plot`) only collect them. matplotlib is optional
(`pip install 'meshlm[plot]'`) and imported here only, with the Agg backend: no display needed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

from meshlm.errors import MeshlmError

GIB = 2**30


def require_matplotlib() -> None:
    """Fail with one line before a command does its work, not when it comes to draw."""
    if importlib.util.find_spec("matplotlib") is None:
        raise MeshlmError("plots need matplotlib: pip install 'meshlm[plot]'")


def _plt():
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path, metadata: Mapping[str, str] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=dict(metadata or {}))
    fig.clear()
    return path


# ------------------------------------------------------------------ meshlm report


def read_metrics(output_dir: Path) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        raise MeshlmError(f"{path} does not exist; give the --output-dir of a training run")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise MeshlmError(f"{path}:{i} is not valid JSON") from None
    if not rows:
        raise MeshlmError(f"{path} has no rows yet; a run writes one every --log-every steps")
    return rows


def report(output_dir: Path) -> list[Path]:
    """loss.png, tokens_per_s.png and memory.png from a run's metrics.jsonl, into OUTPUT_DIR/plots (and rewards.png
    for a DPO run, reward.png for a GRPO run)."""
    rows = read_metrics(output_dir)
    plt = _plt()
    plots = Path(output_dir) / "plots"
    steps = [r["step"] for r in rows]
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in rows], marker="." if len(rows) < 50 else None, label="train")
    held = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if held:
        ax.plot(*zip(*held), marker="o", label="held-out")
        ax.legend()
    dpo, grpo = any("rewards/chosen" in r for r in rows), any("reward" in r for r in rows)
    unit = "pair mean (DPO)" if dpo else "--grpo.loss's mean (GRPO)" if grpo else "token mean"
    ax.set(xlabel="step", ylabel=f"loss ({unit} over the global batch)", title="loss")
    ax.grid(alpha=0.3)
    written.append(_save(fig, plots / "loss.png"))
    if dpo:
        written.append(_rewards(rows, plt, plots / "rewards.png"))
    if grpo:
        written.append(_reward(rows, plt, plots / "reward.png"))

    written.append(_throughput(rows, plt, plots / "tokens_per_s.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in sorted({k for r in rows for k in r if k.startswith("mem_") or k == "model_state_bytes"}):
        ax.plot(steps, [r.get(key, math.nan) / GIB for r in rows], label=key)
    ax.set(xlabel="step", ylabel="GiB (rank 0)", title="memory")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    written.append(_save(fig, plots / "memory.png"))
    plt.close("all")
    return written


def _throughput(rows: list[dict], plt, path: Path) -> Path:
    """tokens/s above MFU, each on its own panel: MFU is tokens/s times a constant, so two scaled axes over one
    panel draw the two curves exactly on top of each other."""
    mfu = any("mfu" in r for r in rows)
    fig, axes = plt.subplots(1 + mfu, 1, figsize=(7, 4 + 2 * mfu), sharex=True, squeeze=False)
    steps = [r["step"] for r in rows]
    series = [("tokens/s (all ranks)", [r.get("tokens_per_s", math.nan) for r in rows], "tab:blue")]
    series += [("MFU %", [100 * r.get("mfu", math.nan) for r in rows], "tab:orange")] * mfu
    for ax, (label, values, colour) in zip(axes[:, 0], series):
        ax.plot(steps, values, color=colour, marker="." if len(rows) < 50 else None)
        ax.set(ylabel=label)
        ax.grid(alpha=0.3)
    axes[0, 0].set_title("throughput")
    axes[-1, 0].set_xlabel("step")
    return _save(fig, path)


def summary(rows: list[dict]) -> list[str]:
    """What a run came to, in words: the last row's loss and throughput, the best held-out loss (and DPO's
    reward accuracy), so `meshlm report` answers "how did it go" without opening a picture."""
    last = rows[-1]
    mfu = f", MFU {100 * last['mfu']:.1f}%" if "mfu" in last else ""
    lines = [
        f"final: step {last['step']}, loss {last['loss']:.4f} (first logged: {rows[0]['loss']:.4f} at step "
        f"{rows[0]['step']}), {last.get('tokens_per_s', math.nan):,.0f} tokens/s{mfu}"
    ]
    lines.append(_best_held_out(rows))
    if "rewards/accuracies" in last:
        lines.append(f"DPO: reward accuracy {last['rewards/accuracies']:.2f}, margin {last['rewards/margins']:.3f}")
    rewarded = [r for r in rows if "reward" in r]
    if rewarded:
        lines.append(_grpo_summary(rewarded))
    return lines


def _best_held_out(rows: list[dict]) -> str:
    """The lowest held-out loss, or GRPO's highest held-out reward (it evaluates no loss)."""
    for key, best in (("eval_loss", min), ("eval_reward", max)):
        held = [r for r in rows if key in r]
        if held:
            top = best(held, key=lambda r: r[key])
            return (
                f"best held-out: {key} {top[key]:.4f} at step {top['step']} "
                f"(last: {held[-1][key]:.4f} at step {held[-1]['step']})"
            )
    return "best held-out: none evaluated (--eval-every with --eval-fraction or --eval-split)"


def _grpo_summary(rows: list[dict]) -> str:
    """GRPO's outcome: the last logged reward against the first, and the completions' length."""
    first, last = rows[0], rows[-1]
    length, clipped = last.get("completions/mean_length", math.nan), last.get("completions/clipped_ratio", math.nan)
    return (
        f"GRPO: reward {last['reward']:.3f} (first logged: {first['reward']:.3f} at step {first['step']}), "
        f"reward_std {last.get('reward_std', math.nan):.3f}, completions {length:.1f} tokens on average "
        f"({100 * clipped:.0f}% clipped)"
    )


def _rewards(rows: list[dict], plt, path: Path) -> Path:
    """--objective dpo (objectives/dpo.py): chosen and rejected rewards and their margin, training and held-out, and the
    reward accuracy on a second axis."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for prefix, style in (("", "-"), ("eval_", "o--")):
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            points = [(r["step"], r[prefix + key]) for r in rows if prefix + key in r]
            if points:
                ax.plot(*zip(*points), style, label=prefix + key)
    ax2 = ax.twinx()
    ax2.plot([r["step"] for r in rows], [r.get("rewards/accuracies", math.nan) for r in rows], color="grey", alpha=0.5)
    ax2.set_ylabel("rewards/accuracies (grey)")
    ax.set(xlabel="step", ylabel="beta x log-ratio to the reference", title="DPO rewards")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _reward(rows: list[dict], plt, path: Path) -> Path:
    """--objective grpo (objectives/grpo.py): the mean reward with its groups' std as a band, each function's mean
    and the held-out reward, above the completions' mean length between their shortest and longest."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    got = [r for r in rows if "reward" in r]
    steps, mean = [r["step"] for r in got], [r["reward"] for r in got]
    std = [r.get("reward_std", math.nan) for r in got]
    top.plot(steps, mean, marker="." if len(got) < 50 else None, label="reward")
    top.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
    for key in sorted({k for r in got for k in r if k.startswith("rewards/") and k.endswith("/mean")}):
        top.plot(steps, [r.get(key, math.nan) for r in got], "--", label=key)
    held = [(r["step"], r["eval_reward"]) for r in rows if "eval_reward" in r]
    if held:
        top.plot(*zip(*held), "o-", label="eval_reward (held-out, greedy)")
    top.set(ylabel="reward (band: reward_std)", title="GRPO rewards")
    top.legend(fontsize="small")
    top.grid(alpha=0.3)
    length = [r.get("completions/mean_length", math.nan) for r in got]
    bottom.plot(steps, length, label="completions/mean_length")
    low = [r.get("completions/min_length", math.nan) for r in got]
    bottom.fill_between(steps, low, [r.get("completions/max_length", math.nan) for r in got], alpha=0.2)
    bottom.set(xlabel="step", ylabel="tokens (band: min to max)", title="completion length")
    bottom.grid(alpha=0.3)
    return _save(fig, path)


# ------------------------------------------------------------------ meshlm verify --plot


def plot_verify(rows, path: Path) -> Path:
    """Loss of every layout that ran over the single-device curve, and each one's relative difference per step.

    `rows` are verify.Row objects (or anything with .layout, .status, .losses); the first is the reference.
    """
    plt = _plt()
    ref, others = rows[0], [r for r in rows[1:] if r.losses]
    steps = list(range(1, len(ref.losses) + 1))
    colours = plt.get_cmap("tab20").colors  # up to 20 layouts without a repeated colour
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(3, 2))
    top.plot(steps, ref.losses, color="black", linewidth=4, alpha=0.35, label=f"{ref.layout} (reference)")
    for i, r in enumerate(others):
        c = colours[i % len(colours)]
        top.plot(steps[: len(r.losses)], r.losses, color=c, linewidth=1, marker=".", label=f"{r.layout} ({r.status})")
        # Bitwise-equal steps have no place on a log axis: they are left out, not drawn at a floor.
        diff = [abs(a - b) / abs(b) or math.nan for a, b in zip(r.losses, ref.losses)]
        bottom.semilogy(steps[: len(diff)], diff, color=c, marker=".", label=r.layout)
    top.set(ylabel="loss", title="every layout against one device (same global batches, fp32)")
    top.legend(fontsize="small", ncol=2)
    top.grid(alpha=0.3)
    bottom.set(
        xlabel="step",
        ylabel="|loss - single| / single",
        title="relative difference (steps equal bit for bit are not drawn)",
    )
    bottom.grid(alpha=0.3, which="both")
    out = _save(fig, path)
    plt.close(fig)
    return out


# ------------------------------------------------------------------ train --trace-pipeline


def bubble_fraction(events: Iterable[Mapping]) -> float:
    """Idle share of the ranks' time between the first start and the last end (0 = no bubble)."""
    events = list(events)
    ranks = {e["rank"] for e in events}
    t0, t1 = min(e["start"] for e in events), max(e["end"] for e in events)
    busy = sum(e["end"] - e["start"] for e in events)
    return 1.0 - busy / ((t1 - t0) * len(ranks)) if t1 > t0 else 0.0


ACTION_COLOURS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}


def plot_pipeline_timeline(events: Iterable[Mapping], path: Path, title: str = "") -> Path:
    """One row per rank, one box per (stage, micro-batch, action) from measured start/end seconds.

    Each event: {"rank": int, "stage": int, "micro_batch": int, "action": "F" | "B" | "W", "start": s, "end": s}
    ("W": weight-gradient half of a split backward). Gaps are the bubble; its measured share is in the title.
    A rank holding several stages (interleaved schedules) labels each box with its stage too.
    """
    events = list(events)
    if not events:
        raise ValueError("no pipeline events to draw")
    plt = _plt()
    t0 = min(e["start"] for e in events)
    ranks = sorted({e["rank"] for e in events})
    stages = {r: sorted({e["stage"] for e in events if e["rank"] == r}) for r in ranks}
    several = any(len(s) > 1 for s in stages.values())
    fig, ax = plt.subplots(figsize=(11, 1.4 + 0.6 * len(ranks)))
    for e in events:
        y = ranks.index(e["rank"])
        start, width = (e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3
        ax.broken_barh(
            [(start, width)],
            (y - 0.4, 0.8),
            facecolors=ACTION_COLOURS.get(e["action"], "tab:gray"),
            edgecolors="white",
            linewidth=0.5,
        )
        label = f"{e['action']}{e['micro_batch']}" + (f"\ns{e['stage']}" if several else "")
        ax.text(start + width / 2, y, label, ha="center", va="center", fontsize=7, color="white", clip_on=True)
    names = [f"rank {r}\nstage{'s' if len(stages[r]) > 1 else ''} {', '.join(map(str, stages[r]))}" for r in ranks]
    ax.set_yticks(range(len(ranks)), names)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first event")
    shown = [a for a in ACTION_COLOURS if any(e["action"] == a for e in events)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=ACTION_COLOURS[a]) for a in shown]
    words = {"F": "forward", "B": "backward", "W": "weight grad"}
    ax.legend(handles, [words[a] for a in shown], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    ax.set_title(
        f"{title + chr(10) if title else ''}measured bubble {100 * bubble_fraction(events):.1f}% of rank "
        f"time (idle between the first start and the last end)",
        fontsize="medium",
    )
    out = _save(fig, path)
    plt.close(fig)
    return out


# ------------------------------------------------------------------ plan --plot

COMPONENTS = ("parameters", "gradients", "optimizer", "activations", "buffers")


def _unit(largest: float) -> tuple[str, int]:
    """GiB for real models, MiB or KiB for the tiny ones `plan --validate` runs on CPU ranks."""
    for name, size in (("GiB", GIB), ("MiB", 2**20)):
        if largest >= size:
            return name, size
    return "KiB", 2**10


def plot_memory_bars(
    predicted: Mapping[str, Mapping[str, float]],
    path: Path,
    gpu_bytes: float | None = None,
    measured: Mapping[str, float] | None = None,
    title: str = "",
    limit_label: str = "GPU memory",
    measured_label: str = "measured",
) -> Path:
    """Stacked bars of predicted bytes per GPU by component for each layout, the GPU's memory as a line,
    and, where given, the measured value as a hatched bar beside the prediction.

    predicted: layout -> {component: bytes} (components outside COMPONENTS are stacked after them)
    measured:  layout -> bytes (e.g. what `plan --validate` measured; say what in `measured_label`)
    A memory line far above the bars (a tiny model) is named in the legend instead of squashing them.
    The numbers drawn travel in the PNG's "Description" text chunk as JSON.
    """
    if not predicted:
        raise ValueError("no layouts to draw")
    plt = _plt()
    layouts = list(predicted)
    parts = [c for c in COMPONENTS if any(c in p for p in predicted.values())]
    parts += sorted({c for p in predicted.values() for c in p} - set(parts))
    measured = measured or {}
    largest = max([sum(p.values()) for p in predicted.values()] + [v for v in measured.values() if v == v])
    unit, size = _unit(largest)
    width = 0.38 if measured else 0.6
    inches = max(4, 1.1 * len(layouts) + 1) + 3  # and 3 for the legend on the right
    fig, ax = plt.subplots(figsize=(inches, 4.8))
    xs = range(len(layouts))
    bottom = [0.0] * len(layouts)
    for part in parts:
        heights = [predicted[lay].get(part, 0) / size for lay in layouts]
        ax.bar([x - (width / 2 if measured else 0) for x in xs], heights, width, bottom=bottom, label=part)
        bottom = [b + h for b, h in zip(bottom, heights)]
    if measured:
        ax.bar(
            [x + width / 2 for x in xs],
            [measured.get(lay, math.nan) / size for lay in layouts],
            width,
            color="none",
            edgecolor="black",
            hatch="//",
            label=measured_label,
        )
    if gpu_bytes:
        _limit_line(ax, gpu_bytes, largest, size, limit_label)
    ax.set_xticks(list(xs), layouts, rotation=30, ha="right")
    ax.set_ylabel(f"{unit} per GPU")
    title = title or "predicted memory per GPU" + (" vs measured" if measured else "")
    fig.suptitle(textwrap.fill(title, int(12 * inches)), fontsize="medium")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(alpha=0.3, axis="y")
    numbers = {"layouts": layouts, "predicted": predicted, "measured": measured, "gpu_bytes": gpu_bytes}
    out = _save(fig, path, {"Title": title, "Description": json.dumps(numbers)})
    plt.close(fig)
    return out


def _limit_line(ax, gpu_bytes: float, largest: float, size: float, limit_label: str) -> None:
    """The GPU's memory as a line; one far above the bars (a tiny model) named in the legend instead."""
    label = f"{limit_label} {gpu_bytes / GIB:.3g} GiB"
    if gpu_bytes <= 4 * largest:
        ax.axhline(gpu_bytes / size, color="red", linestyle="--", label=label)
    else:
        ax.plot([], [], color="red", linestyle="--", label=label + " (far above the bars)")
