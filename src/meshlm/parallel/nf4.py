"""QLoRA's frozen base (--lora.quantize nf4): the block projections' weights stored as NF4, torchao's
NF4Tensor (the QLoRA paper's 4-bit NormalFloat), dequantised per layer to the compute dtype.

The format, with torchao's defaults: every run of 64 consecutive values (row-major) is divided by its absmax
and rounded to the nearest of 16 NormalFloat codes (4 bits each); the absmaxes are double-quantised: the mean
of all of them is subtracted, then every run of 256 is scaled to int8 by a factor of its own. 4 bits plus
8/64 for the scales, plus one fp32 factor per 16384 values: about 4.13 bits a parameter.

Every piece of it except that one mean is local to a group of 64 x 256 = 16384 consecutive values. So a
weight whose dim-0 slices hold whole groups quantises slice by slice into exactly the slices of its whole
quantisation once every slice uses the whole weight's mean: each rank sums its slice's absmaxes in float64
(exact for fp32 inputs, so the sum does not depend on where the rows were split), the ranks sharding the weight
all-reduce the sums, and all divide by the whole count. One process, ddp and zero2/zero3/fsdp/hsdp therefore
compute with bitwise the same weights; so does a pipeline stage, which holds its own blocks' weights whole (or under
FSDP its rows of them, the sums all-reduced over its own shard group). (torchao's own `to_nf4` takes the fp32 mean
of the whole tensor: the same up to the mean's last bit.)

The flow: `quantize_model` swaps the frozen block projections' weights, still on the meta device, for meta NF4
tensors (after the initial weights' twin is taken, so values are drawn in fp32 as always); FSDP2 then shards
them as NF4 (dim-0 chunks of the payload; its all-gather moves the 4-bit payload through NF4Tensor's
fsdp_pre_all_gather / fsdp_post_all_gather); models/materialize.py fills each rank's part through `staging`
and `fill`, from the seeded initial weights or --pretrained slices as they are read. The layers become
`NF4Linear`: forward and backward dequantise the weight to the compute dtype, a chunk at a time; the weight gets no
gradient. DDP leaves the NF4 weights out of its start-up broadcast (every rank filled the same ones). Export folds
the adapters into the dequantised base (`dequantised_base`).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshlm import compat
from meshlm.config import Config, nf4_base
from meshlm.errors import MeshlmError

BLOCK, SCALER_BLOCK = 64, 256  # torchao's defaults: values per absmax, absmaxes per int8 factor
GROUP = BLOCK * SCALER_BLOCK  # the values one quantisation is local to
LAYOUTS = "--strategy single, ddp, zero3, fsdp or hsdp (zero2 with fp32 compute), each also under --parallel.pp"
# bytes of codes (2 values each) dequantised at a time, and rows of 64 values quantised at a time: ~0.7 MB of
# scratch; measured on CPU, 16 KiB chunks dequantise a 1024 x 2816 projection faster than 64 KiB or 1 MiB ones
CHUNK = 1 << 14
PAYLOAD = ("quantized_data", "quantized_scalers", "quantization_factor")  # what FSDP2 shards and all-gathers


def enabled(cfg: Config) -> bool:
    return nf4_base(cfg.lora)


def _module():
    found = compat.nf4_module()
    if found is None:
        raise MeshlmError("--lora.quantize nf4 needs torchao's NF4 tensor: pip install 'meshlm[qlora]'")
    return found


def is_nf4(t) -> bool:
    loaded = compat.nf4_loaded()
    return loaded is not None and isinstance(t, loaded.NF4Tensor)


def quantized_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The nn.Linear layers inside the transformer blocks (peft's base layers, not its adapters): the layers
    whose weights NF4 holds. The embedding and the LM head keep the base's dtype."""
    from meshlm.parallel.lora import is_adapter

    inside = {id(m) for block in _blocks(model) for m in block.modules()}
    return [
        (name, m)
        for name, m in model.named_modules()
        if id(m) in inside and type(m) in (nn.Linear, NF4Linear) and not is_adapter(name + ".")
    ]


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks: its ModuleList of them, or the ModuleDict a pipeline stage keeps of them once the rest is
    dropped (models/stages.py keep_only: generation splits before it fills)."""
    from meshlm.models.families import decoder, family, transformer_blocks

    layers = family(model.config).layers
    kept = getattr(decoder(model), layers, None) if layers else None
    return list(kept.values()) if isinstance(kept, nn.ModuleDict) else list(transformer_blocks(model))


# ---------------------------------------------------------------- before any rank starts


def check(cfg: Config, layout, model_config) -> None:
    """What --lora.quantize nf4 needs, in one line: torchao, a layout that holds NF4 shards, and projections whose
    weights (and each rank's dim-0 slice of them) hold whole groups of 64 x 256 values."""
    if not enabled(cfg):
        return
    _module()
    if cfg.float8 != "off":
        raise MeshlmError(f"--lora.quantize nf4 and --float8 {cfg.float8} both requantise the projections: drop one")
    if problem := layout_problem(layout):
        raise MeshlmError(
            f"--lora.quantize nf4 holds its 4-bit weights under {LAYOUTS}, without tensor, context or expert "
            f"parallel or --cpu-offload; not {problem}"
        )
    from transformers import AutoModelForCausalLM

    shards = layout.degrees.dp_shard if layout.sharded else 1
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    layers = quantized_layers(model)
    if not layers:
        raise MeshlmError(
            f"--lora.quantize nf4 quantises the blocks' nn.Linear projections; model family "
            f"'{model_config.model_type}' has none (its projections are Conv1D): train it with --lora.quantize none"
        )
    for name, m in layers:
        rows, cols = m.weight.shape
        whole = f"--lora.quantize nf4 quantises groups of {BLOCK} x {SCALER_BLOCK} = {GROUP} values; {name}.weight"
        if rows * cols % GROUP:
            raise MeshlmError(
                f"{whole} has shape [{rows}, {cols}], {rows * cols} values: not a multiple of {GROUP}; train this "
                f"model with --lora.quantize none"
            )
        if rows % shards or rows // shards * cols % GROUP:
            raise MeshlmError(
                f"{whole} ([{rows}, {cols}]) split by rows over {shards} ranks does not leave each rank whole "
                f"groups: use fewer shard ranks (--strategy hsdp --parallel.shard-size) or --strategy ddp"
            )


def layout_problem(layout) -> str:
    """What of `layout` cannot hold NF4 weights ("" when it can): the one rule train and plan apply."""
    d = layout.degrees
    for degree, option in ((d.tp, "tp"), (d.cp, "cp"), (layout.ep, "ep")):
        if degree > 1:
            return f"--parallel.{option} {degree}"
    if layout.offload:
        return "--cpu-offload"
    if layout.engine not in ("single", "ddp", "fsdp", "pipeline"):  # a stage holds whole weights, or FSDP's rows
        precision = " with --mixed-precision bf16" if layout.engine == "masters" else ""
        return f"--strategy {layout.strategy}{precision}"
    return ""


# ---------------------------------------------------------------- quantisation


@functools.cache
def _codes() -> torch.Tensor:
    """torchao's 16 NF4 code values (fp32), as its NF4Tensor.from_tensor tables them."""
    return _module().NF4Tensor.from_tensor(torch.ones(GROUP), BLOCK, SCALER_BLOCK).nf4


def block_absmax(values: torch.Tensor) -> torch.Tensor:
    return values.reshape(-1, BLOCK).abs().amax(1)


def mean_parts(values: torch.Tensor) -> torch.Tensor:
    """[sum of the block absmaxes, their count] in float64: exact, so summing them over slices in any order
    gives the whole weight's."""
    absmax = block_absmax(values).double()
    return torch.stack([absmax.sum(), torch.tensor(float(absmax.numel()), dtype=torch.float64, device=absmax.device)])


def quantize(values: torch.Tensor, mean: torch.Tensor):
    """`values` (2-D fp32, a multiple of 16384 values) as an NF4Tensor whose absmaxes are centred on `mean`
    (the whole weight's mean absmax; torchao's `to_nf4` takes the tensor's own). torchao's NF4Tensor.from_tensor
    with that one change, bit for bit; its nearest-code search is replaced by one that needs no 16 floats of
    scratch per value (64 MiB a million values: more than a rank's bf16 slice of a large projection)."""
    ao = _module()
    absmax = block_absmax(values)
    centred = (absmax - mean).view(-1, SCALER_BLOCK)
    factor = 256 / (2 * centred.abs().amax(1))
    scalers = (centred * factor[:, None]).round().clamp(-128, 127).flatten().to(torch.int8)
    codes = _codes().to(values.device)
    index = _nearest(values.reshape(-1, BLOCK) / absmax[:, None], codes).flatten()
    data = (index[::2] << 4 | index[1::2]).to(torch.uint8)  # two codes a byte, the first in the high half
    meta = ao.SubclassTensorArgs(values.size(), values.stride(), 0, values.dtype, values.device, False)
    return ao.NF4Tensor(meta, BLOCK, absmax.numel(), SCALER_BLOCK, scalers, factor.contiguous(), mean, data, codes)


def _nearest(scaled: torch.Tensor, codes: torch.Tensor, rows: int = CHUNK // 32) -> torch.Tensor:
    """The index of the code nearest each value (uint8), the first on a tie (torchao's argmin over all 16). The
    midpoints place a value between two codes; rounding can put it one off, so the nearest of that code and its
    two neighbours is taken, whose distances are computed as torchao computes them."""
    mids = (codes[1:] + codes[:-1]) / 2
    out = torch.empty(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for start in range(0, scaled.shape[0], rows):  # rows of 64 values: bounded scratch
        x = scaled[start : start + rows]
        k = torch.bucketize(x, mids)
        window = (k.unsqueeze(-1) + torch.arange(-1, 2, device=x.device)).clamp(0, codes.numel() - 1)
        best = (x.unsqueeze(-1) - codes[window]).abs().argmin(-1, keepdim=True)
        out[start : start + rows] = window.gather(-1, best).squeeze(-1)
    return out


def _empty(shape: torch.Size):
    """A meta NF4 tensor of `shape`: what FSDP2 shards before any rank has values."""
    ao, meta = _module(), torch.device("meta")
    n = shape[0] * shape[1]
    tensor_meta = ao.SubclassTensorArgs(shape, (shape[1], 1), 0, torch.float32, meta, False)
    return ao.NF4Tensor(
        tensor_meta,
        BLOCK,
        n // BLOCK,
        SCALER_BLOCK,
        torch.empty(n // BLOCK, dtype=torch.int8, device=meta),
        torch.empty(n // GROUP, device=meta),
        torch.empty((), device=meta),
        torch.empty(n // 2, dtype=torch.uint8, device=meta),
        torch.empty(16, device=meta),
    )


class NF4Linear(nn.Linear):
    """An nn.Linear whose weight is NF4: dequantised in forward and again in backward (`_Dequantised`), never kept."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _Dequantised.apply(x, self.weight)
        return out if self.bias is None else out + self.bias


class _Dequantised(torch.autograd.Function):
    """x @ W.T with W dequantised to the compute dtype (autocast's where it is on), the NF4 weight saved for backward,
    not its dequantised copy. torchao's LinearNF4 does the same through a dequantisation whose scratch is ~20 bytes
    a value (int64 code indices, fp32 halves stacked): this one's is the output and a bounded chunk."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(weight)
        return torch.nn.functional.linear(x, dequantize(weight, _compute_dtype(x)))

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad @ dequantize(weight, grad.dtype), None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def dequantize(weight, dtype: torch.dtype, chunk: int = CHUNK) -> torch.Tensor:
    """An NF4 weight's values in `dtype`: code value x its block's (double-dequantised) absmax in fp32, as torchao's
    get_original_weight computes them, then rounded to `dtype`; `chunk` bytes of codes at a time."""
    scales = weight.dequantize_scalers(weight.quantized_scalers, weight.quantization_factor, SCALER_BLOCK)
    data, out = weight.quantized_data, torch.empty(weight.numel(), dtype=dtype, device=weight.device)
    for start in range(0, data.numel(), chunk):  # chunk: a multiple of 32 bytes, whole blocks of 64 values
        part = data[start : start + chunk]
        index = torch.stack([part >> 4, part & 15], -1).flatten().long()
        block = scales[start * 2 // BLOCK : (start + part.numel()) * 2 // BLOCK].repeat_interleave(BLOCK)
        out[start * 2 : (start + part.numel()) * 2] = weight.nf4[index] * block
    return out.view(weight.shape)


def quantize_model(model: nn.Module, cfg: Config) -> None:
    """The block projections' frozen weights as NF4 in place: meta NF4 tensors on a meta model (filled later,
    `fill`), else quantised from their values (one process: the whole weight is here)."""
    if not enabled(cfg):
        return
    for _, m in quantized_layers(model):
        w = m.weight.detach()
        if w.is_meta:
            q = _empty(w.shape)
        else:
            values = w.float()
            parts = mean_parts(values)
            q = quantize(values, (parts[0] / parts[1]).float())
        m.weight = nn.Parameter(q, requires_grad=False)
        m.__class__ = NF4Linear  # the same module, its forward dequantising (peft keeps it as its base layer)


def dequantised_base(model: nn.Module, cfg: Config) -> None:
    """A plain model's block projections replaced, in place, by their NF4 quantisation dequantised to their dtype:
    the base an NF4 run trained on (export folds the adapters into it; generation runs it). Each weight must be
    whole here (the whole model, or a pipeline stage's or a device's whole blocks): its mean is the whole weight's."""
    if not enabled(cfg):
        return
    with torch.no_grad():
        for _, m in quantized_layers(model):
            values = m.weight.detach().float()
            parts = mean_parts(values)
            m.weight.copy_(dequantize(quantize(values, (parts[0] / parts[1]).float()), m.weight.dtype))


# ---------------------------------------------------------------- filling each rank's part


def staging(out: torch.Tensor) -> torch.Tensor:
    """Where this rank's slice of a tensor is written first: an fp32 buffer for an NF4 one, else itself."""
    return torch.empty(out.shape, dtype=torch.float32, device=out.device) if is_nf4(out) else out


def fill(out: torch.Tensor, values: torch.Tensor, param: torch.Tensor) -> None:
    """Quantise this rank's slice `values` of `param` into its NF4 local part `out`, centred on the whole
    weight's mean absmax (the sums all-reduced over the ranks that shard it)."""
    parts = mean_parts(values)
    group = _shard_group(param)
    if group is not None:
        dist.all_reduce(parts, group=group)
    q = quantize(values, (parts[0] / parts[1]).float())
    for name in PAYLOAD:  # in place: FSDP2 keeps views of them; the local part keeps the whole weight's metadata
        getattr(out, name).copy_(getattr(q, name))
    out.scaler_mean, out.nf4 = q.scaler_mean, q.nf4  # torchao's empty_like leaves these two on the meta device


def _shard_group(param: torch.Tensor):
    """The process group over which a DTensor parameter is split by rows, or None for a whole tensor."""
    if not isinstance(param, DTensor):
        return None
    dims = [i for i, p in enumerate(param.placements) if p.is_shard()]
    return param.device_mesh.get_group(dims[0]) if dims else None


def ddp_ignore(module: nn.Module) -> None:
    """Keep the NF4 weights out of DDP's start-up broadcast (its buckets take plain tensors; every rank filled
    the same weights)."""
    names = [n for n, p in module.named_parameters() if is_nf4(p)]
    if names:
        compat.ddp_ignore(module, names)
