"""meshlm's own tensor-parallel styles, beyond torch's ColwiseParallel / RowwiseParallel (parallel/tensor.py
applies them by the names in the family registry's plans).

- Conv1D column / row splits: transformers' Conv1D stores its weight (in, out).
- A fused Conv1D [q | k | v] projection, each rank keeping its own heads of each.
- Norms inside attention that see only this rank's heads: per-head q/k norms (weights replicated, gradients
  all-reduced) and q/k norms over the full projection width (weights split with the heads, the mean of squares
  all-reduced: one number per token, never the activations).
- Multi-head latent attention: the latent projections every rank computes whole.
- Bare per-head parameters of a module (attention sinks): split with the heads, its forward on the local shards.
- Packed experts that every token runs through: whole experts per rank (transformers splits their width).

Which family uses which style is the registry's knowledge (models/families/entries.py), not this module's.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle


def _shard_params(placements: dict[str, list]):
    def partition(name, module, mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            dt = distribute_tensor(param, mesh, placements[pname])
            module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))

    return partition


class Conv1DColwise(ColwiseParallel):
    """Column-wise for transformers' Conv1D, whose weight is (in, out): shard weight dim 1 and the bias."""

    def _apply(self, module, mesh):
        return distribute_module(
            module,
            mesh,
            _shard_params({"weight": [Shard(1)], "bias": [Shard(0)]}),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class Conv1DRowwise(RowwiseParallel):
    """Row-wise for Conv1D: shard weight dim 0 (the input features); the bias is added once, replicated."""

    def _apply(self, module, mesh):
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            mesh,
            _shard_params({"weight": [Shard(0)], "bias": [Replicate()]}),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class FusedQKVColwise(Conv1DColwise):
    """A fused Conv1D projection (c_attn) computes [q | k | v] in one matmul. A plain column shard would hand
    rank 0 all of q and half of k, so each rank gathers the projection and keeps q, k and v of its own heads. The
    gathered tensor's gradient is marked Partial: backward reduce-scatters it back to the weight shards.
    The stored weight keeps the transformers layout, so checkpoints load under any layout."""

    def _apply(self, module, mesh):
        def local_heads(mod, outputs, mesh):
            full = outputs.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
            rank, n = mesh.get_local_rank(), mesh.size()
            return torch.cat([x.chunk(n, dim=-1)[rank] for x in full.chunk(3, dim=-1)], dim=-1)

        return distribute_module(
            module,
            mesh,
            _shard_params({"weight": [Shard(1)], "bias": [Shard(0)]}),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            local_heads,
        )


class HeadNorm(SequenceParallel):
    """A norm over each head's own features (q_norm / k_norm per head; transformers'
    replicated_with_grad_allreduce): the weight is replicated, the input holds this rank's heads. A norm over
    the last dimension treats its input as rows and each rank holds some of them; DTensor is told they are
    split along dim 0, which for a row-wise operation says the same thing whatever the layout of the other
    dimensions (some attentions normalise [B, S, H, D], others [B, H, S, D]). The weight's gradient then comes out
    Partial and is all-reduced where it meets replicated tensors (gradient norm, the optimizer)."""

    def __init__(self):
        super().__init__(sequence_dim=0, use_local_output=True)


class ShardedNorm(ParallelStyle):
    """An RMSNorm over a projection's full output width while TP splits that output by heads (q_norm and
    k_norm over all heads): each rank keeps the weight entries of its columns, adds up its share of the squares,
    and one all-reduce of that per-token sum (autograd-aware: backward all-reduces its gradient) gives the mean
    over the full width. No activation is gathered. The module's own forward is replaced by this computation."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        width = module.weight.shape[0]
        eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", 1e-6)
        distribute_module(module, mesh, _shard_params({"weight": [Shard(0)]}))
        group = mesh.get_group()

        def forward(x):
            dtype = x.dtype
            x = x.float()
            squares = dist_fn.all_reduce(x.pow(2).sum(-1, keepdim=True), group=group)
            x = x * torch.rsqrt(squares / width + eps)
            return (module.weight.to_local() * x).to(dtype)

        module.forward = forward
        return module


class Replicated(ParallelStyle):
    """A projection every rank computes whole, on the attention's replicated input (MLA's query latent
    q_a_proj): weight and bias replicated DTensors, output a local tensor. Its consumers are column-split
    projections, whose input gradient comes back all-reduced, so the output's gradient is already whole."""

    def _local_output(self, outputs: DTensor) -> torch.Tensor:
        return outputs.to_local()

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        def replicated_input(mod, inputs, mesh):
            x = inputs[0]
            x = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            return (x, *inputs[1:])

        return distribute_module(
            module,
            mesh,
            _shard_params({"weight": [Replicate()], "bias": [Replicate()]}),
            replicated_input,
            lambda mod, outputs, mesh: self._local_output(outputs),
        )


