"""Pipeline parallel: consecutive blocks on consecutive ranks, micro-batches flowing through them.

The model is cut into stages (embeddings + first blocks | ... | last blocks +
final norm + LM head), balanced by parameter count or cut by hand with
--parallel.pp-split. torch.distributed.pipelining runs the schedule: GPipe (all
forwards, then all backwards), 1F1B (same bubble, at most P micro-batches of
activations alive) or interleaved 1F1B (V stages per rank, bubble divided by V).
With M micro-batches and P stages, a rank idles (P-1)/(M+P-1) of the step; we
measure the real figure by timing each stage's compute against the step time.

`build_stages` and `Stage` are plain: layer split and generation reuse them.
"""

from __future__ import annotations

import contextlib
import time
from functools import cache, partial

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from meshlm.config import Config
from meshlm.errors import MeshlmError
from meshlm.models.parts import Parts, decoder, family, parts_of, tied
from meshlm.parallel.engine import Engine

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}


class Stage(nn.Module):
    """Blocks `layer_ids` of a transformers decoder, with the embeddings when first and the final norm and
    LM head when last. It holds the model's own modules (nothing is copied) and runs like the model's own
    forward: positions, rotary embeddings and the causal mask are made here, so every stage has them.
    Works under no_grad with a KV cache (past_key_values) for generation."""

    def __init__(self, model: nn.Module, p: Parts, index: int, layer_ids: list[int], last: bool):
        super().__init__()
        dec = decoder(model, p)
        self.config, self.parts, self.index, self.layer_ids = model.config, p, index, layer_ids
        self.is_first, self.is_last = index == 0, last
        self.embed = nn.ModuleDict({n: getattr(dec, n) for n in p.embed}) if self.is_first else None
        self.layers = nn.ModuleList([getattr(dec, p.layers)[i] for i in layer_ids])
        self.rotary = getattr(dec, p.rotary) if p.rotary else None
        self.norm = getattr(dec, p.norm) if last else None
        self.head = model.get_output_embeddings() if last else None
        # A head tied to the token embedding: the last stage keeps a reference to the embedding module
        # too, so wrappers that swap parameters (FSDP) see every module holding the weight.
        self.tied_embed = model.get_input_embeddings() if last and not self.is_first and tied(model) else None

    def get_input_embeddings(self):
        return self.embed[self.parts.embed[0]] if self.embed is not None else self.tied_embed

    def get_output_embeddings(self):
        return self.head

    def forward(self, x, position_ids=None, attention_mask=None, past_key_values=None):
        """x: token ids on the first stage, hidden states after it. Returns hidden states, or logits if last."""
        if position_ids is None:  # a stage's cache may hold only its own layers: ask the first of them
            past = past_key_values.get_seq_length(self.layer_ids[0]) if past_key_values is not None else 0
            position_ids = torch.arange(past, past + x.shape[1], device=x.device).unsqueeze(0)
        h = x
        if self.embed is not None:
            h = self.embed[self.parts.embed[0]](x)
            if "wpe" in self.embed:  # absolute positions (GPT-2)
                h = h + self.embed["wpe"](position_ids)
            if "drop" in self.embed:
                h = self.embed["drop"](h)
        kw = {"position_ids": position_ids, "past_key_values": past_key_values,
              "use_cache": past_key_values is not None}
        if self.rotary is not None:
            kw["position_embeddings"] = self.rotary(h, position_ids)
        masks = _Masks(self.config, h, attention_mask, past_key_values, position_ids)
        for i, layer in zip(self.layer_ids, self.layers):
            h = layer(h, attention_mask=masks.of(i), **kw)
        if self.is_last:
            h = self.norm(h)
            h = self.head(h.to(self.head.weight.device))  # layer split: a tied head lives with the embedding
        return h


