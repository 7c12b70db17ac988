"""The job as the planner prices it: its view of a `meshlm train` Config (plan/options.py reads the keys), what
the estimates read and `--json` prints under "job"."""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshlm.config import to_args
from meshlm.errors import MeshlmError
from meshlm.plan.spec import ModelSpec


@dataclass(frozen=True)
class Job:
    seq_length: int = 2048
    micro_batch: int = 1  # sequences per rank per forward pass
    global_batch: int = 0  # sequences per optimizer step (0: micro_batch x GPUs)
    precision: str = "bf16"  # "fp32" or "bf16" (bf16 compute, fp32 master weights: meshlm's mixed precision)
    optimizer: str = "adamw"  # "adamw" (2 fp32 states) or "sgd" (momentum: 1 fp32 state)
    attention: str = "fused"  # "fused" (SDPA flash/memory-efficient: no s x s scores) or "eager"
    margin: float = 0.10  # GPU memory kept free for the CUDA context, allocator fragmentation, NCCL
    lora_r: int = 0  # LoRA adapter rank (0: full fine-tuning); plan/lora_memory.py lora_states
    objective: str = "sft"  # "sft", "dpo" (a reference forward per micro-batch) or "grpo" (plan/grpo_cost.py)
    precompute_reference: bool = False  # dpo: the reference's log-probabilities come from the cache
    chunked_loss: str = "auto"  # --chunked-loss: the LM head's loss over chunks of tokens (parallel/loss.py)
    activation_offload: bool = False  # --activation-offload: saved activations in host memory (parallel/offload.py)
    lora_targets: str = ""  # --lora.targets (comma-separated; "": the family's defaults, no expert weights)
    cp_attention: str = "auto"  # --parallel.cp-attention: how cp ranks attend across the split (parallel/context.py)
    float8: str = "off"  # --float8 tensorwise|rowwise: the blocks' Linear layers in float8 (parallel/float8.py)
    cpu_ranks: bool = False  # --device cpu: the ranks are CPU processes (glibc's heap: plan/memory.py heap_retained)
    lora_base: str = "auto"  # --lora.base-dtype: the frozen base's storage dtype (config.py lora_base_dtype)
    lora_quantize: str = "none"  # --lora.quantize nf4: the blocks' projections in NF4 (plan/lora_memory.py)
    grpo_group: int = 0  # grpo: --grpo.group-size, completions decoded together
    grpo_new_tokens: int = 0  # grpo: --grpo.max-new-tokens
    grpo_beta: float = 0.0  # grpo: --grpo.beta (> 0: a reference model, as DPO's)
    grpo_gather: bool = True  # grpo: --grpo.gather-for-generation (FSDP: the whole model gathered while decoding)

    @property
    def lora_target_names(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())

    @property
    def lora_base_bytes(self) -> int:
        """Bytes a frozen base parameter is stored in under LoRA (parallel/lora.py cast_base)."""
        from meshlm.config import lora_base_dtype

        return 2 if lora_base_dtype(self.lora_base, self.precision) == "bf16" else 4

    @property
    def nf4(self) -> bool:
        return bool(self.lora_r) and self.lora_quantize == "nf4"

    @property
    def reference_forward(self) -> bool:
        """DPO runs the reference's forward every step (unless precomputed), GRPO with --grpo.beta > 0: LoRA's base
        or a frozen copy."""
        if self.objective == "grpo":
            return self.grpo_beta > 0
        return self.objective == "dpo" and not self.precompute_reference

    @property
    def reference_copy(self) -> bool:
        """DPO (and GRPO with a KL term) holds a frozen copy of the model (without LoRA, whose reference is its own
        base)."""
        return self.reference_forward and not self.lora_r

    def check(self, spec: ModelSpec, world: int) -> "Job":
        from meshlm.config import CP_ATTENTION, FLOAT8_RECIPES, OBJECTIVES

        if self.precision not in ("fp32", "bf16"):
            raise MeshlmError(f"--precision must be fp32 or bf16, got {self.precision!r}")
        if self.optimizer not in ("adamw", "sgd"):
            raise MeshlmError(f"--optimizer must be adamw or sgd, got {self.optimizer!r}")
        if self.cp_attention not in CP_ATTENTION:
            raise MeshlmError(f"--cp-attention must be one of {', '.join(CP_ATTENTION)}, got {self.cp_attention!r}")
        if self.attention not in ("fused", "eager"):
            raise MeshlmError(f"--attention must be fused or eager, got {self.attention!r}")
        if self.seq_length < 1 or self.micro_batch < 1 or self.global_batch < 0:
            raise MeshlmError(
                "--seq-length and --micro-batch-size must be at least 1, --global-batch-size not negative"
            )
        if spec.max_positions and self.seq_length > spec.max_positions:
            raise MeshlmError(
                f"--seq-length {self.seq_length} is larger than {spec.name}'s {spec.max_positions} "
                f"positions; use --seq-length {spec.max_positions} or less"
            )
        if not 0 <= self.margin < 1:
            raise MeshlmError(f"--margin must be in [0, 1), got {self.margin}")
        if self.objective not in OBJECTIVES:
            raise MeshlmError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        from meshlm.config import check_chunked_loss

        check_chunked_loss(self.chunked_loss, self.objective)
        if self.float8 not in FLOAT8_RECIPES:
            raise MeshlmError(f"--float8 must be off, tensorwise or rowwise, got {self.float8!r}")
        return replace(self, global_batch=self.global_batch or self.micro_batch * world)


