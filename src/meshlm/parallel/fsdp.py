"""Sharded data parallel with FSDP2 (`fully_shard`): ZeRO-2, ZeRO-3 and hybrid sharding (HSDP).

Every transformer block is its own FSDP unit, and so are the input embedding and
the output projection (when untied), so only the unit that runs is gathered; the
root unit takes what is left (final norm, positions). Parameters become DTensors
sharded on dim 0 over the data-parallel mesh:

  zero2        1-D mesh (dp_shard); reshard_after_forward=False: a unit's gathered
               parameters stay from its forward until its backward (no second
               all-gather), gradients and optimizer states stay sharded. FSDP keeps
               the fp32 shard too, so between forward and backward a rank holds the
               whole parameters plus 1/N of them (ZeRO's formula counts the former)
  zero3/fsdp   1-D mesh (dp_shard); reshard_after_forward=True: parameters are
               gathered just before a unit runs and freed right after
  hsdp         2-D mesh (dp_replicate, dp_shard): full sharding within groups of
               --parallel.shard-size ranks, replicas across groups (gradients are
               reduce-scattered in the group, then all-reduced across replicas)

`apply_fsdp` is the piece other layouts reuse: tensor parallel passes its TP-sharded
model and the dp part of the same mesh (FSDP + TP = 2-D sharding), pipeline parallel
passes each stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from meshlm import host_memory
from meshlm.compat import AllGather, ReduceScatter, all_gather_single, unshard_async
from meshlm.models.families import tied, transformer_blocks


def mixed_precision_policy(mixed_precision: str) -> MixedPrecisionPolicy | None:
    """bf16 compute and parameter all-gather; gradients reduced (and kept) in fp32 next to fp32 master shards."""
    if mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def apply_fsdp(
    model: torch.nn.Module,
    dp_mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload: bool = False,
    experts_mesh: DeviceMesh | None = None,
    experts_divide: int = 1,
) -> torch.nn.Module:
    """Shard `model` in place over `dp_mesh` (1-D: dp_shard; 2-D: (dp_replicate, dp_shard) = HSDP).
    `experts_mesh`: under expert parallel, a mixture of experts' experts modules are units of their own,
    sharded over it (the data-parallel ranks that hold the same experts), their gradients divided by
    `experts_divide` (all data-parallel ranks: each expert's gradient already sums its whole group's tokens).

    Units, bottom-up as fully_shard requires: each transformer block, then the input
    embedding and the output projection (when not tied: for a large vocabulary they are
    the biggest matrices, and leaving them in the root would keep them gathered through
    the whole forward), then the root for the rest.
    """
    kw = {
        "mesh": dp_mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy(pin_memory=dp_mesh.device_type == "cuda") if offload else OffloadPolicy(),
    }
    if experts_mesh is not None:
        from meshlm.parallel.expert import experts_modules

        for _, experts in experts_modules(model):
            fully_shard(experts, **{**kw, "mesh": experts_mesh})
            experts.set_gradient_divide_factor(experts_divide)
            # size(ndim - 1), not size(-1): torch 2.11's 1-D mesh asserts on a negative dimension
            if experts_mesh.device_type == "cpu" and experts_mesh.size(experts_mesh.ndim - 1) > 1:
                # gloo has no pre-multiplied sum: sum, then divide (torch divides a 1-rank group's twice so)
                experts.set_force_sum_reduction_for_comms(True)
    for block in transformer_blocks(model):
        fully_shard(block, **kw)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not tied(model):  # a tied weight must live in one unit: then both stay in the root
        for m in (embed, head):
            if m is not None and any(True for _ in m.parameters()):
                fully_shard(m, **kw)
        if embed is not None and backward_reads_no_parameter(embed):
            # its backward needs the token ids, not the weight: no vocabulary-sized all-gather at the end of
            # backward (the gradient is still reduce-scattered), as torch's set_unshard_in_backward intends
            embed.set_unshard_in_backward(False)
    # The root's forward spans the whole step, so it is gathered throughout anyway; resharding it
    # after forward (as asked) keeps the between-forward-and-backward state as small as the layout says.
    fully_shard(model, **kw)
    if dp_mesh.device_type == "cpu" and ReduceScatter is not None:
        one_stream(model)
    return model


def one_stream(model: torch.nn.Module) -> None:
    """CPU ranks run one stream: nothing to overlap, so FSDP's buffers kept for overlap are freed early. Each
    all-gather's flat output right after it is copied into the parameters instead of at the next unit's (a
    vocabulary-sized buffer beside the LM head); gradients are reduce-scattered in place. On gloo ranks also
    gloo's all-gather copy and the reduce-scatter input once the collective is done (neither in `plan
    --simulate`, whose fake ranks stand for GPUs, where FSDP keeps both for its other streams)."""
    unshard_async(model)
    gloo = dist.get_backend() == "gloo"
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_reduce_scatter(InPlaceReduceScatter(free_input=gloo))
            if gloo and AllGather is not None:
                m.set_custom_all_gather(BlockingAllGather())


def backward_reads_no_parameter(embed: torch.nn.Module) -> bool:
    """A plain lookup table: backward scatters the output's gradient into the weight's rows and reads no
    parameter, so the weight may stay sharded through backward. Not an embedding that holds more (a normed
    embedding: an RMSNorm inside, whose backward reads its weight): left sharded, that weight's freed
    buffer is read in backward and the rank dies with SIGSEGV."""
    return isinstance(embed, torch.nn.Embedding) and list(embed.parameters()) == [embed.weight]


class InPlaceReduceScatter(ReduceScatter or object):
    """Gloo's reduce-scatter copies its whole input (measured: +158 MiB on a 125 MiB input); FSDP's input is
    already a scratch buffer, so reduce each rank's chunk into it in place (+33 MiB) and copy out this rank's.
    `free_input`: FSDP keeps the input until the next unit's reduce-scatter (for its reduce-scatter stream), that
    is while the next block runs its backward; on one stream the reduces are done here, so free it now."""

    def __init__(self, free_input: bool = False):
        self.free_input = free_input

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        chunks = input_tensor.view(-1).chunk(group.size())
        for i, chunk in enumerate(chunks):
            dist.reduce(chunk, dst=dist.get_global_rank(group, i), group=group)
        output_tensor.view(-1).copy_(chunks[group.rank()])
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(group.size())
        if self.free_input:
            input_tensor.untyped_storage().resize_(0)
        return None


class BlockingAllGather(AllGather or object):
    """Gloo's all-gather gathers into a copy of the whole output, which an async call keeps until it
    is waited on: FSDP waits on a backward prefetch only when that unit runs, so the copy sat beside the block
    computing before it (on benchmarks/moe.py's zero3 4, one 51 MiB block more at the peak). Blocking frees it
    when the collective returns; the work it returns is done, so FSDP still frees its flat output at copy-out.
    It is the moment a rank holds the most (a third unit beside two: plan/memory.py gloo_gathering), so the heap's
    free pages are given back first: else the last unit's freed temporaries sit resident beside it."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        host_memory.give_back_free(output_tensor.numel() * output_tensor.element_size())
        all_gather_single(output_tensor, input_tensor, group=group)
        return _Done()


class _Done(dist.Work):
    """A collective that already ran."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True