class _Masks:
    """The mask each layer's attention type needs, made once per forward (as the model's own forward does)."""

    def __init__(self, config, h, attention_mask, past_key_values, position_ids):
        self.config, self.made = config, {}
        self.kw = {"config": config, "inputs_embeds": h, "attention_mask": attention_mask,
                   "past_key_values": past_key_values, "position_ids": position_ids}

    def of(self, layer: int):
        types = getattr(self.config, "layer_types", None)
        sliding = getattr(self.config, "sliding_window", None)
        kind = types[layer] if types else ("sliding_attention" if sliding else "full_attention")
        if kind not in self.made:
            make = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
            # Sizes come from this layer's cache entry: the default (the model's first layer) is empty on
            # later stages, and already holds this step's keys when stages share one cache (layer split).
            self.made[kind] = make(**self.kw, layer_idx=layer)
        return self.made[kind]


def _numel(*modules) -> int:
    return sum(p.numel() for m in modules if m is not None for p in m.parameters())


def stage_layers(model: nn.Module, n_stages: int, pp_split: str = "") -> list[list[int]]:
    """Layer indices of each stage: `pp_split` ("4,8,12": first layer of each stage after the first) or
    balanced so the largest stage holds as few parameters as possible (embeddings count for the first
    stage, final norm and LM head for the last)."""
    p = parts_of(model, "pipeline parallel")
    dec = decoder(model, p)
    layers = getattr(dec, p.layers)
    n = len(layers)
    if n_stages > n:
        raise MeshlmError(f"{n_stages} stages need at least {n_stages} layers; the model has {n}")
    if pp_split:
        starts = parse_split(pp_split, n_stages, n)
    else:
        first = _numel(*(getattr(dec, e) for e in p.embed))
        last = _numel(getattr(dec, p.norm), model.get_output_embeddings())
        starts = _balanced([_numel(layer) for layer in layers], n_stages, first, last)
    bounds = [0, *starts, n]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def parse_split(pp_split: str, n_stages: int, n_layers: int) -> list[int]:
    """--parallel.pp-split "4,8,12" -> [4, 8, 12], checked against the stage and layer counts."""
    try:
        starts = [int(s) for s in pp_split.split(",")]
    except ValueError:
        raise MeshlmError(f"--parallel.pp-split must be comma-separated layer indices, got {pp_split!r}") from None
    if len(starts) != n_stages - 1 or starts != sorted(set(starts)) or not all(0 < s < n_layers for s in starts):
        raise MeshlmError(f"--parallel.pp-split needs {n_stages - 1} increasing layer indices between 1 and "
                          f"{n_layers - 1} (the first layer of each stage after the first), got {pp_split!r}")
    return starts


