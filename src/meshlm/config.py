"""Training configuration: dataclasses, TOML files and dotted command-line overrides.

Over 400 lines by design: the option table (one field per option, its help, values and the runs that read it)
is read as one page, and splitting it would scatter the vocabulary the commands share.

Every field has a docstring-like comment in `help` metadata; the CLI builds its
options from these fields, so `--max-steps 50`, `--parallel.tp 2` and a TOML file
with `max_steps = 50` / `[parallel] tp = 2` all set the same thing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from meshlm import files
from meshlm.errors import MeshlmError

# The strategy names, here only; what each does to the mesh is layout.py's.
Strategy = Literal["single", "dp", "ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp", "layer-split"]
STRATEGIES = ("auto", *typing.get_args(Strategy))
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
DPO_LOSSES = ("sigmoid", "ipo", "sigmoid_norm")
# Every choice an option offers, defined here once; the modules that implement them import these.
OBJECTIVES = ("sft", "dpo", "grpo")  # objectives/ (sft: next-token loss; dpo: dpo.py; grpo: grpo.py)
GRPO_LOSSES = ("grpo", "dr_grpo", "dapo", "bnpo")  # objectives/grpo_loss.py, TRL's names
GRPO_SCALES = ("group", "batch", "none")  # --grpo.scale-rewards
# data/builtin.py task_of: --grpo.tasks
BUILTIN_TASKS = ("add", "subtract", "copy", "reverse", "sort", "repeat", "majority")
PRECISIONS = ("no", "bf16")  # --mixed-precision
LORA_BASE_DTYPES = ("auto", "fp32", "bf16")  # --lora.base-dtype (parallel/lora.py)
LORA_QUANTIZE = ("none", "nf4")  # --lora.quantize (parallel/nf4.py)
FLOAT8_RECIPES = ("off", "tensorwise", "rowwise")  # parallel/float8.py
ATTENTION_KERNELS = ("auto", "sdpa", "flex", "varlen")  # models/attention.py
CP_ATTENTION = ("auto", "ulysses", "ring", "allgather")  # parallel/context.py's schemes
AUX_LOSS = ("auto", "on", "off")  # parallel/aux_loss.py
BUILTIN_FAMILIES = ("llama", "gpt2")  # models/build.py's built-in model
ALIASES = {"batch_size": "micro_batch_size"}  # the classic recipe's `train_llm.py --batch-size 64`


@dataclass(frozen=True)
class Domain:
    """The values an option takes, declared beside it and checked by `validate` before any rank starts:
    `ok(value)`, else one line `--key RULE, got VALUE[; FIX]`. An on-disk domain looks at the file system, so
    only the process about to write the run checks it (`check_paths`), not every read of a config.toml."""

    rule: str
    ok: typing.Callable[[typing.Any], bool]
    fix: str = ""
    on_disk: bool = False


def _finite(v) -> bool:
    return math.isfinite(v)  # NaN fails every comparison below too; infinity would pass `>= 0`


AT_LEAST_ONE = Domain("must be at least 1", lambda v: v >= 1)
NOT_NEGATIVE = Domain("must not be negative", lambda v: v >= 0)
FINITE_NOT_NEGATIVE = Domain("must be a finite number, not negative", lambda v: _finite(v) and v >= 0)
POSITIVE = Domain("must be positive and finite", lambda v: _finite(v) and v > 0)
BELOW_ONE = Domain("must be in [0, 1)", lambda v: 0 <= v < 1)
UNIT = Domain("must be in [0, 1]", lambda v: 0 <= v <= 1)
SEED = Domain("must be in 0 .. 2**63 - 1", lambda v: 0 <= v < 2**63)  # torch's generators take 64 bits, numpy no sign
SECONDS = Domain("must be a positive number of seconds", lambda v: _finite(v) and v > 0)
NAME = Domain(
    "must be a plain name (not empty, '.' or '..', no path separator)",
    lambda v: v not in ("", ".", "..") and not any(c in v for c in ("/", "\\", "\0")),
    "use --output-dir for a path",
)
WRITABLE_DIR = Domain(
    "must be a directory meshlm can create and write into (not under a file, not on a read-only or virtual "
    "file system)",
    lambda v: files.can_write_dir(Path(v or "outputs")),  # the default, outputs/<experiment-name>, is made there
    "pick another",
    on_disk=True,
)

EVAL_PROMPTS = Domain(
    "must be a number of held-out prompts (1 or more) or an existing .jsonl or .txt file of prompts",
    lambda v: not v or (v.isdigit() and int(v) > 0) or (Path(v).suffix in (".jsonl", ".txt") and Path(v).is_file()),
    on_disk=True,
)


@dataclass(frozen=True)
class Only:
    """An option read only in some runs (`when(cfg)`, said as `text`): given in another, it is refused rather
    than ignored, so config.toml never records a value the run did not use."""

    text: str
    when: typing.Callable[[typing.Any], bool]


BUILTIN_MODEL = Only("by the built-in model (without --model-name, whose config sets it)", lambda c: not c.model_name)
PIPELINE = Only("with --parallel.pp 2 or more", lambda c: c.parallel.pp > 1)
LORA = Only("with --lora.r 1 or more", lambda c: c.lora.r > 0)
DPO = Only("with --objective dpo", lambda c: c.objective == "dpo")
GRPO = Only("with --objective grpo", lambda c: c.objective == "grpo")
LAYER_SPLIT = Only("under --strategy layer-split", lambda c: c.strategy == "layer-split")
EVALUATING = Only("with --eval-every N (it follows eval_loss)", lambda c: c.eval_every > 0)


def _option(default, help: str, choices=None, domain: Domain | None = None, only: Only | None = None):
    meta = {"help": help, "choices": choices, "domain": domain, "only": only}
    meta = {k: v for k, v in meta.items() if v}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ArchConfig:
    """Dimensions of the built-in model (used when --model-name is not given)."""

    family: str = _option("llama", "built-in model family", BUILTIN_FAMILIES, only=BUILTIN_MODEL)
    hidden_size: int = _option(128, "hidden size", domain=AT_LEAST_ONE, only=BUILTIN_MODEL)
    layers: int = _option(4, "number of transformer blocks", domain=AT_LEAST_ONE, only=BUILTIN_MODEL)
    heads: int = _option(4, "attention heads", domain=AT_LEAST_ONE, only=BUILTIN_MODEL)
    kv_heads: int = _option(
        2,
        "key/value heads (grouped-query attention when fewer than heads; llama only)",
        domain=AT_LEAST_ONE,
        only=BUILTIN_MODEL,
    )
    intermediate_size: int = _option(352, "MLP width", domain=AT_LEAST_ONE, only=BUILTIN_MODEL)
    max_positions: int = _option(
        1024, "maximum sequence length the model accepts", domain=AT_LEAST_ONE, only=BUILTIN_MODEL
    )


@dataclass
class ParallelConfig:
    """Parallel degrees. Their product with the data-parallel degree is the world size."""

    tp: int = _option(1, "tensor-parallel degree", domain=AT_LEAST_ONE)
    ep: int = _option(
        1,
        "expert-parallel degree: the experts of each mixture-of-experts layer split over this many data-parallel "
        "ranks (carved out of the FSDP shards; other parameters stay sharded over all of them)",
        domain=AT_LEAST_ONE,
    )
    pp: int = _option(1, "pipeline-parallel degree", domain=AT_LEAST_ONE)
    shard_size: int = _option(
        0,
        "hsdp sharding factor: ranks per shard group (0 = all data-parallel ranks)",
        domain=NOT_NEGATIVE,
        only=Only("under --strategy hsdp", lambda c: c.strategy == "hsdp"),
    )
    sequence_parallel: bool = _option(False, "shard norms and dropout along the sequence under tensor parallel")
    micro_batches: int = _option(0, "pipeline micro-batches per step (0 = 2 x pp)", domain=NOT_NEGATIVE, only=PIPELINE)
    schedule: str = _option("1f1b", "pipeline schedule", SCHEDULES, only=PIPELINE)
    pp_split: str = _option(
        "",
        "comma-separated first layer index of each stage after the first [default: balanced]",
        only=Only(
            "with --parallel.pp 2 or more or --strategy layer-split",
            lambda c: c.parallel.pp > 1 or c.strategy == "layer-split",
        ),
    )
    virtual_stages: int = _option(
        2,
        "stages per rank for interleaved-1f1b",
        domain=AT_LEAST_ONE,
        only=Only("with --parallel.schedule interleaved-1f1b", lambda c: c.parallel.schedule == "interleaved-1f1b"),
    )
    cp: int = _option(
        1,
        "context-parallel degree: each sequence split over this many ranks (parallel/context.py)",
        domain=AT_LEAST_ONE,
    )
    cp_attention: str = _option(
        "auto",
        "how context-parallel ranks attend across the split: ulysses (all-to-all over heads), ring (k/v "
        "blocks passed around the cp ranks, any head count), allgather (all-gathered keys and values, any head "
        "count), auto (ulysses where the heads divide by cp, else ring)",
        CP_ATTENTION,
        only=Only("with --parallel.cp 2 or more", lambda c: c.parallel.cp > 1),
    )


@dataclass
class LoraConfig:
    """LoRA adapters (parallel/lora.py): the base model is frozen, only the adapters train."""

    r: int = _option(0, "adapter rank (0 = full fine-tuning, no adapters)", domain=NOT_NEGATIVE)
    alpha: float = _option(
        16.0, "adapter scaling numerator: updates are scaled by alpha / r", domain=POSITIVE, only=LORA
    )
    dropout: float = _option(0.0, "dropout on the adapters' input", domain=BELOW_ONE, only=LORA)
    targets: str = _option(
        "",
        "comma-separated module names to adapt [default: the family's attention and MLP projections]",
        only=LORA,
    )
    base_dtype: str = _option(
        "auto",
        "the frozen base's storage dtype: bf16 (2 bytes a parameter), fp32 (4), or auto (the compute dtype: "
        "bf16 under --mixed-precision bf16); the adapters keep fp32 values either way",
        LORA_BASE_DTYPES,
        only=Only(
            "with --lora.r 1 or more and --mixed-precision bf16 (fp32 compute keeps an fp32 base)",
            lambda c: c.lora.r > 0 and c.mixed_precision == "bf16",
        ),
    )
    quantize: str = _option(
        "none",
        "store the frozen base's block projections as NF4 (4-bit NormalFloat in blocks of 64, QLoRA's format; "
        "dequantised per layer to the compute dtype): about 0.56 bytes a parameter; needs torchao",
        LORA_QUANTIZE,
        only=LORA,
    )


def lora_on(lora: LoraConfig) -> bool:
    """Whether adapters train on a frozen base (--lora.r, parallel/lora.py): decided here, so a run without LoRA
    imports none of it."""
    return lora.r > 0


def nf4_base(lora: LoraConfig) -> bool:
    """Whether the frozen base's block projections are stored as NF4 (--lora.quantize nf4, parallel/nf4.py)."""
    return lora_on(lora) and lora.quantize == "nf4"


