"""Bytes per GPU of one pipeline stage of a layout: model states, temporary buffers, CPU memory, and the
activations beside them.

Model states follow the ZeRO paper (Rajbhandari et al. 2019) with meshlm's byte widths.
ddp, zero3 and hsdp keep the fp32 master weights as the parameters even under bf16 (FSDP2
MixedPrecisionPolicy / autocast cast them on the fly), fp32 gradients and two fp32 AdamW states:
4 + 4 + 8 bytes per parameter, the paper's 2 + 2 + 12 for mixed precision; the bf16 copies appear
as gathered FSDP units (temporary buffers) or as autocast's weight cache (counted with the
activations: it lives exactly as long as they do). zero1 and zero2 under bf16 (without TP, PP or
offload: engines/master_weights.py) are the paper's own: bf16 parameters and gradients, the fp32
master with the AdamW moments (12 bytes) on its owner rank only. Each stage divides what it shards
by the data-parallel ranks N it shards over:

    ddp 4+4+8   zero1 4+4+8/N (bf16: 2+2+12/N)   zero2 h+(4+8)/N (bf16: 2+(2+12)/N)   zero3 (4+4+8)/N
    hsdp with shard size K (4+4+8)/K   offload: none on the GPU

ZeRO-2 is counted where it holds the most, as the paper does: the whole parameters in their compute
dtype (h = 2 bytes under bf16, 4 in fp32) from forward to backward, with the gradient and optimizer
shards; under FSDP2 (fp32, or with TP) its fp32 parameter shards are a temporary buffer beside them.

Activations are counted in plan/activations.py, LoRA's states in plan/lora_memory.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshlm.layout import Degrees, Layout
from meshlm.plan.activations import Activations, activations
from meshlm.plan.grpo_cost import generation_bytes, logp_chunk
from meshlm.plan.job import Job
from meshlm.plan.lora_memory import NF4_BYTES, job_lora_states, lora_block_adapters, nf4_dequantised, nf4_projections
from meshlm.plan.shape import StageShape
from meshlm.plan.spec import ModelSpec

DDP_BUCKET = 25 * 2**20  # DistributedDataParallel's default bucket_cap_mb
STATE_BYTES = {"adamw": 8, "sgd": 4}  # fp32 optimizer states per parameter (AdamW: m and v; SGD: momentum)
# FSDP2's zero2 keeps whole gradients in a buffer of its own from the first micro-batch's backward to the last one's
# reduce-scatter, which frees it: beside the later micro-batches' activations (`plan --validate` measures it there)
ACCUMULATED = "whole gradients, accumulated over micro-batches (FSDP's buffer)"
GATHERED = "whole model gathered for generation, less the units (--grpo.gather-for-generation)"


@dataclass
class Memory:
    """Per GPU (one rank of the worst stage) and per CPU rank under offload; all in bytes."""

    states: dict[str, int]
    temp: dict[str, int]
    act: Activations
    cpu: int = 0
    step: int = 0  # the optimizer step's temporaries (foreach AdamW's copy), beside the states alone
    retained: int = 0  # CPU ranks: activation bytes glibc's heap still holds at the step (heap_retained)
    gathering: int = 0  # CPU ranks: the backward prefetch's all-gather, less the states (gloo_gathering)
    freed: int = 0  # CPU ranks: gradient shards no rank holds before the step's first backward (unmade_gradients)
    unmade: int = 0  # CPU ranks: of those, the ones backward has not made yet at its peak (unmade_gradients)
    generation: dict[str, int] = field(default_factory=dict)  # GRPO's generation phase (plan/grpo_cost.py)

    @property
    def gpu_total(self) -> int:
        """The larger of forward/backward's peak and the optimizer step's (activations freed by then; on CPU
        ranks the heap keeps them resident beside the step's temporaries), and GRPO's generation phase's (its KV
        cache beside the gathered units, before the training forwards); on CPU ranks with the gradients only as far
        as they exist by then (`freed`, `unmade`)."""
        states, temp = sum(self.states.values()), sum(self.temp.values())
        generating = states - self.freed + temp + sum(self.generation.values()) if self.generation else 0
        backward = states - self.unmade
        peaks = (backward + temp + self.act.peak, states + self.step + self.retained, backward + self.gathering)
        return max(*peaks, generating)


def bytes_per_param(job: Job) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer state) bytes per parameter as meshlm keeps them."""
    return 4, 4, STATE_BYTES[job.optimizer]