class MlaKvAProj(Replicated):
    """MLA's key/value latent projection (transformers' mla_kv_a_proj), computed whole on every rank: its output
    is [kv latent | shared rotary key]. The latent feeds kv_b_proj (column-split: its gradient comes back
    whole); the rotary key goes straight into this rank's heads' attention, so its gradient covers only those
    heads: marked Partial, DTensor sums it over the ranks in backward."""

    def __init__(self, rope_dim: int):
        super().__init__()
        self.rope_dim = rope_dim

    def _local_output(self, outputs: DTensor) -> torch.Tensor:
        latent, rotary = outputs.split([outputs.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
        return torch.cat([latent.to_local(), rotary.to_local(grad_placements=[Partial()])], dim=-1)


class Whole(ParallelStyle):
    """transformers' replicate: every rank keeps the module whole and computes it on its replicated input (a plain
    module, nothing to do). A plan may name a token embedding so; meshlm splits that over the vocabulary anyway."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        return module


class EmbeddingRowwise(RowwiseParallel):
    """transformers' embedding_rowwise, and meshlm's vocabulary-parallel token embedding: the table split by rows
    over the ranks, looked up with the ids replicated, the partial rows summed into a replicated output (torch's
    RowwiseParallel on nn.Embedding). Modules inside the embedding (a normed embedding: an RMSNorm after the
    lookup) keep their parameters replicated and get the rows summed first: torch's own style shards
    every parameter it finds (it fails on a nested one), and the lookup's masked partial sum is valid only on
    the lookup's own output (a norm's reduction over it fails)."""

    def __init__(self):
        super().__init__(input_layouts=Replicate(), output_layouts=Replicate())

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                place = [Shard(0)] if mod is module and pname == "weight" else [Replicate()]
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, place), param.requires_grad))

        def summed(mod, args):
            x = args[0]
            return (x.redistribute(placements=[Replicate()]) if isinstance(x, DTensor) else x, *args[1:])

        for inner in list(module.modules())[1:]:
            inner.register_forward_pre_hook(summed)
        return distribute_module(
            module,
            mesh,
            partition,
            partial(self._prepare_input_fn, self.input_layouts, (Replicate(),)),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class GatheredColwise(ColwiseParallel):
    """transformers' colwise_gather_output: a column split whose output is gathered whole on every rank (a
    router gate whose scores pick rows of expert embeddings)."""

    def __init__(self):
        super().__init__(output_layouts=Replicate())


def _local_in_forward(module: nn.Module, names: list[str], grad_placements=None) -> nn.Module:
    """The module's forward sees the local tensors of its DTensor parameters `names` (their gradients flow back to
    the DTensors as `grad_placements` say); outside the forward they are DTensors again."""
    dtensors: dict[str, nn.Parameter] = {}

    def to_local(mod, args):
        for n in names:
            dtensors[n] = mod._parameters[n]
            mod._parameters[n] = dtensors[n].to_local(grad_placements=grad_placements)

    def back(mod, args, out):
        mod._parameters.update(dtensors)
        return out

    module.register_forward_pre_hook(to_local)
    module.register_forward_hook(back, always_call=True)
    return module


class LocalParams(ParallelStyle):
    """A module holding bare per-head parameters beside its split projections (attention sinks, a per-head gate
    bias): transformers' local_params. The parameters the plan splits (`split`:
    one value per head, `colwise` in the plan) become Shard(0) DTensors, and the module's forward sees their
    local tensors, so this rank's heads meet their own values. Autograd carries each local gradient back to its
    DTensor: a head's parameter touches only that head, so no sum over the ranks."""

    def __init__(self, split: tuple[str, ...] = ()):
        super().__init__()
        self.split = split

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        split = [n for n in self.split if module._parameters.get(n) is not None]  # sinks in some layers only
        for name in split:
            param = module._parameters[name]
            module._parameters[name] = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), param.requires_grad)
        return _local_in_forward(module, split)