def lora_base_dtype(choice: str, precision: str) -> str:
    """The frozen base's dtype, "fp32" or "bf16", for --lora.base-dtype `choice` under `precision` (bf16 or
    not): auto is the compute dtype, since every matmul rounds an fp32 base to it anyway."""
    if choice != "auto":
        return choice
    return "bf16" if precision == "bf16" else "fp32"


@dataclass
class DPOConfig:
    """Preference tuning (--objective dpo, train/dpo.py): chosen/rejected pairs against a frozen reference."""

    beta: float = _option(
        0.1, "how far the policy may move from the reference (higher: less); IPO's tau", domain=POSITIVE, only=DPO
    )
    loss: str = _option(
        "sigmoid",
        "sigmoid: DPO; ipo: IPO's squared loss; sigmoid_norm: DPO on log-ratios divided by the response lengths",
        DPO_LOSSES,
        only=DPO,
    )
    label_smoothing: float = _option(
        0.0,
        "conservative DPO (sigmoid losses): the probability that a pair's preference is flipped, 0 <= e < 0.5",
        domain=Domain("must be in [0, 0.5)", lambda v: 0 <= v < 0.5),
        only=DPO,
    )
    precompute_reference: bool = _option(
        False,
        "compute the reference log-probabilities once into the token cache and hold no reference model",
        only=DPO,
    )


