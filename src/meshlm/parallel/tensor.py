"""Tensor parallel with DTensor: every block's matmuls split across the ranks of the tp mesh.

Attention: q/k/v projections column-wise (each rank gets whole heads), output
projection row-wise; MLP: up/gate column-wise, down row-wise. A block then costs
two all-reduces forward (after the row-wise layers) and two backward (into the
block's attention and MLP inputs). The plan is the family registry's
(models/families): the model config's `base_model_tp_plan` when transformers
ships one, with the registry's entries over it or in its place; this module
applies the styles a plan names without knowing which family names them.

With sequence parallel, norms run on a slice of the sequence: the residual
stream between the row-wise outputs and the next block input stays sharded on
the sequence dimension, which turns each all-reduce into a reduce-scatter plus
an all-gather and divides norm activations by tp. Each run of layers (the whole
model, or one pipeline stage) enters and leaves the sequence-parallel region at
its ends, so stage boundaries and the LM head see whole sequences. It is for
training: the sequence length must be a multiple of tp.

`apply_tp` works on any transformers model, for training and for inference
with a KV cache: attention reshapes with -1 heads, so it runs on the local heads.
"""

from __future__ import annotations

import copy
import fnmatch

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from meshlm.errors import MeshlmError
from meshlm.models.families import decoder, facts, family, still_working, tied, tp_plan
from meshlm.parallel.loss import ChunkedLossHead
from meshlm.parallel.tensor_styles import (
    STYLES,
    EmbeddingRowwise,
    FreshRowwise,
    GatheredColwise,
    LocalParams,
    MlaKvAProj,
    NormSequenceParallel,
    ScatteredRowwise,
    SequenceShardedParams,
    reshard_first,
)


