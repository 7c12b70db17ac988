"""meshlm/compat.py against the installed (pinned) torch: every private name it looks up exists and does what
meshlm uses it for, a torch that lacks one gets its fallback or a one-line error, and no other module imports
a private torch name or uses a private member that compat.py does not declare."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import os
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers.one_rank import one_rank_group
from meshlm import compat
from meshlm.errors import MeshlmError

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [*sorted((ROOT / "src" / "meshlm").rglob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py"))]
COMPAT = ROOT / "src" / "meshlm" / "compat.py"
NOT_TORCH = {
    "_exit": "os._exit",
    "_init_weights": "transformers' PreTrainedModel._init_weights",
    "_actions": "argparse's ArgumentParser._actions (cli/__init__.py: the closest option to an unknown one; "
    "options.launch_flags: the flags add_launch_options declares)",
    "_attn_implementation": "transformers' config._attn_implementation (parallel/context.py: the cp attention)",
    "_grouped_mm": "transformers' integrations.moe._grouped_mm (plan/simulate_standins.py; test_plan_moe.py)",
}


@pytest.fixture(scope="module")
def one_rank():
    """A 1-rank gloo process group (the one the test found, if any) and its 1-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    with one_rank_group():
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))


@pytest.mark.parametrize("name", sorted(compat.PRIVATE))
def test_each_private_name_is_torchs_own(name):
    """compat's name is torch's own; where this torch lacks it, the fallback (a name without one fails here)."""
    module, attr, needed = compat.PRIVATE[name]
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        assert not isinstance(needed, str), f"torch {torch.__version__} lacks {module}.{attr}, which {needed} needs"
        found = needed
    assert getattr(compat, name) is found


def _owner(path: str):
    module, _, cls = path.rpartition(".")
    return getattr(importlib.import_module(module), cls)


def _assigned_in_init(cls) -> set[str]:
    """Instance attributes a class's __init__ names (they exist only on instances)."""
    return set(cls.__init__.__code__.co_names)


INSTANCES = {
    "torch._ops.OpOverload": lambda: torch.ops.aten.add.Tensor,
    "torch.nn.Module": torch.nn.Module,
}


def _names(member: str | tuple[str, ...]) -> tuple[str, ...]:
    return member if isinstance(member, tuple) else (member,)


@pytest.mark.parametrize(
    "owner, member", [(o, m) for o, members in sorted(compat.PRIVATE_MEMBERS.items()) for m in members]
)
def test_each_private_member_exists(owner, member):
    """Each member exists on the installed torch (of a tuple, one: its name on this release)."""
    cls = _owner(owner)
    found = INSTANCES[owner]() if owner in INSTANCES else cls
    has = [m for m in _names(member) if hasattr(found, m) or (found is cls and m in _assigned_in_init(cls))]
    assert has, f"{owner}.{member}"


def test_fallbacks_and_one_line_errors_for_a_torch_without_them(monkeypatch):
    monkeypatch.setitem(compat.PRIVATE, "gone", ("torch.no_such_module", "gone", "a feature"))
    monkeypatch.setitem(compat.PRIVATE, "GoneClass", ("torch.nn", "NoSuchClass", "a feature"))
    monkeypatch.setattr(compat, "CLASSES", (*compat.CLASSES, "GoneClass"))
    monkeypatch.setitem(compat.PRIVATE, "kept", ("torch.nn", "no_such_function", len))
    with pytest.raises(MeshlmError, match=r"^a feature needs torch's private torch.no_such_module.gone, which torch"):
        compat.torch_private("gone")(1)
    missing_class = compat.torch_private("GoneClass")

    class Sub(missing_class):  # a module that subclasses it still imports
        pass

    with pytest.raises(MeshlmError, match="a feature needs torch's private torch.nn.NoSuchClass"):
        Sub()
    assert compat.torch_private("kept") is len
    assert "\n" not in str(compat.missing("x", "y"))
    with pytest.raises(AttributeError):
        compat.no_such_name  # noqa: B018


def test_flatten_unflatten_and_their_fallbacks_agree():
    ts = [torch.arange(6.0).view(2, 3), torch.ones(4)]
    flat = compat.flatten_dense_tensors(ts)
    assert torch.equal(flat, compat._flatten_fallback(ts))
    for back in (compat.unflatten_dense_tensors(flat, ts), compat._unflatten_fallback(flat, ts)):
        assert all(torch.equal(a, b) for a, b in zip(back, ts, strict=True))