@dataclass
class GRPOConfig:
    """Reinforcement learning on rewards (--objective grpo, objectives/grpo.py): groups of completions per prompt,
    generated by the model being trained, scored, and learned from with group-normalised advantages (TRL's names)."""

    group_size: int = _option(
        8,
        "completions per prompt (TRL's num_generations); --micro-batch-size counts completions",
        domain=Domain("must be at least 2", lambda v: v >= 2, "a group compares its completions"),
        only=GRPO,
    )
    temperature: float = _option(1.0, "sampling temperature of the completions", domain=POSITIVE, only=GRPO)
    top_p: float = _option(
        1.0,
        "nucleus sampling: the smallest set of tokens holding this much probability",
        only=GRPO,
        domain=Domain("must be in (0, 1]", lambda v: 0 < v <= 1),
    )
    max_new_tokens: int = _option(32, "new tokens per completion at most", domain=AT_LEAST_ONE, only=GRPO)
    scale_rewards: str = _option(
        "group",
        "divide the advantages by the std of the group's rewards, of the batch's, or not",
        GRPO_SCALES,
        only=GRPO,
    )
    epsilon: float = _option(0.2, "the ratio's lower clip: 1 - epsilon", domain=POSITIVE, only=GRPO)
    epsilon_high: float = _option(
        0.0,
        "the ratio's upper clip: 1 + epsilon-high (DAPO's clip-higher; 0: --grpo.epsilon)",
        domain=FINITE_NOT_NEGATIVE,
        only=GRPO,
    )
    loss: str = _option(
        "dapo",
        "how the per-token losses are aggregated (TRL's loss_type; dapo is its default)",
        GRPO_LOSSES,
        only=GRPO,
    )
    iterations: int = _option(
        1, "optimizer steps on each generated batch (TRL's num_iterations)", domain=AT_LEAST_ONE, only=GRPO
    )
    beta: float = _option(
        0.0, "weight of the KL term to the starting model (0: no reference)", domain=FINITE_NOT_NEGATIVE, only=GRPO
    )
    reward: str = _option(
        "exact_match",
        "reward functions, comma-separated: exact_match (against the record's answer), format, or MODULE:FUNCTION "
        "(TRL's signature: prompts, completions, **columns -> list of floats or None)",
        only=GRPO,
    )
    reward_weights: str = _option("", "comma-separated weights of the reward functions (empty: 1 each)", only=GRPO)
    tasks: str = _option(
        "",
        f"the built-in tasks to prompt with, comma-separated: {', '.join(BUILTIN_TASKS)} (empty: all); a task "
        "the model sometimes solves gives groups whose rewards differ, the only ones GRPO learns from",
        domain=Domain(
            f"must be built-in task names, comma-separated ({', '.join(BUILTIN_TASKS)})",
            lambda v: not v or all(t.strip() in BUILTIN_TASKS for t in v.split(",")),
        ),
        only=Only(
            "with --objective grpo on the built-in corpus (without --dataset-name)",
            lambda c: c.objective == "grpo" and not c.dataset_name,
        ),
    )
    gather_for_generation: bool = _option(
        True,
        "under FSDP (zero2/zero3/fsdp/hsdp) gather the whole model once for each rollout and reshard it before "
        "training (TRL's ds3_gather_for_generation): no collective per new token, at the price of the whole model "
        "on every rank while decoding; false: each layer gathered per decoding forward, as in training",
        only=GRPO,
    )
    log_completions: bool = _option(
        False,
        "write every completion (step, prompt, text, token ids, rewards, advantage) to completions.jsonl",
        only=GRPO,
    )
    replay: str = _option(
        "",
        "train on the completions of an earlier run's completions.jsonl instead of generating (the same prompts, "
        "seed, batch and group size): meshlm verify compares its layouts on one run's completions",
        only=GRPO,
    )


