"""Every private torch name meshlm uses, and every public one newer than torch 2.11, looked up here once and
nowhere else.

Over 400 lines by design: one module holding every such name is the point (no other module may use one), so a
torch release that moves a name is fixed here alone.

torch's private modules and members change between releases without notice. Each name below says what
meshlm does on a torch that lacks it: a fallback where an equivalent exists, otherwise a one-line
`meshlm: error:` naming the feature, raised when that feature is used (never at import, so everything
else still runs). `PRIVATE_MEMBERS` lists the private members of torch's classes that meshlm's own
subclasses override or read in place. tests/unit/test_compat.py checks every name and member against the
installed torch, and that no other module of meshlm imports a private torch name or uses a private
member that is not declared here. A public op that computes differently on an older release in a way meshlm
would see (gradient clipping of Partial DTensors) is called through a function here too. Checked on torch
2.11.0, 2.13.0 and 2.15.0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib

import torch

from meshlm.errors import MeshlmError


def lookup(module: str, name: str):
    """`module.name`, or None when the installed release lacks it (compat_transformers looks up through it too)."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def missing(what: str, feature: str) -> MeshlmError:
    from meshlm import versions  # the tested range, for the error only

    return MeshlmError(
        f"{feature} needs torch's private {what}, which torch {torch.__version__} does not have; "
        f"install a torch of the tested range ({versions.tested('torch')})"
    )


class Absent:
    """Stands for a name the installed release lacks: calling it or reading from it raises `refusal`'s one line
    (torch's `missing` here, transformers' in compat_transformers)."""

    def __init__(self, what: str, feature: str, refusal=None):
        self.what, self.feature, self.refusal = what, feature, refusal or missing

    def __call__(self, *args, **kwargs):
        raise self.refusal(self.what, self.feature)

    def __getattr__(self, name: str):
        raise self.refusal(self.what, self.feature)


def _class(module: str, name: str, feature: str) -> type:
    """The class, or one that subclasses can name (so their modules import) and that raises when built."""
    found = lookup(module, name)
    if found is not None:
        return found

    def refuse(self, *args, **kwargs):
        raise missing(f"{module}.{name}", feature)

    return type(name, (), {"__init__": refuse})


SIMULATE = "meshlm plan --simulate"
PROBE = "--measure-step (and meshlm plan --validate)"
SAMPLED = f"{PROBE} and {SIMULATE}"


def _flatten_fallback(tensors):
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)


def _unflatten_fallback(flat, tensors):
    return [c.view_as(t) for c, t in zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)]


def _all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    # the same collective under its older name (deprecated where all_gather_single exists)
    return torch.distributed.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