def _balanced(costs: list[int], n_stages: int, first: int, last: int) -> list[int]:
    """Contiguous split of `costs` into n_stages non-empty runs: the smallest possible largest run, and
    among splits that reach it the most even one (least sum of squares). Two exact DPs over the layers."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(a, b, s):
        return prefix[b] - prefix[a] + (first if s == 0 else 0) + (last if s == n_stages - 1 else 0)

    def solve(score, combine, limit=float("inf")):
        @cache
        def best(s, a):  # stages s.. over layers a..: (score, starts of stages s+1..)
            if s == n_stages - 1:
                c = cost(a, n, s)
                return (score(c), ()) if c <= limit else (float("inf"), ())
            options = [(combine(score(cost(a, b, s)), best(s + 1, b)[0]), (b, *best(s + 1, b)[1]))
                       for b in range(a + 1, n - (n_stages - 2 - s)) if cost(a, b, s) <= limit]
            return min(options, default=(float("inf"), ()))

        return best(0, 0)

    largest, _ = solve(lambda c: c, max)
    return list(solve(lambda c: c * c, lambda x, y: x + y, limit=largest)[1])


def build_stages(model: nn.Module, n_stages: int, pp_split: str = "") -> list[Stage]:
    """All stages of `model` (the model itself is left whole)."""
    p = parts_of(model, "pipeline parallel")
    runs = stage_layers(model, n_stages, pp_split)
    return [Stage(model, p, i, run, last=i == n_stages - 1) for i, run in enumerate(runs)]


def keep_only(model: nn.Module, stages: list[Stage]) -> nn.Module:
    """Drop the parts of `model` that no local stage uses. Names stay those of the whole model (blocks are
    kept in a ModuleDict under their original index), so checkpoints from any layout line up."""
    p = stages[0].parts
    dec = decoder(model, p)
    layers = getattr(dec, p.layers)
    setattr(dec, p.layers, nn.ModuleDict({str(i): layers[i] for s in stages for i in s.layer_ids}))
    keep_embed = any(s.is_first for s in stages)
    for name in p.embed:
        if not keep_embed and not (name == p.embed[0] and any(s.tied_embed is not None for s in stages)):
            setattr(dec, name, None)
    if not any(s.is_last for s in stages):
        setattr(dec, p.norm, None)
        model.lm_head = None
    return model


def virtual_stages(cfg: Config) -> int:
    return cfg.parallel.virtual_stages if cfg.parallel.schedule == "interleaved-1f1b" else 1


def split_for_rank(model: nn.Module, cfg: Config, pp_rank: int) -> list[Stage]:
    """This rank's stages, with the rest of `model` dropped. Interleaved ("looped") placement: rank r
    holds stages r, r + pp, r + 2 pp, ..."""
    pp, virtual = cfg.parallel.pp, virtual_stages(cfg)
    stages = build_stages(model, pp * virtual, cfg.parallel.pp_split)
    mine = [stages[pp_rank + v * pp] for v in range(virtual)]
    keep_only(model, mine)
    return mine


def micro_batches(cfg: Config) -> int:
    return cfg.parallel.micro_batches or 2 * cfg.parallel.pp


def check_pipeline(cfg: Config, model_config) -> None:
    """One-line errors for splits and schedules that cannot run, before any rank starts (no hangs)."""
    pp, m, sched = cfg.parallel.pp, micro_batches(cfg), cfg.parallel.schedule
    family(model_config, "pipeline parallel")
    n_stages, layers = pp * virtual_stages(cfg), model_config.num_hidden_layers
    if n_stages > layers:
        raise MeshlmError(f"{n_stages} pipeline stages need at least {n_stages} layers; the model has {layers}: "
                          f"lower --parallel.pp or --parallel.virtual-stages")
    if cfg.parallel.pp_split:
        parse_split(cfg.parallel.pp_split, n_stages, layers)
    if cfg.micro_batch_size % m:
        raise MeshlmError(f"--micro-batch-size {cfg.micro_batch_size} does not split into --parallel.micro-batches "
                          f"{m} equal pipeline micro-batches; use a micro-batch size that is a multiple of {m}")
    if sched == "1f1b" and m < pp:
        raise MeshlmError(f"--parallel.schedule 1f1b needs at least pp = {pp} micro-batches, got "
                          f"--parallel.micro-batches {m}; raise it or use --parallel.schedule gpipe")
    if sched == "interleaved-1f1b":
        if cfg.parallel.virtual_stages < 2:
            raise MeshlmError("--parallel.schedule interleaved-1f1b needs --parallel.virtual-stages 2 or more")
        rounds = max(1, m // pp)
        if m % rounds:
            raise MeshlmError(f"--parallel.schedule interleaved-1f1b runs micro-batches in rounds of pp = {pp}; "
                              f"--parallel.micro-batches {m} is not a multiple of {rounds} rounds: use a multiple of {pp}")


class _Clock:
    """Adds up intervals: wall time on CPU; CUDA events on GPU (no synchronisation until read)."""

    def __init__(self, device: torch.device):
        self.cuda, self.cpu_s, self.events = device.type == "cuda", 0.0, []

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, started) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((started, end))
        else:
            self.cpu_s += time.perf_counter() - started

    def read_and_reset(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            self.cpu_s += sum(a.elapsed_time(b) for a, b in self.events) / 1000
        total, self.cpu_s, self.events = self.cpu_s, 0.0, []
        return total


class TimedStage(PipelineStage):
    """A PipelineStage that adds up the time it computes; the rest of a step it waits (the bubble)."""

    def __init__(self, *args, clock: _Clock, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock = clock

    def _compute_outputs(self, *args, module, **kwargs):
        # The first step infers activation shapes with one extra forward. Under DDP it must not arm the
        # gradient all-reduce: no backward of that forward ever comes, and DDP's reducer would fail later.
        with module.no_sync() if isinstance(module, DDP) else contextlib.nullcontext():
            return module(*args, **kwargs)

    def forward_one_chunk(self, *args, **kwargs):
        t = self.clock.start()
        out = super().forward_one_chunk(*args, **kwargs)
        self.clock.stop(t)
        return out

    def backward_one_chunk(self, *args, **kwargs):
        t = self.clock.start()
        out = super().backward_one_chunk(*args, **kwargs)
        self.clock.stop(t)
        return out


def _scaled_loss(loss_function, scale: int, logits, ids):
    # Each micro-batch's mean loss / (micro-batches per step): the gradients add up to the step's mean.
    return loss_function(logits, ids, vocab_size=logits.shape[-1]) / scale


class PipelineEngine(Engine):
    """Runs this rank's stages under a torch.distributed.pipelining schedule. `model` is the pruned model
    (checkpoints, optimizer), `modules` the stage modules after TP / FSDP / DDP were applied."""

    name = "pipeline"

    def __init__(self, model, stages: list[Stage], modules: list[nn.Module], cfg: Config, rt, mesh, model_tied: bool):
        super().__init__(model, cfg, rt, mesh)
        pp_mesh = mesh["pp"]
        self.pp, self.pp_group = pp_mesh.size(), pp_mesh.get_group()
        self.m, sched = micro_batches(cfg), cfg.parallel.schedule
        self.virtual = virtual_stages(cfg)
        n_stages = self.pp * self.virtual
        self.compute, self.step_clock = _Clock(rt.device), _Clock(rt.device)
        self.stages = [TimedStage(mod, s.index, n_stages, rt.device, group=self.pp_group, clock=self.compute)
                       for s, mod in zip(stages, modules)]
        loss = partial(_scaled_loss, model.loss_function, self.m * cfg.grad_accum)
        kind = SCHEDULES[sched]
        first = self.stages if kind is ScheduleInterleaved1F1B else self.stages[0]
        self.schedule = kind(first, self.m, loss_fn=loss, scale_grads=False)
        # A tied embedding (GPT-2) is used by the first stage and the last: each holds a copy, and
        # their gradients are summed after every step so both copies take the same update.
        self.tied_weight = self.tied_group = None
        if model_tied:
            self.tied_group = _first_last_groups(mesh)
            embed = model.get_input_embeddings()
            self.tied_weight = embed.weight if embed is not None else None

    def train_step(self, micro_batches):
        total = torch.zeros((), device=self.rt.device)
        for ids in micro_batches:
            losses: list[torch.Tensor] = []
            t = self.step_clock.start()
            self.schedule.step(ids, target=ids, losses=losses, return_outputs=False)
            self.step_clock.stop(t)
            if losses:
                total += torch.stack(losses).sum().detach()
        # The loss lives on the last stage; the trainer logs from rank 0 (the first).
        dist.broadcast(total, group=self.pp_group, group_src=self.pp - 1)
        if self.tied_weight is not None:  # first and last stage each hold the tied embedding: add their grads
            dist.all_reduce(_local(self.tied_weight.grad), group=self.tied_group)
        return total

    def norm_parameters(self):
        # The last stage's copy of a tied embedding equals the first stage's: count it once, as one model would.
        keep = self.parameters()
        if self.tied_weight is not None and not any(s.is_first for s in self.stages):
            keep = [p for p in keep if p is not self.tied_weight]
        return keep

    def metrics(self) -> dict:
        step_s, busy_s = self.step_clock.read_and_reset(), self.compute.read_and_reset()
        idle = torch.tensor([1.0 - busy_s / step_s if step_s > 0 else 0.0], device=self.rt.device)
        dist.all_reduce(idle, group=self.pp_group)
        formula = (self.pp - 1) / (self.virtual * self.m + self.pp - 1)
        return {"pp_bubble": idle.item() / self.pp, "pp_bubble_formula": formula}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _first_last_groups(mesh):
    """For every pipeline (one per dp/tp coordinate), a group of its first and last rank. Every rank creates
    every group in the same order (new_group is collective) and keeps its own."""
    ranks = mesh.world.mesh  # (pp, dp_replicate, dp_shard, tp) tensor of global ranks
    mine = None
    for chain in ranks.reshape(ranks.shape[0], -1).T.tolist():
        group = dist.new_group([chain[0], chain[-1]])
        if dist.get_rank() in (chain[0], chain[-1]):
            mine = group
    return mine