@dataclass
class MoeConfig:
    """Mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE): the router's auxiliary load-balancing loss."""

    aux_loss: str = _option(
        "auto",
        "add the router's load-balancing loss x router_aux_loss_coef to the loss (auto: when the model config sets "
        "output_router_logits, as transformers does)",
        AUX_LOSS,
    )


@dataclass
class Config:
    """Everything a training run needs; see `meshlm train --help`."""

    # what to train
    model_name: str = _option("", "hub id or local directory of a causal LM [default: the built-in tiny Llama]")
    pretrained: bool = _option(False, "load the weights of --model-name (false: its config with random weights)")
    trust_remote_code: bool = _option(False, "allow custom code from the model's repository")
    tokenizer_name: str = _option("", "hub id or directory of the tokenizer [default: --model-name, or built-in bytes]")
    dataset_name: str = _option("", "hub id, .jsonl/.json/.txt file, or empty for the built-in synthetic corpus")
    dataset_split: str = _option("train", "split of a hub dataset")
    builtin_samples: int = _option(4000, "number of records in the built-in synthetic corpus", domain=AT_LEAST_ONE)
    seq_length: int = _option(128, "tokens per training sequence", domain=AT_LEAST_ONE)
    loss_on: str = _option(
        "response",
        "instruction/chat records: learn the responses (assistant turns) only, or "
        "every token; plain text always learns every token",
        ("response", "all"),
    )
    packing: bool = _option(
        True,
        "pack whole documents into blocks, each into the open block it fills best (attention stays inside "
        "each document); false: one document per block, padded",
    )
    overflow: str = _option(
        "split", "a document longer than --seq-length: split into pieces, or truncate", ("split", "truncate")
    )
    text_unit: str = _option(
        "paragraph", ".txt files: one document per blank-line-separated paragraph, or per file", ("paragraph", "file")
    )
    streaming: bool = _option(False, "stream a hub dataset while tokenising instead of downloading it whole first")
    eval_every: int = _option(
        0, "steps between held-out evaluations (0 = off; also after the last step when on)", domain=NOT_NEGATIVE
    )
    eval_fraction: float = _option(
        0.0,
        "hold out this fraction of the records for evaluation, by record, fixed by --seed (0 = none; at most 0.5)",
        domain=Domain("must be in (0, 0.5] (or 0 for none)", lambda v: v == 0 or 0 < v <= 0.5),
    )
    eval_split: str = _option("", "evaluate on this split of the hub dataset (e.g. validation) instead")
    eval_samples: str = _option(
        "",
        "at every evaluation, decode these prompts greedily and log them (console, samples.jsonl, W&B): a .jsonl "
        "or .txt file of prompts (as meshlm generate --prompts reads), or N: the first N held-out prompts",
        domain=EVAL_PROMPTS,
        only=EVALUATING,
    )
    eval_sample_tokens: int = _option(
        32,
        "new tokens per --eval-samples prompt (a prompt too long for the rest keeps its last tokens)",
        domain=AT_LEAST_ONE,
        only=Only("with --eval-samples", lambda c: bool(c.eval_samples)),
    )
    arch: ArchConfig = field(default_factory=ArchConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    objective: str = _option(
        "sft",
        "sft: learn the responses (next-token loss); dpo: prefer 'chosen' over 'rejected' in preference records",
        OBJECTIVES,
    )
    dpo: DPOConfig = field(default_factory=DPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)

    # how to split it
    strategy: str = _option("auto", "data-parallel strategy (auto: single for one rank, else ddp)", STRATEGIES)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    devices: str = _option("", "layer-split devices, e.g. cuda:0,cuda:1 or cpu,cpu")
    split_size: int = _option(
        0,
        "layer-split: chunk each micro-batch into pieces of this size so devices overlap",
        domain=NOT_NEGATIVE,
        only=LAYER_SPLIT,
    )
    backend: str = _option(
        "auto", "process group backend (auto: nccl with CUDA, else gloo)", ("auto", "nccl", "gloo", "mpi")
    )
    dist_timeout: float = _option(
        300.0,
        "seconds before a stuck collective fails the job (each rank then logs its stack)",
        domain=SECONDS,
    )
    mixed_precision: str = _option("no", "bf16: bf16 compute, fp32 master weights", PRECISIONS)
    activation_checkpointing: str = _option("none", "none, full, or every-N (every N-th block)")
    cpu_offload: bool = _option(
        False, "keep sharded parameters, gradients and optimizer states on the CPU (needs GPUs)"
    )
    compile: bool = _option(False, "torch.compile each transformer block")
    chunked_loss: str = _option(
        "auto",
        "the LM head and loss over chunks of tokens, never the whole logits: auto (where the logits span "
        "more than one chunk, or in one chunk where they outweigh the head's weight gradient: positions without a "
        "target then make no logits), on, off, or the tokens per chunk; --objective sft only (dpo: auto keeps the "
        "whole logits)",
    )
    activation_offload: bool = _option(
        False, "move the activations saved for backward to host memory and back (GPUs; composes with checkpointing)"
    )
    float8: str = _option(
        "off",
        "float8 matmuls in the Linear layers through torchao, tensorwise or rowwise scales (GPUs of compute "
        "capability 8.9+; CPU ranks run torch's slower CPU float8 matmul, for checking numerics)",
        FLOAT8_RECIPES,
    )
    attention: str = _option(
        "auto",
        "attention kernel for packed documents: sdpa (a dense document mask), flex (FlexAttention block mask), "
        "varlen (each document on its own, no mask); auto: the fastest exact one here (named in the log)",
        ATTENTION_KERNELS,
    )
    dropout_off: bool = _option(
        False, "set the model's dropout probabilities to 0 (meshlm verify does: layouts draw dropout masks differently)"
    )
    sync_batchnorm: bool = _option(False, "convert BatchNorm layers to SyncBatchNorm under ddp")

    # optimisation
    micro_batch_size: int = _option(8, "sequences per rank per forward pass", domain=AT_LEAST_ONE)
    grad_accum: int = _option(1, "micro-batches accumulated per optimizer step", domain=AT_LEAST_ONE)
    global_batch_size: int = _option(
        0,
        "sequences per optimizer step; when set, the accumulation follows from it and the rank count "
        "(0: micro-batch x accumulation x data-parallel ranks, and a resumed run keeps its checkpoint's)",
        domain=NOT_NEGATIVE,
    )
    max_steps: int = _option(200, "optimizer steps to train", domain=AT_LEAST_ONE)
    lr_schedule_steps: int = _option(
        0,
        "steps the warm-up + cosine schedule spans (0: --max-steps, and a resumed run keeps its checkpoint's, "
        "so a larger --max-steps on resume trains on at the minimum rate)",
        domain=NOT_NEGATIVE,
    )
    lr: float = _option(3e-3, "peak learning rate", domain=POSITIVE)
    min_lr_ratio: float = _option(0.1, "final learning rate as a fraction of the peak (cosine decay)", domain=UNIT)
    warmup_steps: int = _option(10, "linear warm-up steps", domain=NOT_NEGATIVE)
    weight_decay: float = _option(0.1, "AdamW weight decay", domain=FINITE_NOT_NEGATIVE)
    beta1: float = _option(0.9, "AdamW beta1", domain=BELOW_ONE)
    beta2: float = _option(0.95, "AdamW beta2", domain=BELOW_ONE)
    grad_clip: float = _option(1.0, "clip the global gradient norm to this (0 = off)", domain=FINITE_NOT_NEGATIVE)
    skip_nonfinite: int = _option(
        0,
        "skip up to N optimizer steps whose loss or gradients are NaN/inf (0: stop at the first)",
        domain=NOT_NEGATIVE,
    )
    scale_lr: str = _option(
        "none", "scale lr with the global batch relative to --base-batch-size", ("none", "linear", "sqrt")
    )
    base_batch_size: int = _option(
        8,
        "global batch size that --lr was tuned for (with --scale-lr)",
        domain=AT_LEAST_ONE,
        only=Only("with --scale-lr linear or sqrt", lambda c: c.scale_lr != "none"),
    )
    seed: int = _option(1234, "random seed (runs on CPU are deterministic)", domain=SEED)

    # bookkeeping
    experiment_name: str = _option("meshlm", "name of the experiment; groups per-rank runs", domain=NAME)
    output_dir: str = _option(
        "", "where everything is written [default: outputs/<experiment-name>]", domain=WRITABLE_DIR
    )
    log_every: int = _option(10, "steps between metric lines", domain=AT_LEAST_ONE)
    ckpt_every: int = _option(0, "steps between checkpoints (0 = only at the end)", domain=NOT_NEGATIVE)
    keep_last: int = _option(0, "keep only the newest K checkpoints (0 = keep all)", domain=NOT_NEGATIVE)
    keep_best: bool = _option(
        False,
        "checkpoint each new lowest eval_loss and point checkpoints/best at it (never deleted by --keep-last)",
        only=EVALUATING,
    )
    early_stopping_patience: int = _option(
        0,
        "stop after N evaluations in a row without a new lowest eval_loss (0 = off)",
        domain=NOT_NEGATIVE,
        only=EVALUATING,
    )
    resume: bool = _option(True, "resume from checkpoints/latest when it exists")
    overwrite: bool = _option(
        False,
        "start over in an --output-dir that holds a run: delete its checkpoints, metrics, logs and plots first "
        "(without it, --resume false there is refused)",
    )
    save_final: bool = _option(True, "write a checkpoint at the end of training")
    ckpt_on_signal_after: float = _option(
        300.0,
        "on the first SIGINT/SIGTERM (Ctrl-C, a preempted job) stop after the current step, saving a checkpoint "
        "first when there is none yet or the last one is older than this many seconds (0 = never save on a signal); "
        "a second signal stops at once",
        domain=FINITE_NOT_NEGATIVE,
    )
    tensorboard: bool = _option(False, "write TensorBoard event files to <output-dir>/tensorboard")
    wandb: bool = _option(False, "log to Weights & Biases, one run per rank grouped by experiment")
    wandb_project: str = _option("meshlm", "W&B project")
    progress: bool = _option(True, "show a progress bar on rank 0")
    measure_step: int = _option(
        0,
        "measure collective bytes, peak activation memory and model states during step N "
        "into <output-dir>/probe/rank-R.json (0 = off; that step runs slower; used by "
        "meshlm plan --validate)",
        domain=NOT_NEGATIVE,
    )
    trace_pipeline: bool = _option(
        False,
        "record when each pipeline stage runs each micro-batch's forward and "
        "backward in the last step: <output-dir>/trace/pipeline.json and "
        "plots/pipeline.png (needs --parallel.pp 2 or more, and matplotlib)",
    )

    @property
    def out(self) -> Path:
        return Path(self.output_dir or f"outputs/{self.experiment_name}")

    @property
    def resuming(self) -> bool:
        """Whether checkpoints/latest, if any, is resumed (--overwrite starts over)."""
        return self.resume and not self.overwrite


# ---------------------------------------------------------------- key handling


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)  # slow (evaluates every annotation): once per class, not per field