# Each name meshlm imports from here -> (torch's module, its name there, what needs it or the fallback).
# Resolved on first import, not when this module loads: some of these modules take seconds to import, and
# a module that imports a name inside a function keeps that cost off every other command.
PRIVATE = {
    "FakeTensorMode": ("torch._subclasses.fake_tensor", "FakeTensorMode", SIMULATE),
    # without fake tensors nothing is fake (isinstance of no class): leaving fake mode is then nothing to do
    "FakeTensor": ("torch._subclasses.fake_tensor", "FakeTensor", ()),
    "unset_fake_temporarily": ("torch._subclasses.fake_tensor", "unset_fake_temporarily", contextlib.nullcontext),
    "checkpoint_wrapper": (
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "checkpoint_wrapper",
        "--activation-checkpointing",
    ),
    # FSDP2's custom reduce-scatter and all-gather hooks; None: FSDP keeps its own (parallel/fsdp.py)
    "ReduceScatter": ("torch.distributed.fsdp._fully_shard._fsdp_api", "ReduceScatter", None),
    "AllGather": ("torch.distributed.fsdp._fully_shard._fsdp_api", "AllGather", None),
    "set_element": ("torch.distributed.checkpoint._nested_dict", "set_element", "reading a checkpoint"),
    "load_state_dict_from_keys": (
        "torch.distributed.checkpoint.state_dict_loader",
        "_load_state_dict_from_keys",
        "meshlm verify",
    ),
    "compute_local_shape_and_global_offset": (
        "torch.distributed.tensor._utils",
        "compute_local_shape_and_global_offset",
        "filling a sharded model",
    ),
    "TorchDispatchMode": ("torch.utils._python_dispatch", "TorchDispatchMode", SAMPLED),
    "tree_leaves": ("torch.utils._pytree", "tree_leaves", SAMPLED),
    "MemTracker": ("torch.distributed._tools.mem_tracker", "MemTracker", PROBE),
    "FSDPMemTracker": ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker", PROBE),
    "ShardingPropagator": ("torch.distributed.tensor._sharding_prop", "ShardingPropagator", SIMULATE),
    "FakeStore": ("torch.testing._internal.distributed.fake_pg", "FakeStore", SIMULATE),
    # a PipelineStage's given shapes since torch 2.13; None: torch 2.11's older members (set_stage_shapes)
    "InferenceMode": ("torch.distributed.pipelining._utils", "InferenceMode", None),
    "StageMeta": ("torch.distributed.pipelining._utils", "_StageMeta", None),
    "extract_tensor_metas": ("torch.distributed.pipelining._utils", "extract_tensor_metas", None),
    "gen_transform_infos": ("torch.distributed.tensor._redistribute", "_gen_transform_infos", SIMULATE),
    "clear_sharding_prop_cache": ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache", SIMULATE),
    # public, but newer than torch 2.11
    "all_gather_single": ("torch.distributed", "all_gather_single", _all_gather_into_tensor),
    # BatchNorm's common base; without it, the public BatchNorm classes (isinstance takes either)
    "BatchNorm": (
        "torch.nn.modules.batchnorm",
        "_BatchNorm",
        (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d),
    ),
    # one flat buffer for many tensors (one broadcast instead of many); torch's own is a C++ copy
    "flatten_dense_tensors": ("torch._utils", "_flatten_dense_tensors", _flatten_fallback),
    "unflatten_dense_tensors": ("torch._utils", "_unflatten_dense_tensors", _unflatten_fallback),
}
CLASSES = ("FakeTensorMode", "TorchDispatchMode", "MemTracker", "FSDPMemTracker", "ShardingPropagator", "FakeStore")


def torch_private(name: str):
    """The torch object PRIVATE names, its fallback, or what raises the one line when used."""
    module, attr, needed = PRIVATE[name]
    found = lookup(module, attr)
    if found is not None or not isinstance(needed, str):  # found, or a fallback (None included)
        return needed if found is None else found
    return _class(module, attr, needed) if name in CLASSES else Absent(f"{module}.{attr}", needed)


def __getattr__(name: str):
    if name not in PRIVATE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value = torch_private(name)
    return value


def clear_dtensor_caches() -> None:
    """DTensor's caches of sharding decisions and redistribution plans (keyed by mesh layout)."""
    torch_private("clear_sharding_prop_cache")()
    torch_private("gen_transform_infos").cache_clear()


# ---------------------------------------------------------------- private members, read or set here


def flatten_mesh(mesh, name: str):
    """A mesh's dimensions as one named dimension (the data-parallel ranks over dp_replicate x dp_shard)."""
    if not hasattr(mesh, "_flatten"):
        raise missing("DeviceMesh._flatten", "a mesh with data-parallel dimensions")
    return mesh._flatten(name)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard as the tensor it holds (filled in place); without the member, to_local()
    (a view of the same storage)."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t.to_local()


def unshard_async(module) -> bool:
    """FSDP2: free each all-gather's output right after it is copied out (False: this torch keeps FSDP's
    default, which holds it until the next unit's all-gather)."""
    if not hasattr(module, "_set_unshard_async_op"):
        return False
    module._set_unshard_async_op(True)
    return True


def default_store():
    """The default process group's store (rank 0's heartbeat, runtime.py)."""
    c10d = torch.distributed.distributed_c10d
    if not hasattr(c10d, "_get_default_store"):
        raise missing("distributed_c10d._get_default_store", "rank 0's heartbeat while other ranks wait")
    return c10d._get_default_store()


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor `t` views (None when it owns its storage): activation offload leaves a weight's transpose
    saved by a matmul where it is (parallel/offload.py)."""
    return getattr(t, "_base", None)


def storage_key(storage) -> int:
    """One number per storage, the same for every tensor viewing it (also for fake and meta storages)."""
    return storage._cdata


def zero_owner(optimizer, p: torch.Tensor) -> int:
    """The rank of ZeroRedundancyOptimizer's partition that owns parameter `p`."""
    if not hasattr(optimizer, "_param_to_rank"):
        raise missing("ZeroRedundancyOptimizer._param_to_rank", "--strategy zero1")
    return optimizer._param_to_rank[p]