def check_tp(config, tp: int, option: str = "", choose: str = "a tp") -> None:
    """Before building anything: the family has a plan, and tp divides the heads, key/value heads and MLP width.
    `option` names what asked for tp (--parallel.tp, or generate's --mode tp), `choose` what the user changes."""
    option = option or f"--parallel.tp {tp}"
    if tp == 1:
        return
    unknown = sorted({s for s in tp_plan(config).values() if s not in STYLES})
    if unknown:
        raise MeshlmError(
            f"tensor parallel for {config.model_type!r} needs plan styles meshlm does not implement: "
            f"{', '.join(unknown)}; layouts that still work: {still_working(config, tp=False)}"
        )
    lists = sorted({k.split(".*.")[0] for k in tp_plan(config) if ".*." in k} - {family(config).layers})
    if lists:
        raise MeshlmError(
            f"tensor parallel for {config.model_type!r}: its plan splits blocks under {', '.join(lists)}, and "
            f"meshlm splits the blocks of one layer list ({family(config).layers}); layouts that still work: "
            f"{still_working(config, tp=False)}"
        )
    f = facts(config)
    for what, n in (("attention heads", f.heads), ("key/value heads", f.kv_heads), ("MLP width", f.mlp)):
        if n % tp:
            raise MeshlmError(f"{option} does not divide the model's {n} {what}; pick {choose} that divides {n}")
    if f.experts:  # TP splits a mixture of experts by whole experts (parallel/expert.py, imported only then)
        from meshlm.parallel.expert import check_experts

        check_experts(config, tp, option)


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool = False,
    runs: list[list[int]] | None = None,
    sharded_logits: bool = False,
) -> nn.Module:
    """Shard `model`'s blocks, embedding and LM head over `tp_mesh` in place. `runs` are the runs of
    consecutive layer indices present (one per pipeline stage; default all layers): sequence parallel
    begins and ends at each run. `sharded_logits`: the head returns logits sharded over the vocabulary
    (a DTensor) for a loss computed under `loss_parallel`; otherwise they are gathered. What check_tp says was
    said before anything was built (layout.resolve for training, generate's prepare), once per process."""
    config = model.config
    fam = family(config)
    dec = decoder(model)
    layers = getattr(dec, fam.layers)
    if runs is None:
        runs = [list(range(len(layers)))]
    present = [str(i) for run in runs for i in run]
    plan: dict[str, object] = {}
    bare = _bare_parameters(tp_plan(config), fam.layers, [_layer(layers, i) for i in present])
    params = {f"{owner}.{name}" for owner, names in bare.items() for name in names}
    embed = next((n for n, m in dec.named_modules() if m is model.get_input_embeddings()), None)
    whole = _whole_blocks(tp_plan(config), fam.layers)
    for pattern, style in tp_plan(config).items():
        # a bare parameter is split by its owner's style (LocalParams); the token embedding by _shard_vocabulary
        if pattern not in params and pattern != embed:
            kind = STYLES[style]
            inside = any(pattern.startswith(f"{fam.layers}.*.{w}.") for w in whole) or _beside_experts(pattern, fam)
            kind = FreshRowwise if inside and kind is RowwiseParallel else kind  # whole output, added to in place
            plan[pattern] = _style(kind, config, sequence_parallel and not inside, tuple(bare.get(pattern, ())))
    if any(type(m).__module__.startswith("peft.") for m in dec.modules()):  # LoRA's adapters, sharded as their base
        from meshlm.parallel.lora import adapt_tp_plan

        adapt_tp_plan(dec, plan, present[0])
    if any(type(m).__name__ == "Float8Linear" for m in dec.modules()):  # --float8: torchao's float8 TP styles
        from meshlm.parallel.float8 import tp_styles

        plan = tp_styles(plan)
    if sequence_parallel:
        for i in present:
            for norm in _block_norms(_layer(layers, i)):
                # local outputs: a post-norm feeds the residual stream, which stays a local tensor
                plan[f"{fam.layers}.{i}.{norm}"] = NormSequenceParallel(use_local_output=True)
            if next(_layer(layers, i).parameters(recurse=False), None) is not None:  # residual scales
                plan[f"{fam.layers}.{i}"] = SequenceShardedParams()
    parallelize_module(dec, tp_mesh, _present(dec, plan))
    seq = Shard(1) if sequence_parallel else Replicate()
    for i in present:
        for name in _split_submodules(tp_plan(config), fam.layers, _layer(layers, i)):
            hook = _whole_block if name in whole else _replicated_input
            hook(_layer(layers, i).get_submodule(name), tp_mesh, seq)
    if sequence_parallel:
        _sequence_parallel_hooks(layers, present, runs, tp_plan(config), fam, tp_mesh)
    for i in present:
        for name in _split_submodules(tp_plan(config), fam.layers, _layer(layers, i)):
            _local_head_counts(_layer(layers, i).get_submodule(name), tp_mesh.size())
    _shard_vocabulary(model, tp_mesh, sharded_logits)
    return model


def _style(kind: type, config, sequence_parallel: bool, split: tuple[str, ...] = ()):
    """One plan entry's style object (`split`: the bare parameters of a LocalParams module the plan splits)."""
    if kind is MlaKvAProj:  # it splits its output at the shared rotary key
        return kind(config.qk_rope_head_dim)
    if kind is LocalParams:
        return kind(split)
    if kind in (EmbeddingRowwise, GatheredColwise, ScatteredRowwise):  # outputs laid out alike with or without SP
        return kind()
    # Inside a block the row-wise outputs feed the residual stream: sequence-sharded under SP.
    return kind(output_layouts=Shard(1)) if issubclass(kind, RowwiseParallel) and sequence_parallel else kind()