def _type_of(cls, name: str):
    return _hints(cls)[name]


def flat_keys(cls=Config, prefix: str = "") -> dict[str, tuple[type, dataclasses.Field]]:
    """All settable keys as dotted names (`parallel.tp`) -> (type, field)."""
    out = {}
    for name, f in _fields(cls).items():
        t = _type_of(cls, name)
        if dataclasses.is_dataclass(t):
            out.update(flat_keys(t, f"{prefix}{name}."))
        else:
            out[prefix + name] = (t, f)
    return out


def _norm(key: str) -> str:
    return key.strip().lstrip("-").replace("-", "_")


def coerce(key: str, value, typ):
    """Turn a string (CLI) or TOML value into `typ`, or raise a one-line error."""
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            s = str(value).lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value) if not isinstance(value, str) else int(value.strip(), 10)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        kind = {bool: "true or false", int: "an integer", float: "a number"}.get(typ, typ.__name__)
        raise MeshlmError(f"--{key.replace('_', '-')} needs {kind}, got {value!r}") from None


def set_key(cfg: Config, key: str, value, config_file: str = "") -> None:
    """Set one key; `config_file`: the TOML file it came from, whose spelling (`max_steps`) a hint then uses."""
    keys = flat_keys()
    k = ALIASES.get(_norm(key), _norm(key))
    if k not in keys:
        close = [c for c in keys if c.endswith(k) or k in c]
        spell = (lambda c: c) if config_file else (lambda c: "--" + c.replace("_", "-"))
        hint = f" (did you mean {', '.join(map(spell, close[:3]))}?)" if close else ""
        where = f" in {config_file}" if config_file else ""
        raise MeshlmError(f"unknown config key {key!r}{where}{hint}; see `meshlm train --help`")
    typ, f = keys[k]
    v = coerce(k, value, typ)
    choices = f.metadata.get("choices")
    if choices and v not in choices:
        raise MeshlmError(f"--{k.replace('_', '-')} must be one of {', '.join(choices)}, got {v!r}")
    obj = cfg
    *path, last = k.split(".")
    for p in path:
        obj = getattr(obj, p)
    setattr(obj, last, v)