def memory(
    spec: ModelSpec,
    job: Job,
    stage: StageShape,
    strategy: str,
    dp: int,
    shard: int,
    batch: int,
    ac: bool,
    offload: bool,
    pipelined: bool = False,
    accumulating: bool = False,
    decoding: int = 1,
) -> Memory:
    """`shard` is the number of ranks that share one copy of the sharded states (dp for zero1/2/3, K for hsdp).
    Under pipeline parallelism (`pipelined`) FSDP keeps a stage's parameters gathered for the whole step
    (parallel/apply.py: a stage runs several forwards before their backwards). `decoding`: GRPO's decode batches
    in flight on this rank (plan/grpo_cost.py in_flight)."""
    psi = stage.params(spec)
    pb, gb, ob = bytes_per_param(job)
    half = 2 if job.precision == "bf16" else 4  # the dtype parameters are computed (and FSDP-gathered) in
    n = max(shard, 1)
    master = master_weights(strategy, job, stage, dp, pipelined, offload)
    fsdp = strategy in ("zero2", "zero3", "hsdp") and not master
    if master:  # bf16 parameters and gradients (zero2: the owned gradients), fp32 master + moments owned
        grads = 2 * psi // n if strategy == "zero2" else 2 * psi
        states = {"parameters": 2 * psi, "gradients": grads, "optimizer": (4 + ob) * psi // n}
        temp = {"fp32 copy of the owned gradients (optimizer step)": 4 * psi // n}
        if strategy == "zero2" and accumulating:  # whole bf16 gradients until the last micro-batch's reduce
            temp["whole gradients, accumulated over micro-batches"] = 2 * psi
        if job.reference_copy:  # DPO's frozen reference: whole, bf16 as the working copies (train/dpo.py)
            states["reference"] = 2 * psi
        act = activations(spec, job, stage, batch, ac, bf16_params=True)
        step = temp["fp32 copy of the owned gradients (optimizer step)"] + foreach_adamw_copy(job, psi // n)
        return _grpo(Memory(states, temp, act, act.host, step), spec, job, stage, half, decoding)
    states = _states(spec, job, stage, strategy, n, half, pipelined)
    if job.reference_copy:  # DPO's frozen reference, split and sharded as the policy's: FSDP's shards in the dtype
        states["reference"] = psi * half // n if fsdp else psi * 4  # it gathers; else fp32 (train/dpo.py)
    cpu = 0
    if offload:
        cpu = sum(states.values())
        states = {k: 0 for k in states}

    # DDP's gradient buckets are the gradients themselves (parallel/ddp.py: gradient_as_bucket_view): no temp
    temp, reduce_input = (
        _fsdp_temp(spec, job, stage, strategy, psi, n, half, pipelined, accumulating) if fsdp else ({}, 0)
    )
    temp |= {"dequantised NF4 projection": nf4_dequantised(spec, half)} if job.nf4 else {}  # parallel/nf4.py
    act = activations(spec, job, stage, batch, ac, fsdp, reduce_input, _head_grad_is_state(strategy, dp, stage, fsdp))
    step = _dtensor_step(job, stage, strategy, states) if not offload else 0
    retained = heap_retained(spec, job, stage, act, batch) if step else 0
    gathering = gloo_gathering(spec, job, stage, temp, act, half) if "gathered units" in temp else 0
    m = _grpo(Memory(states, temp, act, cpu + act.host, step, retained, gathering), spec, job, stage, half, decoding)
    if fsdp and not pipelined:
        m.freed, m.unmade = unmade_gradients(spec, job, stage, states, n, accumulating, act, ac)
    if fsdp and not pipelined and strategy != "zero2" and m.generation and job.grpo_gather:
        # --grpo.gather-for-generation: the whole stage gathered while decoding, in place of the units
        m.generation[GATHERED] = _gathered_bytes(spec, job, stage, psi, half) - temp.get("gathered units", 0)
    return m


def _states(spec: ModelSpec, job: Job, stage: StageShape, strategy: str, n: int, half: int, pipelined: bool) -> dict:
    """Parameters, gradients and optimizer states per rank without master weights (LoRA's: job_lora_states)."""
    if job.lora_r:
        return job_lora_states(spec, job, stage, strategy, n, half)
    psi = stage.params(spec)
    pb, gb, ob = bytes_per_param(job)
    if strategy in ("single", "ddp"):
        states = {"parameters": psi * pb, "gradients": psi * gb, "optimizer": psi * ob}
    elif strategy == "zero1":
        states = {"parameters": psi * pb, "gradients": psi * gb, "optimizer": psi * ob // n}
    elif strategy == "zero2" and not pipelined:  # whole parameters (compute dtype) fwd to bwd, the paper's 2Ψ
        states = {"parameters": stage.whole_params(spec) * half, "gradients": psi * gb // n, "optimizer": psi * ob // n}
    else:  # zero3 / hsdp (and zero2 under PP): FSDP2 keeps only shards between steps
        states = {"parameters": psi * pb // n, "gradients": psi * gb // n, "optimizer": psi * ob // n}
    if strategy in ("single", "ddp"):  # FSDP reduce-scatters the replicated embedding grad to the weight's shards
        states["gradients"] += replicated_embedding_grad(spec, stage) * gb // n
    return states


def _grpo(m: Memory, spec: ModelSpec, job: Job, stage: StageShape, half: int, decoding: int) -> Memory:
    """What a GRPO step adds (plan/grpo_cost.py): its generation phase, and one chunk of the completions'
    log-probabilities beside the training phase's temporaries; other objectives' memory as it was."""
    m.generation = generation_bytes(spec, job, stage, half, decoding)
    m.temp.update(logp_chunk(spec, job, stage))
    return m


def _head_grad_is_state(strategy: str, dp: int, stage: StageShape, fsdp: bool) -> bool:
    """Whether the fused loss's fp32 head-weight gradient, made in forward, becomes the weight's gradient itself:
    where nothing else holds one (no DDP, no FSDP). DDP copies it into its bucket in the head's backward, so it is a
    second copy until then (measured: ddp x4 and cp 4 peak one [vocab x hidden] fp32 tensor above one process at
    the same tokens per rank); FSDP reduce-scatters it."""
    return not fsdp and not (strategy in ("ddp", "zero1") and dp * stage.cp > 1)


def _dtensor_step(job: Job, stage: StageShape, strategy: str, states: dict[str, int]) -> int:
    """The step's foreach copy where the parameters are DTensors (FSDP, TP, ep), over the elements this rank steps."""
    dtensors = strategy in ("zero2", "zero3", "hsdp") or stage.tp > 1 or stage.ep > 1
    return foreach_adamw_copy(job, states["optimizer"] // STATE_BYTES[job.optimizer]) if dtensors else 0


def heap_retained(spec: ModelSpec, job: Job, stage: StageShape, act: Activations, batch: int) -> int:
    """CPU ranks only (`job.cpu_ranks`): the activation bytes still resident at the optimizer step.

    glibc serves buffers under host_memory.steady (4 MiB, 1 MiB under NF4) from its heap, which keeps its
    high-water mark (host_memory.py: so that each step reuses the last one's buffers), and gives every larger
    buffer a mapping of its own. A block's activations (per-token rows of at most the MLP width) are such small
    buffers at short sequences; the step's foreach copy of the second moments (weight-sized tensors) is mapped
    afresh, so it comes on top of the heap's activation peak instead of reusing it as a GPU's caching allocator
    does.
    Measured on 4 CPU ranks, ep 4 of benchmarks/moe.py (benchmarks/rss_phases.py with glibc's mallinfo2): at
    the step 269 MiB of heap (186 in use, 83 free) beside 478 MiB mapped. The LM head's logits leave the heap
    where one vocabulary-wide tensor is at least the threshold."""
    from meshlm.host_memory import steady

    if not job.cpu_ranks:
        return 0
    tokens, threshold = batch * job.seq_length // stage.cp, steady(job.nf4)
    if tokens * max(spec.mlp, spec.expert_mlp, spec.hidden) // stage.tp * 4 >= threshold:
        return 0  # a block's activations are mapped buffers of their own, returned when freed
    if stage.last and tokens * spec.vocab // stage.tp * 4 >= threshold:
        return act.peak - act.transient - act.parts.get("head", 0) - act.parts.get("logits held by the schedule", 0)
    return act.peak


def gloo_gathering(
    spec: ModelSpec, job: Job, stage: StageShape, temp: dict[str, int], act: Activations, half: int
) -> int:
    """CPU ranks only (`job.cpu_ranks`, zero3/hsdp): the bytes beside the states while backward prefetches the
    next unit. gloo's all-gather gathers into a flat tensor of its own and then copies it into FSDP's output
    (ProcessGroupGloo.cpp; tests/unit/test_plan_cpu.py measures it), and meshlm blocks on it so that the copy
    is freed when it returns (parallel/fsdp.py BlockingAllGather): for that moment a third unit sits beside the
    unit about to run its backward and the prefetched one's flat output, and beside the stored activations,
    before that unit makes its gradients (the last unit's were reduced and freed) or its backward workspace,
    and before any NF4 projection is dequantised. Above the gradients' moment where those are small (LoRA's
    adapters); below it where the unit's own gradients are whole-sized. NCCL gathers in place: 0 on GPUs."""
    if not job.cpu_ranks or not stage.layers:
        return 0
    unit = stage.gathered_unit(spec) * half - _gathered_less(spec, job, stage, half)
    return temp["gathered units"] + unit + act.peak - act.transient


def unmade_gradients(
    spec: ModelSpec,
    job: Job,
    stage: StageShape,
    states: dict[str, int],
    n: int,
    accumulating: bool,
    act: Activations,
    ac: bool,
) -> tuple[int, int]:
    """CPU ranks only (`job.cpu_ranks`), FSDP outside a pipeline: (the gradient shards no rank holds before the
    step's first backward, those of them backward has still not made at its peak).

    The trainer frees the gradients after each step (zero_grad(set_to_none=True)), and FSDP's backward makes a
    unit's shards (its reduce-scatter's output) only once that unit's activations (as `act` stores a block's,
    checkpointed under `ac`) are freed.
    So GRPO's generation holds none of them, and where one micro-batch makes the step (no accumulation, whose
    first micro-batch leaves them whole beside the later ones' peaks) and a block's activations outweigh its
    gradient shards, backward peaks at its start (the loss's gradients, the last block's workspace, gloo's
    prefetch of the next unit) with at most the root unit's (the head) and the last block's made; where the
    shards outweigh them (short rows, a mixture of experts' blocks) it peaks near its end, with them whole.
    Measured on 4 CPU ranks (glibc's mallinfo2 per phase): on GRPO's zero3 job of benchmarks/suites.py
    (grpo-plan-memory-zero3-x4) the live bytes at the last block's backward were the parameter and optimizer
    shards, the activations and the gathered units, with no gradients; on QLoRA's (lora-nf4-base-rss) they were
    the plan's peak less the adapters' gradients.
    GPU plans keep pricing them whole: `plan --validate` measures the states and the activations apart, not
    their sum at this moment."""
    if not job.cpu_ranks:
        return 0, 0
    freed, gb = states.get("gradients", 0), bytes_per_param(job)[1]
    if accumulating or not stage.layers:
        return freed, 0
    whole = spec.layer_params // stage.tp
    unit, rest = stage.gathered_unit(spec), stage.params(spec) - whole * stage.layers
    root = rest if spec.tied else min(rest, spec.vocab * spec.hidden // stage.tp)
    unit_shards = gb * _graded(job, unit, lora_block_adapters(spec, job, stage)) // n
    if unit_shards > (act.per_layer_ckpt if ac else act.per_layer):
        return freed, 0
    return freed, max(0, freed - gb * _graded(job, root, 0) // n - unit_shards)


def _gathered_less(spec: ModelSpec, job: Job, stage: StageShape, half: int) -> int:
    """Bytes a block's unit gathers less than its parameters in the compute dtype: float8 weights in 1 byte,
    NF4 projections as NF4."""
    float8 = stage.float8_params(spec, job) * (half - 1) if job.float8 == "tensorwise" else 0
    return float8 + (int(nf4_projections(spec)[0] * (half - NF4_BYTES)) if job.nf4 and stage.layers else 0)


def foreach_adamw_copy(job: Job, owned: int) -> int:
    """Bytes of the fp32 copy foreach AdamW makes of a parameter group's second moments at the step (torch's
    _multi_tensor_adam: sqrt(exp_avg_sq)) for the `owned` elements it steps, nearly all in the matrices' group.
    meshlm's AdamW runs foreach where parameters are DTensors (FSDP, TP, ep: engines/base.py adamw_impl) and
    over the masters (master_weights.py); fused (no copy) elsewhere."""
    return 4 * owned if job.optimizer == "adamw" else 0


def _gathered_bytes(spec: ModelSpec, job: Job, stage: StageShape, psi: int, half: int) -> int:
    """The stage's parameters all gathered at once (a pipeline stage's step, GRPO's gathered decoding): its `psi`
    less other ranks' experts, in the dtype FSDP gathers."""
    whole = spec.layer_params // stage.tp if stage.layers else 0
    unit = stage.gathered_unit(spec) if stage.layers else 0
    return (psi - (whole - unit) * stage.layers) * half - _gathered_less(spec, job, stage, half) * stage.layers


def _fsdp_temp(
    spec: ModelSpec,
    job: Job,
    stage: StageShape,
    strategy: str,
    psi: int,
    n: int,
    half: int,
    pipelined: bool,
    accumulating: bool,
) -> tuple[dict[str, int], int]:
    """FSDP's temporary buffers (gathered parameters, unsharded gradients) and the bytes of the gradient
    reduce-scatter input that the activation peak holds beside them."""
    pb, gb, _ = bytes_per_param(job)
    temp: dict[str, int] = {}
    whole = spec.layer_params // stage.tp if stage.layers else 0
    unit = stage.gathered_unit(spec) if stage.layers else 0  # under ep: the block less other ranks' experts
    rest = psi - whole * stage.layers  # embedding, final norm, head: untied, the first two are units of their own
    root = rest if spec.tied else min(rest, spec.vocab * spec.hidden // stage.tp)  # (parallel/fsdp.py)
    less = _gathered_less(spec, job, stage, half)  # float8 weights, NF4 projections
    gathered = psi - (whole - unit) * stage.layers
    adapters = lora_block_adapters(spec, job, stage)  # under LoRA a unit's gradients are its block's adapters'
    unit_grads = _graded(job, max(unit, root), adapters)
    if pipelined:  # gathered once per step, gradients reduce-scattered once after the last micro-batch
        temp["stage parameters, gathered for the whole step"] = _gathered_bytes(spec, job, stage, psi, half)
        temp["unsharded stage gradients, accumulated over micro-batches"] = 4 * _graded(
            job, gathered + replicated_embedding_grad(spec, stage), adapters * stage.layers
        )
    elif strategy == "zero2":
        temp["fp32 parameter shards"] = psi * pb // n  # the master copy the optimizer updates
        if accumulating:  # FSDPEngine.no_sync: whole gradients until the last micro-batch's reduce-scatter
            temp[ACCUMULATED] = _graded(job, stage.whole_params(spec), adapters * stage.layers) * gb
    else:  # the unit computing + the one prefetched
        temp["gathered units"] = (max(root, unit) + unit) * half - (1 if root > unit else 2) * less
    if not pipelined:
        temp["unsharded unit gradients"] = unit_grads * 4  # reduce-scatter input of one unit
    reduce_input = 0
    if not pipelined and job.precision == "bf16" and stage.layers:
        reduce_input = 4 * unit_grads
        temp["unsharded unit gradients"] = reduce_input // 2  # bf16; their fp32 copy is in the activation peak
    return temp, reduce_input


def _graded(job: Job, params: int, adapters: int) -> int:
    """Elements of the gradients FSDP holds unsharded for `params` parameters: all of them, or under LoRA only the
    `adapters` among them: FSDP makes no gradient for a frozen parameter (the base, the embedding, the head)."""
    return adapters if job.lora_r else params


def replicated_embedding_grad(spec: ModelSpec, stage: StageShape) -> int:
    """Elements a TP first stage's embedding gradient holds beyond its vocabulary shard: DTensor's embedding
    backward returns it replicated (measured by `plan --validate` tp2; `plan --simulate` 405B pp8 x tp8 found
    a pipeline's FSDP accumulating it so, in fp32, until the last micro-batch)."""
    return spec.vocab * spec.hidden - spec.vocab * spec.hidden // stage.tp if stage.tp > 1 and stage.first else 0


def master_weights(strategy: str, job: Job, stage: StageShape, dp: int, pipelined: bool, offload: bool) -> bool:
    """Whether meshlm runs this layout with engines/master_weights.py: its engine, as layout.Layout names it
    (the stage's TP and cp degrees, a second pipeline stage standing for any, the ranks averaging gradients:
    `dp` counts the cp ranks)."""
    precision = "bf16" if job.precision == "bf16" else "no"
    degrees = Degrees(pp=2 if pipelined else 1, dp_replicate=max(1, dp // stage.cp), cp=stage.cp, tp=stage.tp)
    return Layout(strategy, degrees, precision, offload).engine == "masters"


def startup_bytes(
    spec: ModelSpec, job: Job, stage: StageShape, shard: int, pretrained: bool, engine: str = "", owners: int = 1
) -> int:
    """Host bytes one rank peaks at while starting (models/materialize.py): the model is built on the meta
    device (nothing), then this rank's parameters are allocated (its stage, TP and FSDP shards: `startup_part`)
    and filled one tensor at a time. A random init draws each full tensor on the CPU before keeping its slice,
    so the largest tensor of its stage (the embedding or LM head on the first and last, else an MLP matrix)
    comes on top; pretrained weights are read as slices.
    The engine built next adds (`plan --simulate` measured both): "ddp" its gradient buckets (fp32, the size
    of the parameters); "masters" (bf16 zero1/zero2) the fp32 masters of the 1/`owners` it owns, cloned
    before the parameters are cast to bf16 one at a time."""
    own = startup_part(spec, job, stage, shard)
    vocab = spec.vocab * spec.hidden if stage.first or stage.last else 0
    block = min(spec.hidden * max(spec.mlp, spec.hidden), spec.layer_matmul) if stage.layers else 0
    largest = 0 if pretrained else max(vocab, block) * 4
    if engine == "masters":
        return own + own // owners + largest
    return own + max(largest, own if engine == "ddp" else 0)


def startup_part(spec: ModelSpec, job: Job, stage: StageShape, shard: int) -> int:
    """The parameters a rank allocates before filling them: fp32, or under LoRA the frozen base as it is stored
    (--lora.base-dtype, NF4 projections: lora.py casts and nf4.py converts the meta model first) and the fp32
    adapters, plus, for an NF4 base, the fp32 slice a projection is read into before it is quantised
    (nf4.staging: one at a time)."""
    if not job.lora_r:
        return stage.params(spec) * 4 // max(shard, 1)
    strategy = "zero3" if shard > 1 else "single"  # sharded as FSDP shards, or whole: before any engine runs
    states = job_lora_states(spec, job, stage, strategy, shard, 2 if job.precision == "bf16" else 4)
    staging = nf4_projections(spec)[1] * 4 // max(shard, 1) if job.nf4 and stage.layers else 0
    return states["frozen parameters"] + states["adapters"] + staging