def _bare_parameters(plan: dict[str, str], layers: str, blocks: list[nn.Module]) -> dict[str, list[str]]:
    """Plan entries that name a parameter, not a module (transformers splits attention sinks `colwise` and gives
    their attention `local_params`): owner pattern -> its split parameters' names, read on this model's blocks
    (a family may have sinks in its sliding-window layers only). The parallelize plan leaves their entries out."""
    out: dict[str, list[str]] = {}
    for key, style in plan.items():
        owner, _, name = key.removeprefix(f"{layers}.*.").rpartition(".")
        if not key.startswith(f"{layers}.*.") or not owner:
            continue
        owners = [b.get_submodule(owner) for b in blocks if _has(b, owner)]
        if any(m._parameters.get(name) is not None for m in owners):
            if style != "colwise" or plan.get(f"{layers}.*.{owner}") != "local_params":
                raise MeshlmError(f"TP plan entry {key!r}: a bare parameter ({style}) meshlm splits only as "
                                  f"transformers' local_params owner with colwise entries")  # fmt: skip
            out.setdefault(f"{layers}.*.{owner}", []).append(name)
    return out


def _has(block: nn.Module, path: str) -> bool:
    try:
        block.get_submodule(path)
        return True
    except AttributeError:
        return False


def _split_submodules(plan: dict[str, str], layers: str, block: nn.Module) -> list[str]:
    """The block's submodules the plan splits inside (attention, MLP), in plan order: "layers.*.self_attn.q_proj"
    -> "self_attn", where this block has the split module; "layers.*.mlps.*.up_proj" -> "mlps.0", "mlps.1" (a block
    may hold two of each in a ModuleList, which is never called itself). A hybrid's linear-attention blocks hold
    none of the attention's split projections: their attention stays whole, its input a plain tensor."""
    names = []
    for key in plan:
        first, _, rest = key.removeprefix(f"{layers}.*.").partition(".")
        sub = getattr(block, first, None) if key.startswith(f"{layers}.*.") and rest else None
        subs = {first: (sub, rest)}
        if isinstance(sub, nn.ModuleList) and rest.startswith("*."):
            subs = {f"{first}.{i}": (m, rest[2:]) for i, m in enumerate(sub)}
        for name, (m, inner) in subs.items():
            if m is not None and any(fnmatch.fnmatchcase(n, inner) for n, _ in m.named_modules()):
                names.append(name)
    return list(dict.fromkeys(names))