def parse_args(args: list[str]) -> list[tuple[str, str]]:
    """`--parallel.tp 2 --seq-length 64` -> [("parallel.tp", "2"), ("seq_length", "64")]: options that are
    config keys, each with its value (the inverse of to_args)."""
    if len(args) % 2 or not all(a.startswith("--") for a in args[::2]):
        raise MeshlmError(f"expected --key value pairs, got {' '.join(args)!r}")
    return [(_norm(k), v) for k, v in zip(args[::2], args[1::2])]


def to_args(keys: list[tuple[str, object]]) -> list[str]:
    """[("parallel.tp", 2)] -> ["--parallel.tp", "2"]: config keys as `meshlm train` options."""
    return [x for k, v in keys for x in ("--" + _norm(k).replace("_", "-"), str(v))]


def _walk_toml(data: dict, prefix: str = ""):
    for k, v in data.items():
        if isinstance(v, dict):
            yield from _walk_toml(v, f"{prefix}{k}.")
        else:
            yield prefix + k, v


def load(config_file: str | None = None, overrides: list[tuple[str, str]] = ()) -> Config:
    """Defaults, then the TOML file, then command-line overrides (last wins)."""
    cfg = Config()
    if config_file:
        p = Path(config_file)
        if not p.is_file():
            raise MeshlmError(f"config file {config_file} does not exist")
        for k, v in _walk_toml(files.read_toml(p)):
            set_key(cfg, k, v, config_file)
    for k, v in overrides:
        set_key(cfg, k, v)
    validate(cfg)
    return cfg