def test_set_element_batchnorm_and_checkpoint_wrapper():
    root = {"model": {"w": None}}
    compat.set_element(root, ("model", "w"), 3)
    assert root == {"model": {"w": 3}}
    assert isinstance(torch.nn.BatchNorm2d(2), compat.BatchNorm)
    assert not isinstance(torch.nn.Linear(1, 1), compat.BatchNorm)
    wrapped = compat.checkpoint_wrapper(torch.nn.Linear(2, 2))
    x = torch.ones(1, 2, requires_grad=True)
    wrapped(x).sum().backward()
    assert x.grad is not None


def test_all_gather_single_and_its_fallback_gather_the_same(one_rank, monkeypatch):
    """parallel/fsdp.py's blocking all-gather: torch's all_gather_single, or on a torch without it (2.11) the
    same collective under its older name."""
    x = torch.arange(4.0)
    for gather in (compat.all_gather_single, compat._all_gather_into_tensor):
        out = torch.zeros(4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the older name is deprecated where the new one exists
            gather(out, x, group=dist.group.WORLD)
        assert torch.equal(out, x)
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    assert compat.torch_private("all_gather_single") is compat._all_gather_into_tensor


def _clip_on_rank(rank: int, store: str, out: str) -> None:
    """One of two gloo ranks: a Partial gradient (each rank holds part of the sum [9, 12], as a sequence-parallel
    norm's weight gets it), a Shard and a Replicate one (each whole [9, 12] too) and a plain tensor's, clipped by
    compat's clip and, on copies of the Partial one, by torch's foreach clip; the whole gradients saved."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    whole = torch.tensor([9.0, 12.0])
    grads = {
        "partial": lambda: DTensor.from_local(whole / 3 * (rank + 1), mesh, [Partial()]),
        "shard": lambda: DTensor.from_local(whole[rank : rank + 1].clone(), mesh, [Shard(0)]),
        "replicate": lambda: DTensor.from_local(whole.clone(), mesh, [Replicate()]),
    }
    params = {}
    for name, grad in grads.items():
        params[name] = torch.nn.Parameter(DTensor.from_local(torch.zeros(2), mesh, [Replicate()]))
        params[name].grad = grad()
    compat.clip_grads_with_norm_(list(params.values()), 1.0, torch.tensor(15.0))
    plain = torch.nn.Parameter(torch.zeros(2))
    plain.grad = whole.clone()
    compat.clip_grads_with_norm_([plain], 1.0, torch.tensor(15.0))
    torchs = torch.nn.Parameter(DTensor.from_local(torch.zeros(2), mesh, [Replicate()]))
    torchs.grad = grads["partial"]()
    torch.nn.utils.clip_grads_with_norm_([torchs], 1.0, torch.tensor(15.0), foreach=True)
    clipped = {name: p.grad.full_tensor() for name, p in params.items()}
    torch.save({**clipped, "plain": plain.grad, "torch's foreach": torchs.grad.full_tensor()}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_clip_scales_partial_gradients_on_two_ranks(tmp_path):
    """Under sequence parallel a norm's replicated weight gets a Partial gradient; clipping must scale it like
    every other (torch 2.11's DTensor foreach multiply leaves it unscaled: tp 2 with sequence parallel then
    drifts from one process). compat takes torch's foreach path for it only where that scales it."""
    import torch.multiprocessing as mp

    mp.spawn(_clip_on_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    want = torch.tensor([0.6, 0.8])
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt")
        for name in ("partial", "shard", "replicate", "plain"):
            assert torch.allclose(got[name], want), (rank, name, got[name])
        if compat.foreach_scales_partial():
            assert torch.allclose(got["torch's foreach"], want), "compat takes torch's foreach path where it fails"


def test_cpu_rowwise_float8_from_torch_2_13():
    """parallel/float8.py refuses --float8 rowwise on CPU ranks where torch's CPU float8 matmul lacks row-wise
    scales (torch 2.11); torch 2.13 and later have them."""
    if torch.torch_version.TorchVersion(torch.__version__) >= "2.13":
        assert compat.cpu_rowwise_float8()


def test_storage_key_names_the_storage():
    t = torch.zeros(4)
    assert compat.storage_key(t[:2].untyped_storage()) == compat.storage_key(t.untyped_storage())
    assert compat.storage_key(torch.zeros(4).untyped_storage()) != compat.storage_key(t.untyped_storage())


def test_mesh_dtensor_and_fsdp_members(one_rank):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    flat = compat.flatten_mesh(one_rank, "ab")
    assert flat.mesh_dim_names == ("ab",) and flat.size() == 1
    d = distribute_tensor(torch.arange(4.0), one_rank["a"], [Shard(0)])
    compat.local_tensor(d).add_(1)
    assert torch.equal(d.full_tensor(), torch.arange(4.0) + 1)
    shape, offset = compat.compute_local_shape_and_global_offset(d.shape, d.device_mesh, d.placements)
    assert tuple(shape) == (4,) and tuple(offset) == (0,)
    assert compat.unshard_async(fully_shard(torch.nn.Linear(2, 2), mesh=one_rank["a"]))
    assert compat.default_store() is not None
    counted = []
    with compat.shape_propagation_counted(lambda: counted.append(1), lambda: None):
        distribute_tensor(torch.ones(2, 3), one_rank["a"], [Shard(0)]).sum(dim=0)
    assert counted  # DTensor's shape propagation ran through the counted hook
    compat.clear_dtensor_caches()


def test_zero_redundancy_optimizer_members(one_rank):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
    opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, lr=0.1)
    assert [compat.zero_owner(opt, p) for p in params] == [0, 0]
    assert compat.zero_param_index(opt) == {params[0]: 0, params[1]: 1}
    opt.param_groups[0]["lr"] = 0.5
    compat.zero_sync_param_groups(opt)
    assert opt.optim.param_groups[0]["lr"] == 0.5


class _Counted(torch.nn.Linear):
    forwards = 0

    def forward(self, x):
        _Counted.forwards += 1
        return super().forward(x)


@pytest.mark.parametrize("given", [False, True])
def test_given_stage_shapes_spare_the_shape_inference_forward(one_rank, given):
    """plan --simulate's pipeline (plan/fake_pipeline.py): a stage given its shapes runs one forward per
    micro-batch; without them torch runs one more on placeholders to learn them, which over fake collectives
    cannot pass its shapes on."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    _Counted.forwards = 0
    stage = PipelineStage(_Counted(3, 2), 0, 1, torch.device("cpu"), group=dist.group.WORLD)
    schedule = ScheduleGPipe(stage, 2, loss_fn=lambda out, y: ((out - y) ** 2).sum())
    if given:
        meta = dict(device="meta", requires_grad=True)
        compat.set_stage_shapes(stage, (torch.empty(2, 3, **meta),), (torch.empty(2, 2, **meta),))
        compat.skip_pipeline_warmup(schedule)
    schedule.step(torch.ones(4, 3), target=torch.zeros(4, 2))
    assert _Counted.forwards == 2 + (not given)
    assert stage.submod.weight.grad is not None


def test_launch_config_takes_the_shutdown_timeout_where_torch_has_it():
    """launch.py's LaunchConfig: torch 2.11 has no shutdown_timeout (a fixed 30 s); later releases take it."""
    from torch.distributed.launcher.api import LaunchConfig

    config = compat.launch_config(min_nodes=1, max_nodes=1, nproc_per_node=2, shutdown_timeout=7)
    assert isinstance(config, LaunchConfig) and config.nproc_per_node == 2
    has_field = "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}
    assert getattr(config, "shutdown_timeout", None) == (7 if has_field else None)


def test_rendezvous_and_ddp_members():
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    assert hasattr(DynamicRendezvousHandler, "_create_tcp_store_server")
    assert {"_bootstrap_store_info", "_shared_tcp_store_server"} <= _assigned_in_init(DynamicRendezvousHandler)
    assert hasattr(torch.nn.parallel.distributed, "_verify_param_shape_across_processes")
    with compat.ddp_without_shape_check():
        assert torch.nn.parallel.distributed._verify_param_shape_across_processes(None, None) is None


# ---------------------------------------------------------------- the seam holds


def _torch_aliases(tree: ast.Module) -> set[str]:
    """Names a module binds to torch modules (import torch, import torch.distributed as dist, from torch import nn)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names |= {a.asname or a.name for a in node.names if a.name[:1].islower()}
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


# public torch names that compat.py looks up because older torch releases lack them
RECENT = {attr for module, attr, _ in compat.PRIVATE.values() if not any(map(_private, [*module.split("."), attr]))}


def _hidden(name: str) -> bool:
    return _private(name) or name in RECENT


def private_torch_uses(path: Path, root: Path = ROOT) -> list[str]:
    """Imports of private (or RECENT) torch modules or names, and such attributes reached from a torch module alias."""
    tree = ast.parse(path.read_text())
    torch_names, found = _torch_aliases(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names if a.name.split(".")[0] == "torch"]
            found += [m for m in modules if any(map(_private, m.split(".")))]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            parts = node.module.split(".") + [a.name for a in node.names]
            found += [f"{node.module}: {', '.join(a.name for a in node.names)}"] * any(map(_hidden, parts))
        elif isinstance(node, ast.Attribute) and _hidden(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in torch_names:
                found.append(ast.unparse(node))
    return [f"{path.relative_to(root)}: {f}" for f in found]


def test_the_checker_sees_private_torch_uses(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch._utils import x\nfrom torch.utils import _pytree\n"
        "dist.distributed_c10d._get_default_store()\ntorch.nn.modules.batchnorm._BatchNorm\n"
        "dist.all_gather_single(out, x)\nfrom torch.distributed import all_gather_single\n"
    )
    assert len(private_torch_uses(bad, tmp_path)) == 6


def test_no_private_torch_name_outside_compat():
    found = [use for f in SOURCES if f != COMPAT for use in private_torch_uses(f)]
    assert not found, "import these through meshlm/compat.py:\n" + "\n".join(found)


def _private_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(private names this file defines: functions, classes, assignments, self./cls. attributes; private
    attribute names it reads or writes on anything)."""
    defined, used = set(), set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            defined.add(n.id)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            defined.add(n.target.id)
        elif isinstance(n, ast.Attribute) and _private(n.attr):
            used.add(n.attr)
            if isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                defined.add(n.attr)
    return defined, used


def test_private_members_outside_compat_are_declared_there():
    """A private attribute meshlm itself does not define is torch's (or another library's): it is read through
    compat.py's functions, or declared in compat.PRIVATE_MEMBERS (and so checked above)."""
    defined, used = set(), {}
    for f in SOURCES:
        d, u = _private_names(ast.parse(f.read_text()))
        defined |= d
        if f != COMPAT:
            used.update({name: f.relative_to(ROOT) for name in u})
    declared = {m for members in compat.PRIVATE_MEMBERS.values() for ms in members for m in _names(ms)}
    declared |= set(NOT_TORCH)
    undeclared = {name: str(where) for name, where in used.items() if name not in defined | declared}
    assert not undeclared, f"private members used outside compat.py and not declared there: {undeclared}"


def _children() -> set[int]:
    """This process's children (a zombie is still listed until it is reaped)."""
    found = set()
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                found.add(int(d.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _exec_done(pid: int, deadline_s: float = 30.0) -> bytes:
    """The command line of a child once exec has set it up: before exec /proc shows this process's own, and
    during exec (the new memory installed, its arguments not yet placed) an empty one."""
    mine = Path("/proc/self/cmdline").read_bytes()
    end = time.monotonic() + deadline_s
    while (cmdline := Path(f"/proc/{pid}/cmdline").read_bytes()) in (mine, b"") and time.monotonic() < end:
        time.sleep(0.05)
    return cmdline


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_stop_fork_server_ends_and_reaps_it():
    """launch.py stops its fork server after each launch: no process stays (a zombie would still be listed), so
    its CPU time and its ranks' count as the launcher's children's. The server is one of the children that
    ensure_running adds (multiprocessing's resource tracker may be the other, and stays), told by its command
    line once it has called exec."""
    import multiprocessing.forkserver

    compat.stop_fork_server()  # one an earlier test in this process left would not be started anew
    before = _children()
    multiprocessing.get_context("forkserver").set_forkserver_preload([])
    multiprocessing.forkserver.ensure_running()
    server = {pid for pid in _children() - before if b"multiprocessing.forkserver" in _exec_done(pid)}
    assert server, "no fork server started"
    compat.stop_fork_server()
    assert not server & _children()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_stop_fork_server_does_not_wait_for_its_imports(tmp_path, monkeypatch):
    """A server stopped while it still imports its preload (Ctrl-C while a launch starts) ends at once rather than
    when its imports are done."""
    import multiprocessing.forkserver

    compat.stop_fork_server()
    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    before = _children()
    multiprocessing.get_context("forkserver").set_forkserver_preload(["slow_to_import"])
    try:
        multiprocessing.forkserver.ensure_running()
        server = set()
        while not server:
            server = {pid for pid in _children() - before if b"multiprocessing.forkserver" in _exec_done(pid)}
        start = time.monotonic()
        compat.stop_fork_server()
        assert time.monotonic() - start < 30 and not server & _children()
    finally:
        multiprocessing.get_context("forkserver").set_forkserver_preload([])