def _children(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """A block's submodules as its forward calls them: a ModuleList's entries (two norms, attentions
    or MLPs per block) in its place."""
    out = []
    for name, m in block.named_children():
        out += [(f"{name}.{i}", c) for i, c in enumerate(m)] if isinstance(m, nn.ModuleList) else [(name, m)]
    return out


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _block_norms(block: nn.Module) -> list[str]:
    """A block's own norms: under sequence parallel they run on each rank's slice of the sequence."""
    return [n for n, m in _children(block) if _is_norm(m)]


def _whole_children(block: nn.Module, plan: dict[str, str], fam, mesh: DeviceMesh) -> None:
    """Under sequence parallel, a block's submodules with parameters that the plan leaves whole (the attention of a
    plan that splits only experts; a mixture of experts left whole; a hybrid's linear attention)
    take the whole sequence: on a slice of it attention would see only this rank's keys, and their replicated
    weights only this rank's tokens' gradients. A mixture of experts that parallel/expert.py splits gathers its own."""
    split = _split_submodules(plan, fam.layers, block)
    holder, _, experts = (fam.experts or "").removeprefix(f"{fam.layers}.*.").partition(".")
    for name, m in _children(block):
        moe = name == holder and _has(m, experts)  # a dense MLP at the experts' path: whole
        if name not in split and not moe and not _is_norm(m) and next(m.parameters(), None) is not None:
            _whole_block(m, mesh, Shard(1))


def _replicated_input(module: nn.Module, mesh: DeviceMesh, seq) -> None:
    """One all-reduce (or all-gather) into attention and into the MLP, shared by q/k/v and up/gate: their input
    (first positional argument or `hidden_states`) becomes a replicated DTensor, whose gradient DTensor
    all-reduces once in backward (what PrepareModuleInput does, for either way a block passes it)."""

    def replicate(x):
        if isinstance(x, DTensor):
            return x.redistribute(placements=[Replicate()])
        return DTensor.from_local(x, mesh, [seq], run_check=False).redistribute(placements=[Replicate()])

    def hook(mod, args, kwargs):
        if args:
            return (replicate(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": replicate(kwargs["hidden_states"])}

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _whole_blocks(plan: dict[str, str], layers: str) -> set[str]:
    """The block submodules that hold whole experts (whole_experts: the block holding
    them, and dense MLPs at the same path too) or expert embeddings (embedding_rowwise inside a block: the looked-up
    rows multiply the block's input)."""
    styles = ("whole_experts", "embedding_rowwise")
    inside = [k.removeprefix(f"{layers}.*.") for k, v in plan.items() if v in styles and k.startswith(f"{layers}.*.")]
    return {k.partition(".")[0] for k in inside}


def _beside_experts(pattern: str, fam) -> bool:
    """A split module inside a mixture of experts' block beside its dispatched experts (shared experts, in blocks
    whose dense siblings keep theirs at the block's own path): the block runs on the whole sequence
    (parallel/expert.py), so its row-wise outputs stay whole under sequence parallel."""
    holder, _, experts = (fam.experts or "").rpartition(".")
    inner = pattern.removeprefix(f"{holder}.").split(".") if holder and pattern.startswith(f"{holder}.") else []
    return len(inner) > 1 and inner[0] != experts


def _whole_block(module: nn.Module, mesh: DeviceMesh, seq) -> None:
    """A block submodule holding whole experts (WholeExperts) takes its input whole and local: its router and the
    experts compute on every token of it, so each rank's input gradient comes out whole (the split projections
    beside them all-reduce their own), and nothing sums it again. Under sequence parallel the input is gathered
    and each output laid out [batch, sequence, ...] cut back to this rank's slice (router logits stay whole)."""

    def whole(mod, args, kwargs):
        key = "hidden_states" if not args else None
        x = kwargs[key] if key else args[0]
        x = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [seq], run_check=False)
        x = x.redistribute(placements=[Replicate()]).to_local()
        return ((x, *args[1:]), kwargs) if not key else (args, {**kwargs, key: x})

    def cut(t: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(t, mesh, [Replicate()], run_check=False).redistribute(placements=[seq]).to_local()

    def sliced(mod, args, kwargs, out):
        x = args[0] if args else kwargs["hidden_states"]
        outs = list(out) if isinstance(out, tuple) else [out]
        if outs[0].shape[:2] != x.shape[:2]:  # a MoE block may return its rows flat: [batch x sequence, hidden]
            outs[0] = outs[0].view(x.shape)
        # hyper-connections return several tensors per token: each is cut
        outs = [cut(t) if isinstance(t, torch.Tensor) and t.shape[:2] == x.shape[:2] else t for t in outs]
        return tuple(outs) if isinstance(out, tuple) else outs[0]

    module.register_forward_pre_hook(whole, with_kwargs=True)
    if seq != Replicate():
        module.register_forward_hook(sliced, with_kwargs=True)


def _shard_vocabulary(model: nn.Module, mesh: DeviceMesh, sharded_logits: bool) -> None:
    """Vocabulary parallel (as torchtitan): the embedding's rows and the LM head's rows split over
    the ranks. A large vocabulary is a big share of a model (128K tokens x 4096: 1.05B of 8B), so neither stays whole.
    The embedding looks up its own rows and all-reduces; the head yields its slice of the logits. A tied head
    is the embedding's own (sharded) weight again. A pipeline rank may hold neither."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    head_tied = tied(model)  # before the weights are replaced
    if embed is not None:
        parallelize_module(embed, mesh, EmbeddingRowwise())
    if head is not None:
        # A head that computes the loss itself over chunks (parallel/loss.py) keeps each chunk's logits sharded
        # inside and returns the (replicated) loss: its output is never sharded.
        sharded_logits = sharded_logits and not isinstance(head, ChunkedLossHead)
        out = Shard(-1) if sharded_logits else Replicate()
        parallelize_module(head, mesh, ColwiseParallel(output_layouts=out, use_local_output=not sharded_logits))
        if head_tied:
            head.weight = embed.weight


def _present(dec: nn.Module, plan: dict) -> dict:
    """The plan's keys for the modules this model has. transformers' plans name every variant's modules (q_proj,
    or q_a_proj/q_b_proj with a q LoRA rank; a hybrid's attention in its linear-attention layers too), and
    parallelize_module warns of each it cannot find, then skips it: a key found everywhere it reaches is kept, one
    found in some layers only becomes those layers' paths, one found nowhere is dropped."""
    out = {}
    for key, style in plan.items():
        paths, everywhere = _paths(dec, key)
        out |= {key: style} if everywhere else dict.fromkeys(paths, style)
    return out


def _paths(module: nn.Module, pattern: str) -> tuple[list[str], bool]:
    """The submodule paths a plan key names (its tokens matched as fnmatch patterns against child names, as
    parallelize_module matches them), and whether every child it reaches on the way has the rest."""
    from fnmatch import fnmatch

    head, _, rest = pattern.partition(".")
    paths, everywhere = [], True
    for name, child in module.named_children():
        if fnmatch(name, head):
            below, whole = _paths(child, rest) if rest else ([""], True)
            paths += [f"{name}.{p}" if p else name for p in below]
            everywhere &= whole
    return paths, everywhere and bool(paths)


def _layer(layers: nn.Module, i) -> nn.Module:
    """Layer i of a ModuleList, or of the ModuleDict a pipeline stage keeps (keyed by the original index)."""
    return layers[int(i)] if isinstance(layers, nn.ModuleList) else layers[str(i)]


def _sequence_parallel_hooks(layers, present: list[str], runs, plan: dict[str, str], fam, mesh: DeviceMesh) -> None:
    """Whole submodules take the whole sequence; each run of layers enters and leaves the sequence shards."""
    for i in present:
        _whole_children(_layer(layers, i), plan, fam, mesh)
    for run in runs:
        _sequence_parallel_region(_layer(layers, run[0]), _layer(layers, run[-1]), mesh)


def _sequence_parallel_region(first: nn.Module, last: nn.Module, mesh: DeviceMesh) -> None:
    """Enter before `first`: each rank keeps its slice of the sequence (no communication; backward
    all-gathers). Leave after `last`: all-gather the sequence (backward keeps the slice). Hooks rather
    than PrepareModuleInput because blocks take a varying number of positional arguments."""

    def enter(module, args):
        x = DTensor.from_local(args[0], mesh, [Replicate()], run_check=False)
        return (x.redistribute(placements=[Shard(1)]).to_local(), *args[1:])

    def leave(module, args, out):
        return reshard_first(out, mesh, Shard(1), Replicate())

    first.register_forward_pre_hook(enter)
    last.register_forward_hook(leave)


def _local_head_counts(module: nn.Module, tp: int) -> None:
    """Attention modules that store head counts or split sizes must see the per-rank values; one that reads
    them from its config (a fused [q | k | v] sliced by config.num_attention_heads) gets a config of its own."""
    for name in ("num_heads", "num_attention_heads", "num_key_value_heads", "split_size"):
        if isinstance(getattr(module, name, None), int):
            setattr(module, name, getattr(module, name) // tp)
    config = getattr(module, "config", None)
    if config is not None and isinstance(getattr(config, "num_attention_heads", None), int):
        module.config = copy.copy(config)
        for name in ("num_attention_heads", "num_key_value_heads"):
            if isinstance(getattr(config, name, None), int):
                setattr(module.config, name, getattr(config, name) // tp)