def zero_param_index(optimizer) -> dict:
    """ZeroRedundancyOptimizer's global index of each parameter (torch.optim's state_dict numbering)."""
    return optimizer._param_to_index


def zero_sync_param_groups(optimizer) -> None:
    """Copy the outer param_groups' options (lr, ...) into the wrapped local optimizer's."""
    optimizer._sync_param_groups(optimizer.param_groups, optimizer.optim.param_groups)


def serve_store_with(handler, factory) -> None:
    """The rendezvous handler opens rank 0's process-group store with `factory(addr, port)`."""
    if not hasattr(handler, "_create_tcp_store_server"):
        raise missing("DynamicRendezvousHandler._create_tcp_store_server", "multi-node rendezvous")
    handler._create_tcp_store_server = factory


def forget_shared_store(handler) -> None:
    """The next rendezvous round opens a fresh process-group store instead of reusing the last round's."""
    handler._bootstrap_store_info, handler._shared_tcp_store_server = None, None


def set_stage_shapes(stage, inputs: tuple, outputs: tuple) -> None:
    """A PipelineStage's input and output shapes, given instead of inferred by exchanging them (what its
    constructor's input_args and output_args set)."""
    stage_meta = torch_private("StageMeta")
    if stage_meta is None:  # torch 2.11 keeps them in these two members
        stage.inputs_meta = tuple(inputs)
        stage._configure_outputs_meta(tuple(outputs))
        return
    metas = torch_private("extract_tensor_metas")
    stage._user_meta = stage_meta(inputs=metas(inputs), outputs=metas(outputs), input_grads=None, output_grads=None)


def cpu_rowwise_float8() -> bool:
    """Whether torch's CPU float8 matmul takes row-wise scales (torch 2.11's takes one scale per tensor)."""
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


# torchao's NF4 tensor (parallel/nf4.py): the module path torchao 0.18 keeps it under (torchao.dtypes.nf4tensor
# before); looked up only once --lora.quantize nf4 asks for it.
NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"


def nf4_module():
    """torchao's NF4 module (NF4Tensor, SubclassTensorArgs), or None when torchao or that module is missing."""
    try:
        return importlib.import_module(NF4_MODULE)
    except ImportError:
        return None


def nf4_loaded():
    """The NF4 module if something imported it already, else None: no tensor can be NF4 before that."""
    import sys

    return sys.modules.get(NF4_MODULE)


def ddp_ignore(module, names: list[str]) -> None:
    """DistributedDataParallel leaves these parameters of `module` alone (no broadcast, no buckets)."""
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding a wrapper subclass's data (an NF4 weight: its codes and scales), else [t]."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [t]
    return [x for name in t.__tensor_flatten__()[0] for x in inner_tensors(getattr(t, name))]


def clip_grads_with_norm_(params: list, max_norm: float, norm: torch.Tensor) -> None:
    """torch.nn.utils.clip_grads_with_norm_ with foreach kernels, except for gradients that are Partial DTensors
    (a sequence-parallel norm's replicated weight, summed over the ranks later) on a torch whose DTensor
    foreach multiply cannot scale one in place: torch 2.11's sharding rule for _foreach_mul_ is not linear, so
    it all-reduces the gradient into a new tensor, scales that, and leaves the gradient unclipped. torch 2.13
    keeps it Partial and scales it (2.12 untried: taken as 2.11); mul_ tensor by tensor scales it on each."""
    if foreach_scales_partial():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return
    partial = [p for p in params if _is_partial(p.grad)]
    torch.nn.utils.clip_grads_with_norm_(partial, max_norm, norm, foreach=False)
    torch.nn.utils.clip_grads_with_norm_([p for p in params if not _is_partial(p.grad)], max_norm, norm, foreach=True)


def foreach_scales_partial() -> bool:
    """Whether DTensor's in-place foreach multiply scales a Partial DTensor (see clip_grads_with_norm_)."""
    return torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


def _is_partial(t: torch.Tensor) -> bool:
    return any(p.is_partial() for p in getattr(t, "placements", ()))


def pipeline_passes_integers() -> bool:
    """Whether pipeline stages can pass an integer tensor on (a mixture of experts' router counts): torch 2.11's
    give every tensor a stage receives a gradient, which an integer tensor cannot take."""
    return torch_private("StageMeta") is not None