def _value(cfg: Config, key: str):
    obj = cfg
    for p in key.split("."):
        obj = getattr(obj, p)
    return obj


def _check_domains(cfg: Config, on_disk: bool = False) -> None:
    """Every option's value inside the domain declared beside it (on_disk: the file-system ones, else the rest)."""
    for key, (_, f) in flat_keys().items():
        domain = f.metadata.get("domain")
        if domain is None or domain.on_disk != on_disk:
            continue
        value = _value(cfg, key)
        if not domain.ok(value):
            fix = f"; {domain.fix}" if domain.fix else ""
            raise MeshlmError(f"--{key.replace('_', '-')} {domain.rule}, got {value!r}{fix}")


def check_paths(cfg: Config) -> None:
    """The path options' domains, looked up on the file system: by the process about to write the run."""
    _check_domains(cfg, on_disk=True)


def _check_read(cfg: Config) -> None:
    """An option given (not its default) where the run does not read it: refused, naming the option."""
    for key, (_, f) in flat_keys().items():
        only = f.metadata.get("only")
        value = _value(cfg, key)
        if only is not None and value != f.default and not only.when(cfg):
            shown = str(value).lower() if isinstance(value, bool) else value
            raise MeshlmError(f"--{key.replace('_', '-')} {shown} is read only {only.text}: drop it")


def validate(cfg: Config) -> None:
    """Checks that need no model, data or processes."""
    _check_domains(cfg)
    _check_word_or_number(cfg)
    if cfg.eval_every and not (cfg.eval_fraction or cfg.eval_split):
        raise MeshlmError("--eval-every needs held-out data: --eval-fraction F (e.g. 0.05) or --eval-split NAME")
    _validate_dpo(cfg)
    _validate_grpo(cfg)
    _check_eval_samples(cfg)
    _check_read(cfg)  # last: a conflict between options that are read says more than an unread option
    if cfg.trace_pipeline:
        if cfg.parallel.pp == 1:
            raise MeshlmError("--trace-pipeline draws a pipeline's schedule: it needs --parallel.pp 2 or more")
        from meshlm.report import require_matplotlib

        require_matplotlib()  # now, not after the run has trained


def _check_eval_samples(cfg: Config) -> None:
    """--eval-samples decodes with the whole model on every rank (train/samples.py): the layouts that hold it
    whole, or gather it whole for a forward (FSDP), not those that split one forward over ranks."""
    p = cfg.parallel
    split = [
        name
        for name, on in (
            ("--parallel.tp", p.tp > 1),
            ("--parallel.pp", p.pp > 1),
            ("--parallel.cp", p.cp > 1),
            ("--parallel.ep", p.ep > 1),
            ("--strategy layer-split", cfg.strategy == "layer-split"),
        )
        if on
    ]
    if cfg.eval_samples and split:
        raise MeshlmError(
            f"--eval-samples runs under single, dp, ddp, zero1-3, fsdp and hsdp, not with {split[0]}: "
            "drop --eval-samples (or sample from a checkpoint with meshlm generate)"
        )


def _check_word_or_number(cfg: Config) -> None:
    """Options that take a word or a count."""
    ac = cfg.activation_checkpointing
    if not (ac in ("none", "full") or (ac.startswith("every-") and ac[6:].isdigit() and int(ac[6:]) > 0)):
        raise MeshlmError(f"--activation-checkpointing must be none, full or every-N (N >= 1), got {ac!r}")
    check_chunked_loss(cfg.chunked_loss, cfg.objective)