class WholeExperts(ParallelStyle):
    """Packed experts that every token runs through, whole experts per rank: gate_up_proj [experts, hidden,
    2 x width] and down_proj [experts, width, hidden] split Shard(0), as parallel/expert.py splits a mixture of
    experts. transformers' plan splits every expert's width instead (packed_rowwise, moe_tp_experts), which needs
    torch's private _StridedShard for the packed [gate | up]. Such a block runs every token through every expert,
    its input laid out expert-major ([experts x tokens, hidden], each expert's rows weighted by the router): each
    rank takes its experts' rows of the whole input (backward all-gathers their gradients), runs the module's own
    forward on its local weights, and the rows are all-gathered (backward keeps this rank's rows of the whole
    gradient). The same traffic as transformers' all-reduce of the partial outputs, balanced since every expert
    sees every token."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        names = [n for n, _ in module.named_parameters(recurse=False)]
        distribute_module(module, mesh, _shard_params({n: [Shard(0)] for n in names}))
        experts, own = module.gate_up_proj.shape[0], module.forward

        def forward(hidden_states):
            width = hidden_states.shape[-1]
            rows = DTensor.from_local(hidden_states.view(experts, -1, width), mesh, [Replicate()], run_check=False)
            mine = rows.redistribute(placements=[Shard(0)]).to_local()
            with _local_parameters(module, names):
                out = own(mine.reshape(-1, width))
            out = DTensor.from_local(out.view(mine.shape[0], -1, width), mesh, [Shard(0)], run_check=False)
            return out.full_tensor().view(-1, width)

        module.forward = forward
        return module


class ScatteredRowwise(RowwiseParallel):
    """Row-wise whose partial sums are reduce-scattered over the output features: each rank keeps its heads' share
    of an output with one value per head (a dynamic mask's dt_proj: each key/value head's mask value, from every
    head's values), where a plain row-wise split all-reduces it whole."""

    def __init__(self, **_):
        super().__init__(output_layouts=Shard(-1))


class SequenceShardedParams(ParallelStyle):
    """A block's own parameters (residual scales) under sequence parallel: they multiply this rank's slice of
    the sequence, so each rank's gradient covers its own tokens. Kept replicated; the block's forward sees their
    local tensors with the gradient marked Partial, which DTensor sums over the ranks (as HeadNorm's weight)."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        names = [n for n, _ in module.named_parameters(recurse=False)]
        for n in names:  # the block's own only (distribute_module would visit its submodules too)
            p = module._parameters[n]
            module._parameters[n] = nn.Parameter(distribute_tensor(p, mesh, [Replicate()]), p.requires_grad)
        return _local_in_forward(module, names, grad_placements=[Partial()])


class NormSequenceParallel(SequenceParallel):
    """torch's SequenceParallel for a norm that may hold submodules of its own (a gated norm: an RMSNorm and a gate
    MLP, per token). distribute_module calls this for the norm and each submodule in turn; torch's own
    registers every nested parameter under its dotted name on each, which nn.Module refuses. Here each module
    replicates only the parameters it owns."""

    def _replicate_module_fn(self, name: str, module: nn.Module, device_mesh) -> None:
        for p_name, param in list(module.named_parameters(recurse=False)):
            replicated = DTensor.from_local(param, device_mesh, [Replicate()], run_check=False)
            module.register_parameter(p_name, nn.Parameter(replicated, param.requires_grad))


class FreshRowwise(RowwiseParallel):
    """Row-wise whose output is a tensor of its own, not a view of the DTensor's local tensor: a MoE block that
    adds its routed experts' rows into its shared expert's output in place, which autograd refuses on a view made
    inside a custom Function (to_local). One copy of the block's output."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh).clone()


@contextlib.contextmanager
def _local_parameters(module: nn.Module, names: list[str]):
    """The module's DTensor parameters `names` as their local tensors while its own forward runs (autograd carries
    each local gradient back to its DTensor)."""
    dtensors = {n: module._parameters[n] for n in names}
    try:
        for n, p in dtensors.items():
            module._parameters[n] = p.to_local()
        yield
    finally:
        module._parameters.update(dtensors)


# meshlm's TP styles by the names the family registry (models/families) uses in its plans.
STYLES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "fused_qkv": FusedQKVColwise,
    "conv1d_colwise": Conv1DColwise,
    "conv1d_rowwise": Conv1DRowwise,
    "head_norm": HeadNorm,
    "sharded_norm": ShardedNorm,
    "replicated": Replicated,
    "mla_kv_a_proj": MlaKvAProj,
    "local_params": LocalParams,
    "replicate": Whole,
    "embedding_rowwise": EmbeddingRowwise,
    "colwise_gather_output": GatheredColwise,
    "whole_experts": WholeExperts,
    "scattered_rowwise": ScatteredRowwise,
}
# The styles above that split their module's own matrices over the ranks (the others keep them whole on every
# rank, or hold none): what the planner counts per rank (plan/spec.py whole_under_tp).
SPLITS_MATRICES = {
    *("colwise", "rowwise", "fused_qkv", "conv1d_colwise", "conv1d_rowwise", "colwise_gather_output", "whole_experts"),
    "scattered_rowwise",
}


def reshard_first(out, mesh, src, dst):
    """A block's output with its hidden states (the first tensor when it returns several: router
    scores or an indexer's choices ride beside them) moved from placement `src` to `dst`, as a local tensor."""
    first = out[0] if isinstance(out, tuple) else out
    first = DTensor.from_local(first, mesh, [src], run_check=False).redistribute(mesh, [dst]).to_local()
    return (first, *out[1:]) if isinstance(out, tuple) else first
