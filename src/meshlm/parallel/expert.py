"""Experts placed on ranks: each rank of an expert group holds whole experts, and tokens travel to them.

A mixture-of-experts layer keeps its experts in one module with grouped weights
(`gate_up_proj` [experts, 2 x width, hidden], `down_proj` [experts, hidden, width]); transformers' config names
it in `base_model_ep_plan` ("ep_dispatch_experts"). Here its weights become DTensors sharded on the expert
dimension over an expert group, and its forward becomes:

  1. under tensor parallel the group's TP ranks hold the same tokens: each keeps its own slice of the rows
     (no communication; backward all-gathers their gradients), so no token is computed twice;
  2. the (token, expert) pairs, sorted by expert, are counted per destination rank; the counts are exchanged
     first (all_to_all_single of experts numbers), then the tokens (all_to_all_single with those split sizes):
     every token reaches its experts, none is dropped, no capacity factor;
  3. the rank runs its local experts on what it received with the model's own experts forward (one grouped
     matmul, transformers' grouped_mm, or a loop of matmuls);
  4. the outputs go back by the reverse all-to-all; the sender weights them by the router's top-k weights and
     sums each token's k outputs, as the model's own forward does;
  5. under tensor parallel the row slices are gathered again.

The router, its top-k, its normalisation and its load-balancing loss run unchanged on every rank's own
tokens (parallel/aux_loss.py). Which ranks form the group is the layout's: the tensor-parallel ranks (TP of
the experts: each TP rank holds experts / tp of them, where transformers' packed styles split every expert's
width), and with --parallel.ep E also E data-parallel ranks (expert parallel, carved out of dp_shard as
torchtitan does). FSDP then shards each expert's weights over the remaining data-parallel ranks.
"""

from __future__ import annotations

import contextlib
import fnmatch
import time
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from meshlm.errors import MeshlmError
from meshlm.models.families import facts, family
from meshlm.parallel.tensor_styles import reshard_first


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every experts module of `model` (a whole model or a pipeline stage's part): the module
    that holds the grouped weights, inside peft's wrappers where LoRA adapts them (`<path>.base_layer...`)."""
    pattern = family(model.config).experts
    if pattern is None:
        return []
    found = []
    for name, m in model.named_modules():
        if fnmatch.fnmatch(name, f"*{pattern}"):
            while hasattr(m, "base_layer"):  # peft's ParamWrapper, one per adapted weight
                name, m = f"{name}.base_layer", m.base_layer
            found.append((name, m))
    return found


def _adapter_wrappers(model: nn.Module, name: str) -> list[nn.Module]:
    """peft's ParamWrappers around the experts module `name` (outermost first; none without LoRA on them)."""
    path, _, _ = name.partition(".base_layer")
    chain = [model.get_submodule(path)]
    while hasattr(chain[-1], "base_layer"):
        chain.append(chain[-1].base_layer)
    return chain[:-1]


def inactive_expert_params(model: nn.Module) -> int:
    """Expert weights a token does not use: each MoE layer runs k of its E experts per token, so (E - k) / E of
    them add nothing to its FLOPs (MFU and the planner count the active parameters)."""
    f = facts(model.config)
    return sum(
        p.numel() * (f.experts - f.active_experts) // f.experts
        for _, experts in experts_modules(model)
        for p in experts.parameters(recurse=False)
    )


def expert_state_bytes(model: nn.Module, optimizer) -> int:
    """Bytes of the expert weights this rank holds, their gradients and optimizer states (the metrics row).
    Counted by each tensor's local size, not its storage: FSDP's gradients are views into one buffer per unit,
    which under zero3 also holds the block's other gradients."""
    params = [p for _, m in experts_modules(model) for p in m.parameters()]
    states = [v for p in params for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v) and v.ndim > 0]
    tensors = params + [p.grad for p in params if p.grad is not None] + states
    return sum(t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes for t in tensors)


def check_experts(config, ranks: int, what: str) -> None:
    """One line when `ranks` (the expert group: tp, or ep x tp) does not divide the model's experts."""
    n = facts(config).experts
    if n and n % ranks:
        raise MeshlmError(f"{what} does not divide the model's {n} experts; pick a degree that divides {n}")


def check_expert_parallel(config, ep: int, tp: int) -> None:
    """--parallel.ep on this model: one line when it has no experts, meshlm cannot dispatch to them, or ep x tp
    does not divide them."""
    fam, n = family(config), facts(config).experts
    if not n:
        raise MeshlmError(
            f"--parallel.ep {ep} splits a mixture of experts, and the {config.model_type} model has no experts; "
            f"drop --parallel.ep"
        )
    if fam.experts is None:
        raise MeshlmError(
            f"--parallel.ep: meshlm cannot dispatch tokens to the experts of model family {config.model_type!r} "
            f"(its config has no base_model_ep_plan naming an experts module); use --strategy zero3 or fsdp without ep"
        )
    what = f"--parallel.ep {ep}" + (f" x --parallel.tp {tp} = {ep * tp}" if tp > 1 else "")
    check_experts(config, ep * tp, what)