def check_chunked_loss(chunk: str, objective: str) -> None:
    """--chunked-loss for meshlm train and meshlm plan. The chunked head (parallel/loss.py) returns a summed
    next-token loss, not the per-response log-probabilities DPO compares: under dpo only auto (whole logits) or off."""
    if not (chunk in ("auto", "on", "off") or (chunk.isdigit() and int(chunk) > 0)):
        raise MeshlmError(f"--chunked-loss must be auto, on, off or a number of tokens per chunk, got {chunk!r}")
    if objective != "sft" and chunk not in ("auto", "off"):
        raise MeshlmError(
            f"--chunked-loss {chunk} sums a next-token loss; --objective {objective} needs each response's "
            "log-probabilities from the whole logits: drop --chunked-loss"
        )


def _validate_dpo(cfg: Config) -> None:
    d = cfg.dpo
    if d.label_smoothing and d.loss == "ipo":
        raise MeshlmError("--dpo.label-smoothing applies to the sigmoid losses; --dpo.loss ipo has none")
    if cfg.objective == "dpo" and cfg.loss_on == "all":
        raise MeshlmError("--objective dpo compares the responses of a pair; drop --loss-on all")


def _validate_grpo(cfg: Config) -> None:
    """What --objective grpo needs of the other options; the layout and the prompts are checked in the ranks."""
    if cfg.objective != "grpo":
        return
    g = cfg.grpo
    if g.max_new_tokens >= cfg.seq_length:
        raise MeshlmError(
            f"--grpo.max-new-tokens {g.max_new_tokens} leaves no room for a prompt in --seq-length "
            f"{cfg.seq_length}; use --grpo.max-new-tokens {cfg.seq_length - 1} or less, or raise --seq-length"
        )
    for name, on in (("--keep-best", cfg.keep_best), ("--early-stopping-patience", cfg.early_stopping_patience)):
        if on:  # they follow eval_loss
            raise MeshlmError(f"{name} follows eval_loss; --objective grpo evaluates rewards (eval_reward): drop it")
    if cfg.eval_samples:
        raise MeshlmError(
            "--objective grpo's evaluation decodes every held-out prompt already (eval_reward): drop --eval-samples"
        )
    if g.replay and not Path(g.replay).is_file():
        raise MeshlmError(f"--grpo.replay {g.replay} is not a file: give an earlier run's completions.jsonl")
    check_grpo_layout(cfg)
    check_grpo_tiling(cfg)


GRPO_LAYOUTS = "single, ddp, zero1-3, fsdp, hsdp, tp, pp and ep (and their compositions)"


def check_grpo_layout(cfg: Config) -> None:
    """--objective grpo in a layout that generates (`grpo_layout_problem`), or one line saying why not."""
    problem = grpo_layout_problem(cfg.strategy, cfg.parallel.cp, cfg.parallel.sequence_parallel)
    if problem:
        raise MeshlmError(problem)


def grpo_layout_problem(strategy: str, cp: int, sequence_parallel: bool) -> str:
    """Why a layout's ranks cannot generate from the training model (objectives/grpo.py), or "" when they can:
    whole, FSDP-gathered (experts included), or through the pipeline's stages. `meshlm plan --objective grpo`
    offers only the layouts this passes."""
    why = {
        "--parallel.cp": (cp > 1, "each rank holds part of every sequence, and decoding extends whole ones"),
        "--parallel.sequence-parallel": (
            sequence_parallel,
            "a decoding step's one new token per row cannot split over the tensor-parallel ranks",
        ),
        "--strategy layer-split": (
            strategy == "layer-split",
            "the rollout does not decode across one process's devices",
        ),
        "--strategy dp": (strategy == "dp", "the rollout does not decode across one process's devices"),
    }
    for what, (on, reason) in why.items():
        if on:
            return f"--objective grpo generates under {GRPO_LAYOUTS}, not with {what}: {reason}; drop it"
    return ""


def check_grpo_tiling(cfg: Config) -> None:
    """A group stays whole on one rank (its normalisation is then one process's); checked again once the
    accumulation follows from --global-batch-size."""
    g = cfg.grpo
    if (cfg.micro_batch_size * cfg.grad_accum) % g.group_size:
        raise MeshlmError(
            f"--grpo.group-size {g.group_size} cannot tile a rank's {cfg.micro_batch_size * cfg.grad_accum} "
            f"completions per step (--micro-batch-size x --grad-accum): a group stays on one rank; make them a "
            f"multiple of {g.group_size}"
        )


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (scalars first, then one table per section)."""

    def lit(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'

    top, sections = [], []
    for name in _fields(Config):
        v = getattr(cfg, name)
        if dataclasses.is_dataclass(v):
            body = "\n".join(f"{k} = {lit(x)}" for k, x in dataclasses.asdict(v).items())
            sections.append(f"[{name}]\n{body}\n")
        else:
            top.append(f"{name} = {lit(v)}")
    return "\n".join(top) + "\n\n" + "\n".join(sections)
