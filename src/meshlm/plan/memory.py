"""Bytes per GPU of one pipeline stage of a layout: model states, activations, temporary buffers, CPU memory.

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

Activations follow Korthikanti et al. 2022 (sbh(34 + 5as/h) per layer at 2 bytes), redone
for what transformers' modules actually save for backward, op by op (tests/test_plan.py
measures them with saved-tensor hooks): a Llama block keeps its input, RMSNorm's fp32
intermediates, the inputs of the projections (under autocast one bf16 copy per projection,
since only weight casts are cached), q/k/v and the output of attention (the s x s scores
only without a fused kernel), and four MLP-wide tensors of the gated MLP.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshlm.layout import Degrees, Layout
from meshlm.plan.job import Job
from meshlm.plan.spec import ModelSpec

DDP_BUCKET = 25 * 2**20  # DistributedDataParallel's default bucket_cap_mb
STATE_BYTES = {"adamw": 8, "sgd": 4}  # fp32 optimizer states per parameter (AdamW: m and v; SGD: momentum)
# FSDP2's zero2 keeps whole gradients in a buffer of its own from the first micro-batch's backward to the last one's
# reduce-scatter, which frees it: beside the later micro-batches' activations (`plan --validate` measures it there)
ACCUMULATED = "whole gradients, accumulated over micro-batches (FSDP's buffer)"


@dataclass(frozen=True)
class StageShape:
    """The part of the model one rank holds: layers of a pipeline stage, split by tensor parallel."""

    layers: int
    first: bool  # holds the embedding
    last: bool  # holds final norm, LM head and loss
    in_flight: int  # micro-batches whose activations it holds at once (1F1B: pp - stage index)
    tp: int
    cp: int = 1  # context parallel: this rank computes 1/cp of every sequence's tokens (parallel/context.py)
    ep: int = 1  # expert parallel: a mixture of experts' experts split over ep x tp ranks (parallel/expert.py)

    def cp_scheme(self, spec: ModelSpec, choice: str = "auto") -> str:
        """parallel/context.py's choice (auto: ulysses where a TP rank's heads and key/value heads divide by cp,
        else ring)."""
        from meshlm.parallel.context import scheme_for

        return scheme_for(choice, spec.heads // self.tp, spec.kv_heads // self.tp, self.cp)

    def params(self, spec: ModelSpec) -> int:
        """Parameters on this rank: TP shards the blocks' matrices and the vocabulary rows of the token
        embedding and LM head (parallel/tensor.py, vocabulary parallel)."""
        block = (spec.layer_matmul_per_rank(self.tp) + spec.layer_params - spec.layer_matmul) * self.layers
        lm_head = spec.vocab * spec.hidden
        n = block + (spec.embed_params - lm_head + lm_head // self.tp if self.first else 0)
        if self.last:
            if spec.tied:  # under PP the last stage keeps its own copy of the tied weight
                n += spec.head_params + (lm_head // self.tp if not self.first else 0)
            else:
                n += spec.head_params - lm_head + lm_head // self.tp
        return n

    def matmul_params(self, spec: ModelSpec) -> int:
        return spec.layer_matmul_per_rank(self.tp) * self.layers + (spec.vocab * spec.hidden if self.last else 0)

    def active_matmul_params(self, spec: ModelSpec) -> int:
        """The matrices one token computes with on this rank: a mixture of experts' k of E (their FLOPs)."""
        return self.matmul_params(spec) - spec.inactive_params // spec.layers // self.tp * self.layers

    def float8_params(self, spec: ModelSpec, job: Job) -> int:
        """Of one block's matrices on this rank, what --float8 computes in float8: the dense projections
        (parallel/float8.py; a mixture of experts' grouped experts stay in their dtype)."""
        if job.float8 == "off":
            return 0
        return spec.layer_matmul_per_rank(self.tp) - spec.expert_layer_params // self.tp

    def whole_params(self, spec: ModelSpec) -> int:
        """Parameters this rank holds gathered where FSDP keeps them so (zero2 from forward to backward): its
        part, less other ranks' experts under expert parallel (a rank of the expert group has experts / ep x tp)."""
        experts = spec.expert_layer_params // self.tp
        return self.params(spec) - (experts - experts // self.ep) * self.layers

    def gathered_unit(self, spec: ModelSpec) -> int:
        """Parameters FSDP gathers to run one block: all of it, or under expert parallel its dense part and
        this rank's experts (each expert a unit of its own, sharded over the ranks holding the same experts)."""
        experts = spec.expert_layer_params // self.tp
        return spec.layer_params // self.tp - experts + experts // self.ep


@dataclass(frozen=True)
class Dtypes:
    """Bytes of what a block computes with, in each of meshlm's three precision set-ups:
    fp32; bf16 autocast over fp32 parameters (single, ddp, zero1): matmuls in bf16, the residual stream fp32,
    every projection casting its own input; bf16 parameters (FSDP2 mixed precision: zero2/3, hsdp; and
    engines/master_weights.py: zero1/2): the parameters computed with are bf16, so is the residual stream, and
    projections share one bf16 input."""

    compute: int
    stream: int
    casts: bool

    @classmethod
    def of(cls, job: Job, bf16_params: bool) -> "Dtypes":
        if job.precision == "fp32":
            return cls(4, 4, False)
        return cls(2, 2, False) if bf16_params else cls(2, 4, True)


def layer_activation_bytes(
    spec: ModelSpec, job: Job, tokens: int, tp: int = 1, d: Dtypes | None = None
) -> dict[str, int]:
    """What one transformer block saves for backward over `tokens` tokens, by part (bytes)."""
    d = d or Dtypes.of(job, False)
    h, a, kv, mlp, s, e = spec.hidden, spec.heads, spec.kv_heads, spec.mlp, job.seq_length, d.compute
    probs = a * s * (4 if e == 4 else 6)  # eager attention: fp32 softmax output (+ its bf16 copy)
    if spec.family == "gpt2":
        # LayerNorm saves input, mean, rstd (in the stream's dtype); q/k/v are views of the one c_attn output;
        # GPT-2's tanh GELU is Python elementwise code that keeps 5 MLP-wide tensors; dropout keeps 1-byte masks.
        norms = 2 * (d.stream * h + 2 * d.stream) + (2 * h if spec.dropout else 0)
        proj_inputs = 2 * e * h
        if d.stream == 2:
            probs = 2 * a * s  # GPT-2's softmax has no dtype=float32: with bf16 weights it stays bf16
        attn = (3 * e * h + 4 * a + e * h) if job.attention == "fused" else (4 * e * h + probs)
        if job.attention == "eager" and spec.dropout:
            attn += a * s  # the attention-probability dropout mask
        mlp_part = 5 * e * mlp
    else:
        # RMSNorm (Python, in fp32) saves its input, rsqrt and the normalised input; q/k/v and gate/up read one
        # shared input, or under autocast a bf16 copy each (activation casts are not cached).
        xhat = 2 * h if d.stream == 2 else 4 * h
        norms = 2 * (4 * h + 4 + xhat)
        proj_inputs = (3 + 2) * e * h if d.casts else 2 * e * h
        attn = (e * h + 2 * e * h * kv // a + 4 * a + e * h) if job.attention == "fused" else (4 * e * h + probs)
        mlp_part = 4 * e * mlp
        if spec.experts:  # each token through k experts (gated MLPs of their width), and its k copies dispatched
            k = spec.active_experts  # out and back (parallel/expert.py); the router's fp32 logits and probabilities
            mlp_part = k * (4 * e * spec.expert_mlp + 4 * e * h)
            norms += 3 * 4 * spec.experts
    return {
        "norms and residual": norms * tokens,
        "projection inputs": proj_inputs * tokens,
        "attention": attn * tokens // tp,
        "mlp": mlp_part * tokens // tp,
    }


def head_activation_bytes(spec: ModelSpec, job: Job, tokens: int, d: Dtypes, chunk: int = 0) -> int:
    """Final norm, LM head input, log-softmax output (the loss upcasts logits to fp32) and the int64 labels. A
    chunked head (`chunk` tokens, parallel/loss.py) keeps no logits; fused (fused_loss) it keeps the gradient of
    its input (the hidden's dtype) in place of the input itself."""
    h = spec.hidden
    if spec.family == "gpt2":
        norm = d.stream * h + 2 * d.stream
    else:
        norm = 4 * h + 4 + (2 * h if d.stream == 2 else 4 * h)
    return (norm + d.compute * h + (0 if chunk else 4 * spec.vocab) + 8) * tokens


def fused_loss(chunk: int, stage: StageShape) -> bool:
    """Whether the chunked loss is the fused one (parallel/loss.py _FusedChunkedLoss: gradients made in forward):
    a plain head weight; under tensor parallel (a DTensor weight) the chunks are checkpointed instead."""
    return bool(chunk) and stage.tp == 1


def _head_parts(
    act: Activations, spec: ModelSpec, job: Job, stage: StageShape, tokens: int, d: Dtypes, grad_is_state: bool
) -> int:
    """The last stage's head parts of the peak (into act.parts); returns the loss's transient at the start of
    backward: the whole log-probabilities' and logits' gradients, or with a chunked head one chunk's logits,
    fp32 log-probabilities and gradient (recomputed in backward), or fused its logits and log-probabilities
    (made in forward, beside the kept fp32 weight gradient, unless that is the weight's gradient itself:
    `grad_is_state`)."""
    chunk = loss_chunk(spec, job, stage, tokens)
    act.parts["head"] = head_activation_bytes(spec, job, tokens, d, chunk)
    if fused_loss(chunk, stage):
        act.parts["head"] += (d.stream - d.compute) * spec.hidden * tokens
        if not job.lora_r and not grad_is_state:  # under LoRA the head's weight is frozen: no gradient is made
            act.parts["head weight gradient (fused loss)"] = 4 * spec.vocab * spec.hidden
        return (d.compute + 4) * spec.vocab * chunk
    if not stage.first and not chunk:
        # A pipeline's last stage returns its logits to the schedule, which keeps them (and the loss's fp32
        # copy) referenced until the micro-batch's backward: one fp32 logits tensor more than the whole model
        # holds (measured by `plan --validate`: the last stage's peak is short by that much without it).
        act.parts["logits held by the schedule"] = 4 * spec.vocab * tokens
    return 3 * 4 * spec.vocab // stage.tp * chunk if chunk else 2 * 4 * spec.vocab * tokens


def loss_chunk(spec: ModelSpec, job: Job, stage: StageShape, tokens: int) -> int:
    """Tokens per chunk of the LM head's loss as meshlm decides it (parallel/apply.py chunked_loss), 0: whole
    (DPO always: it reads the log-probabilities)."""
    from meshlm.parallel.loss import chunk_tokens

    chunked = stage.last and job.objective == "sft"
    fused_hidden = spec.hidden if stage.tp == 1 else 0
    return chunk_tokens(job.chunked_loss, spec.vocab // stage.tp, tokens, fused_hidden) if chunked else 0


def _offloaded(act: Activations, job: Job, blocks: int, one: int) -> int:
    """--activation-offload (parallel/offload.py): the blocks' saved activations wait in host memory; the GPU
    holds the block computing and the one being copied."""
    if not job.activation_offload or blocks <= 2 * one:
        return blocks
    act.host = blocks - 2 * one
    return 2 * one


def embedding_activation_bytes(spec: ModelSpec, job: Job, batch: int, d: Dtypes) -> int:
    """Input ids (int64) and what the positions add: rotary cos/sin (shared by all blocks) or position ids."""
    s = job.seq_length
    pos = 2 * d.stream * s * spec.head_dim if spec.family == "llama" else 8 * s
    return 8 * batch * s + pos + (spec.hidden * batch * s if spec.dropout else 0)


@dataclass
class Activations:
    parts: dict[str, int] = field(default_factory=dict)  # what is stored at the peak
    transient: int = 0  # freed-soon buffers at the peak
    peak: int = 0
    per_layer: int = 0  # one block, one micro-batch, without checkpointing
    per_layer_ckpt: int = 0  # the same with activation checkpointing
    host: int = 0  # saved activations offloaded to host memory (--activation-offload)


def activations(
    spec: ModelSpec,
    job: Job,
    stage: StageShape,
    batch: int,
    ac: bool,
    bf16_params: bool,
    reduce_input: int = 0,
    head_grad_is_state: bool = False,
) -> Activations:
    """Peak activation memory of a stage running micro-batches of `batch` sequences.

    Without checkpointing the peak is everything stored plus the larger of two transients: the start of
    backward (grad of the log-probabilities and of the logits, 2 x 4V per token) or a block's backward
    workspace (~ (mlp + 2h) fp32 per token). With checkpointing the blocks keep only their inputs and the
    peak is either the end of forward or the backward of one recomputed block: its activations plus
    gradients of two MLP-wide tensors and of the residual stream. Under autocast over fp32 parameters the
    bf16 copies of the weights count too: autocast caches them until the forward leaves it.
    `reduce_input`: FSDP2 under bf16 casts a unit's gradients to fp32 for its reduce-scatter while the next
    block runs its backward (measured: without it zero3's peak at micro-batch 1 was 0.84 of the prediction).
    `head_grad_is_state`: the fused loss's fp32 head-weight gradient becomes the weight's gradient (a state).
    """
    d = Dtypes.of(job, bf16_params)
    tokens = batch * job.seq_length // stage.cp  # context parallel: this rank's part of each sequence
    layer = sum(layer_activation_bytes(spec, job, tokens, stage.tp, d).values())
    if (
        stage.cp > 1 and stage.cp_scheme(spec, job.cp_attention) == "allgather"
    ):  # attention saves the whole sequence's k and v
        layer += 2 * d.compute * spec.kv_heads * spec.head_dim // stage.tp * tokens * (stage.cp - 1)
    ckpt = d.stream * spec.hidden * tokens  # a checkpointed block keeps its input
    act = Activations(per_layer=layer, per_layer_ckpt=ckpt)
    n = stage.in_flight
    if stage.first:
        act.parts["embedding"] = n * embedding_activation_bytes(spec, job, batch, d) // stage.cp
    blocks = n * stage.layers * (ckpt if ac else layer)
    act.parts["blocks"] = _offloaded(act, job, blocks, ckpt if ac else layer)
    logits_grads = _head_parts(act, spec, job, stage, tokens, d, head_grad_is_state) if stage.last else 0
    if d.casts:
        act.parts["autocast bf16 weights"] = 2 * stage.matmul_params(spec)
    stored = sum(act.parts.values())
    workspace = (spec.mlp // stage.tp + 2 * spec.hidden) * 4 * tokens
    if not ac:
        # a block's backward while the block after it (head gone, its activations freed) is reduced
        reducing = stored - _head(act) - n * layer + reduce_input + workspace
        act.transient = max(logits_grads, workspace, reducing - stored)
        act.peak = stored + act.transient
        return act
    block_bwd = layer + (2 * d.compute * spec.mlp // stage.tp + d.stream * spec.hidden) * tokens
    if d.casts:
        block_bwd += 2 * spec.layer_matmul_per_rank(stage.tp)
    backward = stored - _head(act) - act.parts.get("autocast bf16 weights", 0) + block_bwd
    act.transient = max(logits_grads, backward + reduce_input - stored)
    act.peak = stored + act.transient
    return act


def _head(act: Activations) -> int:
    """What the head holds at the peak, freed once its backward has run."""
    return act.parts.get("head", 0) + act.parts.get("head weight gradient (fused loss)", 0)


@dataclass
class Memory:
    """Per GPU (one rank of the worst stage) and per CPU rank under offload; all in bytes."""

    states: dict[str, int]
    temp: dict[str, int]
    act: Activations
    cpu: int = 0
    step: int = 0  # the optimizer step's temporaries (foreach AdamW's copy), beside the states alone
    retained: int = 0  # CPU ranks: activation bytes glibc's heap still holds at the step (heap_retained)

    @property
    def gpu_total(self) -> int:
        """The larger of forward/backward's peak and the optimizer step's (activations freed by then; on CPU
        ranks the heap keeps them resident beside the step's temporaries)."""
        states = sum(self.states.values())
        return max(states + sum(self.temp.values()) + self.act.peak, states + self.step + self.retained)


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
) -> Memory:
    """`shard` is the number of ranks that share one copy of the sharded states (dp for zero1/2/3, K for hsdp).
    Under pipeline parallelism (`pipelined`) FSDP keeps a stage's parameters gathered for the whole step
    (parallel/apply.py: a stage runs several forwards before their backwards)."""
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
        return Memory(states, temp, act, act.host, step)
    if strategy in ("single", "ddp"):
        states = {"parameters": psi * pb, "gradients": psi * gb, "optimizer": psi * ob}
    elif strategy == "zero1":
        states = {"parameters": psi * pb, "gradients": psi * gb, "optimizer": psi * ob // n}
    elif strategy == "zero2" and not pipelined:  # whole parameters (compute dtype) fwd to bwd, the paper's 2Ψ
        states = {"parameters": stage.whole_params(spec) * half, "gradients": psi * gb // n, "optimizer": psi * ob // n}
    else:  # zero3 / hsdp (and zero2 under PP): FSDP2 keeps only shards between steps
        states = {"parameters": psi * pb // n, "gradients": psi * gb // n, "optimizer": psi * ob // n}
    if job.lora_r:
        states = lora_states(spec, stage, strategy, n, job.lora_r, half, job.lora_target_names, job.lora_base_bytes)
    elif strategy in ("single", "ddp"):  # FSDP reduce-scatters the replicated embedding grad to the weight's shards
        states["gradients"] += replicated_embedding_grad(spec, stage) * gb // n
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
    act = activations(spec, job, stage, batch, ac, fsdp, reduce_input, _head_grad_is_state(strategy, dp, stage, fsdp))
    step = _dtensor_step(job, stage, strategy, states) if not offload else 0
    return Memory(states, temp, act, cpu + act.host, step, heap_retained(spec, job, stage, act, batch) if step else 0)


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

    glibc serves buffers under host_memory.STEADY (4 MiB) from its heap, which keeps its high-water mark
    (host_memory.py: so that each step reuses the last one's buffers), and gives every larger buffer a mapping
    of its own. A block's activations (per-token rows of at most the MLP width) are such small buffers at
    short sequences; the step's foreach copy of the second moments (weight-sized tensors) is mapped afresh, so
    it comes on top of the heap's activation peak instead of reusing it as a GPU's caching allocator does.
    Measured on 4 CPU ranks, ep 4 of benchmarks/moe.py (benchmarks/rss_phases.py with glibc's mallinfo2): at
    the step 269 MiB of heap (186 in use, 83 free) beside 478 MiB mapped. The LM head's logits leave the heap
    where one vocabulary-wide tensor is at least the threshold."""
    from meshlm.host_memory import STEADY

    if not job.cpu_ranks:
        return 0
    tokens = batch * job.seq_length // stage.cp
    if tokens * max(spec.mlp, spec.expert_mlp, spec.hidden) // stage.tp * 4 >= STEADY:
        return 0  # a block's activations are mapped buffers of their own, returned when freed
    if stage.last and tokens * spec.vocab // stage.tp * 4 >= STEADY:
        return act.peak - act.transient - act.parts.get("head", 0) - act.parts.get("logits held by the schedule", 0)
    return act.peak


def foreach_adamw_copy(job: Job, owned: int) -> int:
    """Bytes of the fp32 copy foreach AdamW makes of a parameter group's second moments at the step (torch's
    _multi_tensor_adam: sqrt(exp_avg_sq)) for the `owned` elements it steps, nearly all in the matrices' group.
    meshlm's AdamW runs foreach where parameters are DTensors (FSDP, TP, ep: engines/base.py adamw_impl) and
    over the masters (master_weights.py); fused (no copy) elsewhere."""
    return 4 * owned if job.optimizer == "adamw" else 0


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
    float8 = stage.float8_params(spec, job) * (half - 1) if job.float8 == "tensorwise" else 0  # gathered in 1 byte
    if pipelined:  # gathered once per step, gradients reduce-scattered once after the last micro-batch
        gathered = psi - (whole - unit) * stage.layers
        temp["stage parameters, gathered for the whole step"] = gathered * half - float8 * stage.layers
        temp["unsharded stage gradients, accumulated over micro-batches"] = (
            gathered + replicated_embedding_grad(spec, stage)
        ) * 4
    elif strategy == "zero2":
        temp["fp32 parameter shards"] = psi * pb // n  # the master copy the optimizer updates
        if accumulating:  # FSDPEngine.no_sync: whole gradients until the last micro-batch's reduce-scatter
            temp[ACCUMULATED] = stage.whole_params(spec) * gb
    else:  # the unit computing + the one prefetched
        temp["gathered units"] = (max(root, unit) + unit) * half - (float8 if root > unit else 2 * float8)
    if not pipelined:
        temp["unsharded unit gradients"] = max(unit, root) * 4  # reduce-scatter input of one unit
    reduce_input = 0
    if not pipelined and job.precision == "bf16" and stage.layers:
        reduce_input = 4 * max(unit, root)
        temp["unsharded unit gradients"] = reduce_input // 2  # bf16; their fp32 copy is in the activation peak
    return temp, reduce_input


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


def lora_params(spec: ModelSpec, r: int, tp: int = 1, targets: tuple[str, ...] = ()) -> int:
    """Adapter parameters of one block on one TP rank on its linear layers (parallel/lora.py: `targets`, or by
    default q/k/v/o and, where the blocks have a dense one, the MLP projections). Column-wise base: A (r x in)
    whole, B (out x r) split; row-wise base: A split, B whole."""
    h, kv = spec.hidden, spec.kv_heads * spec.head_dim
    colwise = [("q_proj", h, h), ("k_proj", h, kv), ("v_proj", h, kv)]  # (name, in, out)
    rowwise = [("o_proj", h, h)]
    if spec.family == "gpt2":  # fused c_attn, c_fc; c_proj twice (attention and MLP)
        colwise, rowwise = [("c_attn", h, 3 * h), ("c_fc", h, spec.mlp)], [("c_proj", h, h), ("c_proj", spec.mlp, h)]
    elif not spec.experts:  # a mixture of experts' MLP is its experts (expert_adapter_params)
        colwise += [("gate_proj", h, spec.mlp), ("up_proj", h, spec.mlp)]
        rowwise += [("down_proj", spec.mlp, h)]
    kept = lambda name: not targets or name in targets  # noqa: E731
    return sum(r * i + r * o // tp for n, i, o in colwise if kept(n)) + sum(
        r * i // tp + r * o for n, i, o in rowwise if kept(n)
    )


# a mixture of experts' grouped weights (transformers' experts module) by name: (in, out) of one expert's matrix
def _expert_weight_widths(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    return {"gate_up_proj": (spec.hidden, 2 * spec.expert_mlp), "down_proj": (spec.expert_mlp, spec.hidden)}


def expert_adapter_params(spec: ModelSpec, r: int, targets: tuple[str, ...], layers: int) -> int:
    """Adapters on the experts' grouped weights of `layers` blocks (--lora.targets gate_up_proj,down_proj: peft's
    target_parameters, an r-wide A and B per expert). Not split by tp or ep: they stay whole in their block,
    sharded by FSDP over every data-parallel rank (parallel/expert.py _local_params)."""
    if not spec.experts or not spec.expert_mlp:
        return 0
    widths = _expert_weight_widths(spec)
    moe_experts = spec.expert_params // (3 * spec.hidden * spec.expert_mlp)  # experts over all MoE layers
    per_expert = sum(r * (i + o) for t, (i, o) in widths.items() if t in targets)
    return moe_experts * per_expert * layers // spec.layers


def lora_states(
    spec: ModelSpec,
    stage: StageShape,
    strategy: str,
    n: int,
    r: int,
    half: int,
    targets: tuple[str, ...] = (),
    base_bytes: int = 4,
) -> dict[str, int]:
    """Model states under LoRA: the frozen base in `base_bytes` a parameter (--lora.base-dtype; no gradients, no
    optimizer states), sharded as the layout shards parameters; fp32 adapters with fp32 gradients and AdamW
    states, sharded the same way."""
    base = stage.params(spec)
    adapters = lora_params(spec, r, stage.tp, targets) * stage.layers
    adapters += expert_adapter_params(spec, r, targets, stage.layers)
    shard = 1 if strategy in ("single", "ddp", "zero1") else n
    frozen = base * half if strategy == "zero2" else base * base_bytes // shard  # zero2: gathered fwd to bwd
    return {
        "frozen parameters": frozen,
        "adapters": adapters * 4 // shard,
        "gradients": adapters * 4 // (1 if shard == 1 else n),
        "optimizer": adapters * 8 // (n if strategy == "zero1" else shard),
    }


def startup_bytes(
    spec: ModelSpec, stage: StageShape, shard: int, pretrained: bool, engine: str = "", owners: int = 1
) -> int:
    """Host bytes one rank peaks at while starting (models/materialize.py): the model is built on the meta
    device (nothing), then this rank's fp32 parameters are allocated (its stage, TP and FSDP shards) and
    filled one tensor at a time. A random init draws each full tensor on the CPU before keeping its slice,
    so the largest tensor of its stage (the embedding or LM head on the first and last, else an MLP matrix)
    comes on top; pretrained weights are read as slices.
    The engine built next adds (`plan --simulate` measured both): "ddp" its gradient buckets (fp32, the size
    of the parameters); "masters" (bf16 zero1/zero2) the fp32 masters of the 1/`owners` it owns, cloned
    before the parameters are cast to bf16 one at a time."""
    own = stage.params(spec) * 4 // max(shard, 1)
    vocab = spec.vocab * spec.hidden if stage.first or stage.last else 0
    block = min(spec.hidden * max(spec.mlp, spec.hidden), spec.layer_matmul) if stage.layers else 0
    largest = 0 if pretrained else max(vocab, block) * 4
    if engine == "masters":
        return own + own // owners + largest
    return own + max(largest, own if engine == "ddp" else 0)