def apply_experts(
    model: nn.Module, group: DeviceMesh, tp: DeviceMesh | None = None, sequence_parallel: bool = False
) -> int:
    """Shard every experts module of `model` over the 1-D mesh `group` (whole experts per rank) and route its
    tokens there. `tp`: the tensor-parallel mesh whose ranks hold the same tokens (their MoE blocks then take
    the replicated, or under sequence parallel the sequence-sharded, residual stream). Works on the meta
    device (before materialize). Returns how many experts modules it changed."""
    tp = tp if tp is not None and tp.size() > 1 else None
    found = experts_modules(model)
    for name, experts in found:
        total = experts.num_experts
        for pname, p in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(p.detach(), group, [Shard(0)], src_data_rank=None)
            experts.register_parameter(pname, nn.Parameter(sharded, requires_grad=p.requires_grad))
        experts.num_experts = total // group.size()
        wrappers = _adapter_wrappers(model, name)
        experts.forward = _Dispatch(experts, experts.forward, group, tp, wrappers)
        if wrappers:  # peft's forward would add every expert's adapter to the sharded weight: _local_params adds them
            wrappers[0].forward = experts.__call__
        if tp is not None:
            block = model.get_submodule(name.rpartition(".")[0])
            block.forward = partial(_tensor_parallel_block, block.forward, tp, sequence_parallel)
    return len(found)


def _tensor_parallel_block(forward, tp: DeviceMesh, sequence_parallel: bool, hidden_states, *args, **kwargs):
    """A MoE block under tensor parallel: its router runs on every token, replicated (as a norm does); its
    experts dispatch each TP rank's slice of the rows. Both give every rank whole, equal input gradients, so
    the block's input is made local without the all-reduce in backward that split projections need."""
    if isinstance(hidden_states, DTensor):
        hidden_states = hidden_states.redistribute(placements=[Replicate()]).to_local()
    elif sequence_parallel:
        hidden_states = _gather(hidden_states, tp, Shard(1))
    out = forward(hidden_states, *args, **kwargs)
    if sequence_parallel:  # back into the sequence-sharded residual stream (no communication)
        out = reshard_first(out, tp, Replicate(), Shard(1))
    return out


def _gather(t: torch.Tensor, mesh: DeviceMesh, placement) -> torch.Tensor:
    return DTensor.from_local(t, mesh, [placement], run_check=False).full_tensor()