def skip_pipeline_warmup(schedule) -> None:
    """The schedule's stages take the shapes given (set_stage_shapes) instead of voting on them over p2p."""
    if not hasattr(schedule, "_warmup_p2p"):
        # torch 2.11 holds no vote; from 2.15 the schedule skips it itself over a fake process group
        return
    static_mode = torch_private("InferenceMode").STATIC

    def static(stages, *args) -> None:
        for stage in stages:
            stage._inference_mode = static_mode

    schedule._warmup_p2p = static


@contextlib.contextmanager
def shape_propagation_counted(enter, leave):
    """Call enter()/leave() around DTensor's shape propagation (it runs each op again on stand-ins)."""
    propagator = torch_private("ShardingPropagator")
    real = propagator._propagate_tensor_meta_non_cached

    def propagate(prop, op_schema):
        enter()
        try:
            return real(prop, op_schema)
        finally:
            leave()

    propagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        propagator._propagate_tensor_meta_non_cached = real


@contextlib.contextmanager
def storage_resizes_observed(observe):
    """Every UntypedStorage.resize_ told to `observe(storage)` before it runs, and to the callable that returns
    after it: FSDP2 frees gathered parameters by resizing their storage to 0, a storage method that no dispatch
    mode sees and torch offers no hook for, so the method is swapped while active and put back on exit."""
    real = torch.UntypedStorage.resize_

    def resize_(st, size):
        done = observe(st)
        real(st, size)
        done()

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = real


@contextlib.contextmanager
def ddp_without_shape_check():
    """DDP's construction without its collective check that every rank's parameter shapes agree."""
    ddp_module = torch.nn.parallel.distributed
    real = ddp_module._verify_param_shape_across_processes
    ddp_module._verify_param_shape_across_processes = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ddp_module._verify_param_shape_across_processes = real


def launch_config(**fields):
    """torchrun's LaunchConfig. torch 2.11's has no shutdown_timeout: its ranks get a fixed 30 s between SIGTERM
    and SIGKILL instead of the one asked for."""
    from torch.distributed.launcher.api import LaunchConfig

    if "shutdown_timeout" not in {f.name for f in dataclasses.fields(LaunchConfig)}:
        fields.pop("shutdown_timeout", None)
    return LaunchConfig(**fields)


def stop_fork_server() -> None:
    """Stop this process's multiprocessing fork server (launch.py forks the ranks from it) and wait for it, so
    that a launch leaves no process behind and its CPU time (the server's and its ranks') is counted as this
    process's children's. Python's own, not torch's: multiprocessing offers no public way to stop the server
    (ForkServer._stop is what CPython's tests use; 3.8-3.14 have it). Without it the server ends when this
    process does. It is sent SIGTERM first: one still importing its preload (a Ctrl-C during start-up) would
    otherwise be waited for until its imports end, seconds of CPU."""
    import multiprocessing.forkserver
    import os
    import signal

    server = multiprocessing.forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    stop = getattr(server, "_stop", None)
    if stop is not None:
        stop()


# Private members of torch's classes that meshlm's subclasses override or read in place (where a wrapper here
# would only rename them); each is checked to exist on the installed torch by tests/unit/test_compat.py (of a
# tuple inside, one: torch releases name the same member differently).
PRIVATE_MEMBERS = {
    # engines/pipeline.py TimedStage: the shape-inference forward (one of the two: torch 2.11 has the second)
    "torch.distributed.pipelining.PipelineStage": (("_compute_outputs", "_shape_inference"),),
    "torch.distributed.tensor.parallel.ParallelStyle": ("_apply",),  # parallel/tensor_styles.py, lora.py
    "torch.distributed.tensor.parallel.ColwiseParallel": ("_prepare_input_fn", "_prepare_output_fn"),
    "torch.distributed._tools.mem_tracker.MemTracker": (  # train/probe.py PeakActivations
        "_pre_fw_hook",
        "_update_snap",
        "_mod_tracker",
        "_curr_mem_snap",
        "_WINFO",
        "_track_module_params_and_buffers",
        "_param_to_grad_hook_handles",
    ),
    "torch.distributed.checkpoint.FileSystemReader": ("_get_metadata_path",),  # checkpoint/safe_load.py SafeReader
    "torch._ops.OpOverload": ("_overloadpacket",),  # train/probe.py: an op's name
    "torch.nn.Module": ("_parameters", "_buffers"),  # models/materialize.py: tensors swapped in place
}
