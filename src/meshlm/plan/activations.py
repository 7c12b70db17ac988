"""Bytes of activations one pipeline stage of a layout holds at its peak.

Activations follow Korthikanti et al. 2022 (sbh(34 + 5as/h) per layer at 2 bytes), redone
for what transformers' modules actually save for backward, op by op (tests/test_plan.py
measures them with saved-tensor hooks): a Llama block keeps its input, RMSNorm's fp32
intermediates, the inputs of the projections (under autocast one bf16 copy per projection,
since only weight casts are cached), q/k/v and the output of attention (the s x s scores
only without a fused kernel), and four MLP-wide tensors of the gated MLP.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshlm.plan.job import Job
from meshlm.plan.shape import Dtypes, StageShape
from meshlm.plan.spec import ModelSpec


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