def job_of(cfg, attention: str, args, positions: int) -> Job:
    """The planner's view of a train Config: what the estimates read, and --json prints under "job"."""
    return Job(
        cfg.seq_length or min(2048, positions or 2048),
        cfg.micro_batch_size,
        cfg.global_batch_size,
        "bf16" if cfg.mixed_precision == "bf16" else "fp32",
        args.optimizer,
        attention,
        args.margin,
        cfg.lora.r,
        cfg.objective,
        cfg.dpo.precompute_reference,
        cfg.chunked_loss,
        cfg.activation_offload,
        cfg.lora.targets,
        cfg.parallel.cp_attention,
        float8=cfg.float8,
        cpu_ranks=getattr(args, "device", "gpu") == "cpu",
        lora_base=cfg.lora.base_dtype,
        lora_quantize=cfg.lora.quantize,
        **_grpo(cfg),
    )


def _grpo(cfg) -> dict:
    """GRPO's fields of the job (their defaults otherwise, so that other objectives' jobs are unchanged)."""
    if cfg.objective != "grpo":
        return {}
    g = cfg.grpo
    return {
        "grpo_group": g.group_size,
        "grpo_new_tokens": g.max_new_tokens,
        "grpo_beta": g.beta,
        "grpo_gather": g.gather_for_generation,
    }


def json_fields(job: Job) -> dict:
    """The job as --json prints it: GRPO's fields only in a GRPO job."""
    return {k: v for k, v in job.__dict__.items() if job.objective == "grpo" or not k.startswith("grpo_")}


def train_keys(job: Job, e) -> list[tuple[str, object]]:
    """The `meshlm train` config keys that run estimate e (the model's own come from spec.run_as)."""
    lay = e.candidate
    mbs = job.micro_batch
    keys = lay.layout.keys()
    if lay.pp > 1:
        mbs = job.micro_batch * e.micro_batches  # meshlm splits the rank's batch into pipeline micro-batches
        keys += [("parallel.micro_batches", e.micro_batches), ("parallel.schedule", "1f1b")]
    keys += [("seq_length", job.seq_length), ("micro_batch_size", mbs), ("grad_accum", e.grad_accum)]
    keys += [("mixed_precision", "bf16")] * (job.precision == "bf16")
    keys += [("activation_checkpointing", "full")] * lay.ac
    keys += [("chunked_loss", job.chunked_loss)] * (job.chunked_loss != "auto")
    keys += [("activation_offload", "true")] * job.activation_offload
    keys += [("parallel.cp_attention", job.cp_attention)] * (lay.cp > 1 and job.cp_attention != "auto")
    keys += [("attention", "sdpa")] * (lay.cp > 1 and job.cp_attention == "allgather")  # a kernel taking a mask
    keys += [("objective", job.objective)] * (job.objective != "sft")
    keys += [("dpo.precompute_reference", "true")] * (job.objective == "dpo" and job.precompute_reference)
    keys += _grpo_keys(job)
    keys += [("lora.r", job.lora_r)] * bool(job.lora_r)
    keys += [("lora.targets", job.lora_targets)] * bool(job.lora_r and job.lora_targets)
    keys += [("lora.base_dtype", job.lora_base)] * bool(job.lora_r and job.lora_base != "auto")
    keys += [("lora.quantize", job.lora_quantize)] * bool(job.lora_r and job.lora_quantize != "none")
    keys += [("float8", job.float8)] * (job.float8 != "off")
    return keys + [("cpu_offload", "true")] * lay.offload


def _grpo_keys(job: Job) -> list[tuple[str, object]]:
    if job.objective != "grpo":
        return []
    keys = [("grpo.group_size", job.grpo_group), ("grpo.max_new_tokens", job.grpo_new_tokens)]
    keys += [("grpo.gather_for_generation", "false")] * (not job.grpo_gather)
    return keys + [("grpo.beta", job.grpo_beta)] * (job.grpo_beta > 0)


def command(spec: ModelSpec, job: Job, cluster, e) -> list[str]:
    """The `meshlm train` command line that runs layout e (on the first node; others add --node-rank)."""
    cmd = ["meshlm", "train", "--nproc", str(cluster.gpus_per_node)]
    if cluster.nodes > 1:
        cmd += ["--nnodes", str(cluster.nodes), "--node-rank", "0", "--rdzv-endpoint", "HOST:29500"]
    return cmd + list(spec.run_as) + to_args(train_keys(job, e))