class _Dispatch:
    """The experts module's forward under expert sharding (the steps of the module docstring)."""

    def __init__(self, experts: nn.Module, own_forward, group: DeviceMesh, tp: DeviceMesh | None, wrappers=()):
        self.experts, self.own_forward, self.group, self.tp = experts, own_forward, group, tp
        self.wrappers = wrappers  # peft's LoRA on the experts' weights (parallel/lora.py), outermost first

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        rows = hidden_states.shape[0]
        if self.tp is not None:
            hidden_states, top_k_index, top_k_weights = (
                _rows(t, self.tp) for t in (hidden_states, top_k_index, top_k_weights)
            )
        received, state = self._dispatch(hidden_states, top_k_index)
        out = self._combine(self._local_experts(*received), state, top_k_weights)
        if self.tp is not None:
            out = DTensor.from_local(
                out.contiguous(),
                self.tp,
                [Shard(0)],
                run_check=False,
                shape=(rows, out.shape[-1]),
                stride=(out.shape[-1], 1),
            ).full_tensor()
        return out.to(hidden_states.dtype)

    def _dispatch(self, hidden_states, top_k_index):
        """Counts first, then the tokens: (rows received, their local expert ids), and what combine needs."""
        local, ranks, group = self.experts.num_experts, self.group.size(), self.group.get_group()
        experts = top_k_index.reshape(-1)
        order = torch.argsort(experts, stable=True)  # grouped by expert, so by destination rank
        counts = torch.zeros(local * ranks, dtype=torch.int64, device=experts.device)
        counts.scatter_add_(0, experts, torch.ones_like(experts))
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=group)
        if ROUTING.balanced:  # `plan --simulate` on fake tensors: no values, each rank's pairs spread evenly
            send = recv = _even(experts.numel(), ranks)
            received_counts = torch.tensor([n for r in recv for n in _even(r, local)], device=experts.device)
        else:  # the one host sync of the layer: all-to-all split sizes are host integers
            sizes = torch.stack([counts.view(ranks, local).sum(1), received_counts.view(ranks, local).sum(1)])
            send, recv = sizes.tolist()
        tokens = _AllToAll.apply(hidden_states[order // top_k_index.shape[-1]], recv, send, group)
        ids = torch.arange(local, device=experts.device).repeat(ranks)
        ids = ids.repeat_interleave(received_counts, output_size=sum(recv))
        return (tokens, ids), (order, send, recv)

    def _local_experts(self, tokens, ids):
        """This rank's experts on the rows it received, with the model's own experts forward (top-1, unit
        weight: the sender applies the router's weights). No rows: one zero row keeps backward connected."""
        first = self.group.get_local_rank() * self.experts.num_experts
        with _local_params(self.experts, self.wrappers, first, self.tp):
            if tokens.shape[0] == 0:
                zero = tokens.sum(0, keepdim=True)
                return self.own_forward(zero, ids.new_zeros(1, 1), zero.new_ones(1, 1))[:0]
            return self.own_forward(tokens, ids.unsqueeze(-1), tokens.new_ones(tokens.shape[0], 1))

    def _combine(self, out, state, top_k_weights):
        order, send, recv = state
        back = _AllToAll.apply(out, send, recv, self.group.get_group())
        per_slot = back[torch.argsort(order)]  # (token, slot) order again
        per_slot = per_slot.view(*top_k_weights.shape, -1) * top_k_weights.unsqueeze(-1).to(per_slot.dtype)
        return per_slot.sum(1)


class _Routing:
    """`balanced`: the routers' choices have no values (`plan --simulate` runs on fake tensors): dispatch as a
    perfectly balanced router would, every rank sending each the same share (balanced_on_fake_tensors).
    `seconds`: host time in this rank's all-to-alls since it was last read (the exchange itself on CPU ranks,
    whose collectives are synchronous; on GPUs only their launch)."""

    balanced = False
    seconds = 0.0

    @contextlib.contextmanager
    def balanced_on_fake_tensors(self):
        """`balanced` while the block runs (plan/simulate.py, around one simulated rank)."""
        self.balanced = True
        try:
            yield
        finally:
            self.balanced = False

    def take_seconds(self) -> float:
        """`seconds`, and start counting again (the metrics row reads it once per row)."""
        taken, self.seconds = self.seconds, 0.0
        return taken


ROUTING = _Routing()


def _even(n: int, parts: int) -> list[int]:
    return [n // parts + (i < n % parts) for i in range(parts)]


class _AllToAll(torch.autograd.Function):
    """Rows to ranks by split sizes (all_to_all_single); backward sends their gradients back the same way."""

    @staticmethod
    def forward(ctx, x, recv: list[int], send: list[int], group):
        ctx.recv, ctx.send, ctx.group = recv, send, group
        return _exchange(x, recv, send, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.send, ctx.recv, ctx.group), None, None, None


def _exchange(x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
    out = x.new_empty(sum(recv), *x.shape[1:])
    started = time.perf_counter()
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    ROUTING.seconds += time.perf_counter() - started
    return out


def _rows(t: torch.Tensor, tp: DeviceMesh) -> torch.Tensor:
    """This TP rank's slice of rows of a tensor every TP rank holds whole (backward gathers the gradients)."""
    t = t.to_local() if isinstance(t, DTensor) else t
    return DTensor.from_local(t, tp, [Replicate()], run_check=False).redistribute(tp, [Shard(0)]).to_local()


class _local_params:
    """Run a module's forward on the local shards of its DTensor parameters (gradients flow to the shards), with
    the LoRA adapters of peft's `wrappers` added to them: W_e + scaling x B_e A_e for the rank's experts
    first.. (peft's own factors, get_delta_factors, sliced to those experts). Each rank uses its experts' slices
    of the adapters; their gradients elsewhere are zero, and FSDP's average over the data-parallel ranks (the
    adapters are in their block's unit) adds each expert's slice from the ranks that hold it. Under tensor
    parallel (`tp`) the TP ranks hold the same tokens and split the experts: each expert's slice of the
    gradient is whole on the one TP rank that holds it, so the factors' gradients are summed over `tp`."""

    def __init__(self, module: nn.Module, wrappers=(), first: int = 0, tp: DeviceMesh | None = None):
        self.module, self.wrappers, self.first, self.tp = module, wrappers, first, tp

    def __enter__(self):
        self.saved = dict(self.module._parameters)
        for name, p in self.saved.items():
            if isinstance(p, DTensor):
                self.module._parameters[name] = p.to_local()
        for wrapper in self.wrappers:
            if wrapper.disable_adapters:  # peft's enable_adapters(False): the base alone (DPO's reference)
                continue
            for adapter in [a for a in wrapper.active_adapters if a in wrapper.lora_A]:
                lhs, rhs, scaling = wrapper.get_delta_factors(adapter)
                name, n = wrapper.parameter_name, self.module.num_experts
                lhs, rhs = (self._summed_over_tp(t)[self.first : self.first + n] for t in (lhs, rhs))
                w = self.module._parameters[name]
                self.module._parameters[name] = torch.baddbmm(w, lhs, rhs, alpha=scaling)

    def _summed_over_tp(self, t: torch.Tensor) -> torch.Tensor:
        """`t` itself; its gradient all-reduced over the TP ranks in backward (DTensor's Partial -> Replicate): whole
        factors, each TP rank's gradient nonzero only in its own experts' slices."""
        if self.tp is None:
            return t
        return DTensor.from_local(t, self.tp, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])

    def __exit__(self, *exc):
        self.module._parameters.update(self.saved)
