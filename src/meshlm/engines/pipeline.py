"""The pipeline engine: this rank's stages (parallel/pipeline.py `split_for_rank`) under a
torch.distributed.pipelining schedule: GPipe (all forwards, then all backwards), 1F1B (same bubble, at most P
micro-batches of activations alive) or interleaved 1F1B (V stages per rank, bubble divided by V). With M
micro-batches and P stages a rank idles (P-1)/(M+P-1) of the step; we measure the real figure by timing each
stage's compute against the step time (`--trace-pipeline`: every action's start and end).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from meshlm import compat
from meshlm.config import Config
from meshlm.engines.base import Engine, EngineOptions
from meshlm.engines.pipeline_trace import PipelineTrace, StageClock
from meshlm.errors import MeshlmError
from meshlm.models.stages import Stage
from meshlm.parallel.aux_loss import RouterCarry
from meshlm.parallel.loss import ChunkedLossHead
from meshlm.parallel.pipeline import micro_batches, virtual_stages

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}


@dataclass(frozen=True)
class PipelineOptions(EngineOptions):
    """What the pipeline engine reads of the options: the schedule and its shape."""

    schedule: str = "1f1b"  # --parallel.schedule: a key of SCHEDULES
    micro_batches: int = 2  # pipeline micro-batches per step (micro_batches(cfg): 0 means 2 x pp)
    virtual_stages: int = 1  # stages per rank (above 1 only for interleaved-1f1b)
    grad_accum: int = 1  # --grad-accum: rounds of micro-batches per step (the trace numbers them on)

    @classmethod
    def of(cls, cfg: Config) -> PipelineOptions:
        shape = {"micro_batches": micro_batches(cfg), "virtual_stages": virtual_stages(cfg)}
        return super().of(cfg, schedule=cfg.parallel.schedule, grad_accum=cfg.grad_accum, **shape)


class TimedStage(PipelineStage):
    """A PipelineStage that adds up the time it computes; the rest of a step it waits (the bubble).
    While a PipelineTrace is attached it also records each action's start and end."""

    def __init__(self, *args, clock: StageClock, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock = clock
        self.trace: PipelineTrace | None = None

    positions: list[torch.Tensor] | None = None  # this step's position ids, one per micro-batch (set by the engine)
    targets: list[torch.Tensor] | None = None  # and their targets, for a last stage whose head computes the loss
    loss_head: ChunkedLossHead | None = None

    def forward_maybe_with_nosync(self, *args, **kwargs):
        # Every micro-batch's forward (training and evaluation) runs here. Position ids go to every stage,
        # not only the first (the schedule gives kwargs to stage 0 alone): each stage builds the
        # document-aware mask and rotary embeddings from them. A head computing the loss over chunks
        # (parallel/loss.py) gets the micro-batch's targets.
        if self.positions is not None:
            kwargs["position_ids"] = self.positions[self._chunk or 0]
        with self._loss_of(self._chunk or 0):
            return super().forward_maybe_with_nosync(*args, **kwargs)

    def _loss_of(self, chunk: int):
        if self.loss_head is None or self.targets is None:
            return contextlib.nullcontext()
        return self.loss_head.computing_loss(self.targets[chunk])

    paused = contextlib.nullcontext  # a mixture of experts: what keeps its routers from counting placeholders

    def _compute_outputs(self, *args, module, **kwargs):
        # The first step infers activation shapes with one extra forward. Under DDP it must not arm the
        # gradient all-reduce: no backward of that forward ever comes, and DDP's reducer would fail later.
        with module.no_sync() if isinstance(module, DDP) else contextlib.nullcontext(), self.paused():
            return module(*args, **kwargs)

    def _shape_inference(self, *args, **kwargs):
        # torch 2.11's extra forward (no gradients, so DDP arms nothing); later releases run _compute_outputs.
        # Every forward's outputs are then checked against it: a loss head returns its loss here too.
        with self.paused(), self._loss_of(0):
            return super()._shape_inference(*args, **kwargs)

    def _backward_metadata_inference(self, *args, **kwargs):
        with self.paused():  # it calls the loss on placeholder outputs
            return super()._backward_metadata_inference(*args, **kwargs)

    _chunk: int | None = None  # the micro-batch forward_one_chunk runs (None before the first)

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        self._chunk = fwd_chunk_id
        return self._timed("F", fwd_chunk_id, super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        return self._timed("B", bwd_chunk_id, super().backward_one_chunk, *args, **kwargs)

    def _timed(self, action: str, chunk: int, run, *args, **kwargs):
        t = self.clock.start()
        began = self.trace.now() if self.trace else None
        out = run(chunk, *args, **kwargs)
        self.clock.stop(t)
        if self.trace:
            self.trace.add(self.stage_index, action, chunk, began)
        return out


class PipelineEngine(Engine):
    """Runs this rank's stages under a torch.distributed.pipelining schedule. `model` is the pruned model
    (checkpoints, optimizer), `modules` the stage modules after TP / FSDP / DDP were applied."""

    name = "pipeline"

    def __init__(
        self,
        model,
        stages: list[Stage],
        modules: list[nn.Module],
        layout,
        rt,
        options: PipelineOptions,
        model_tied: bool,
    ):
        super().__init__(model, layout, rt, options)
        mesh = self.mesh
        pp_mesh = mesh["pp"]
        self.pp, self.pp_group = pp_mesh.size(), pp_mesh.get_group()
        self.m, sched = options.micro_batches, options.schedule
        self.virtual = options.virtual_stages
        n_stages = self.pp * self.virtual
        self.compute, self.step_clock = StageClock(rt.device), StageClock(rt.device)
        self.modules, self.round = modules, 0
        self.stages = [
            TimedStage(mod, s.index, n_stages, rt.device, group=self.pp_group, clock=self.compute)
            for s, mod in zip(stages, modules)
        ]
        for stage, s in zip(self.stages, stages):
            stage.loss_head = s.head if isinstance(s.head, ChunkedLossHead) else None
        if self.routers is not None and not compat.pipeline_passes_integers():
            raise MeshlmError(
                f"pipeline parallel of a mixture of experts needs torch 2.13 or newer: torch {torch.__version__}'s "
                "pipeline stages cannot pass the routers' integer counts on; upgrade torch or drop --parallel.pp"
            )
        if self.routers is not None:  # a mixture of experts: its stages carry the routers' statistics
            for stage in self.stages:
                stage.paused = self.routers.paused
                for carry in (m for m in stage.submod.modules() if isinstance(m, RouterCarry)):
                    carry.routers = self.routers
        kind = SCHEDULES[sched]
        first = self.stages if kind is ScheduleInterleaved1F1B else self.stages[0]
        self.schedule = kind(first, self.m, loss_fn=self._chunk_loss, scale_grads=False)
        self.last_stage = next((s for s in self.stages if s.is_last), None)
        # A tied embedding is used by the first stage and the last: each holds a copy, and
        # their gradients are summed after every step so both copies take the same update.
        self.tied_weight = self.tied_group = None
        if model_tied:
            self.tied_group = _first_last_groups(mesh)
            embed = model.get_input_embeddings()
            self.tied_weight = embed.weight if embed is not None else None

    forwards = 0  # pipeline micro-batches in this training step (for the routers' loss of a mixture of experts)

    def _chunk_loss(self, output, labels):
        # The schedule's loss function, on the last stage after each micro-batch's forward: what it computes
        # is `self.chunk_fn` on that micro-batch's rows (labels, position ids, a DPO reference: `self.chunks`).
        chunk = self.last_stage._chunk
        if chunk is None:  # torch first infers the backward's shapes from a loss of placeholder outputs
            # Zeroed before the sum: a sum's gradient is its ones expanded (stride 0), which would reach torch's
            # gradient metadata through the routers' (S, C) of a MoE and give the previous stage a recv buffer
            # gloo refuses ("input tensor has to be contiguous"); a product's gradient is a tensor of its own.
            outputs = output if isinstance(output, tuple) else (output,)
            return sum((t.float() * 0).sum() for t in outputs if t.is_floating_point())
        return self.chunk_fn(output, self.chunks[chunk])

    def _rows_loss(self, fn, output, rows):
        """fn(logits, rows, cp); the loss itself where a chunked head computed it (0-dim). Under context parallel
        the logits are this rank's part of the micro-batch's rows, and cp says so (as Engine.outputs): the token
        loss sums this rank's targets, DPO adds each document's log-probabilities over the cp group."""
        if output.ndim == 0:
            return output
        return fn(output, rows, self.split)

    def _scaled_loss(self, output, rows):
        # Each pipeline micro-batch backpropagates its loss sum x dp_size / the step's global count of units
        # (the token-exact rule, engines/base.py): the gradients add up to the mean over the global batch.
        if isinstance(output, tuple):  # a mixture of experts: logits and the routers' (S, C) of every stage
            logits, prob_sum, counts = output
            loss = self._rows_loss(self.objective.loss_sum, logits, rows)
            return loss * self.scale + self.aux_loss(self.forwards, (prob_sum, counts))
        return self._rows_loss(self.objective.loss_sum, output, rows) * self.scale

    def _set_rows(self, batch) -> tuple[torch.Tensor, ...]:
        """Each micro-batch's rows, and this rank's tokens of them (parallel/context.py: under cp its part of every
        sequence) for the stages: position ids, and targets where the last stage's head computes the loss. Returns
        the schedule's inputs: the input ids it splits on the first stage's rank, nothing on the others (torch 2.11
        refuses inputs given to a later stage)."""
        self.chunks = batch.chunks(self.m)
        self.local = [self.tokens(c) for c in self.chunks]
        for stage in self.stages:
            stage.positions = [p for _, p, _ in self.local]
            stage.targets = [t for _, _, t in self.local] if stage.loss_head is not None else None
            stage._chunk = None  # until the schedule's first forward: what comes before is shape inference
        if not self.stages[0].is_first:
            return ()
        return (batch.ids if self.split is None else self.split.local(batch.ids),)

    def train_step(self, micro_batches):
        self.objective.prepare(self, micro_batches)
        self.count(micro_batches)
        self.forwards = len(micro_batches) * self.m
        total = torch.zeros((), device=self.rt.device)
        self.chunk_fn = self._scaled_loss
        self.compute.take_span()
        for i, batch in enumerate(micro_batches):
            self.round = i  # PipelineTrace numbers micro-batches on across accumulation rounds
            losses: list[torch.Tensor] = []
            inputs = self._set_rows(batch)
            with self.autocast(), self.loss_context(), self.offloading():
                self.schedule.step(*inputs, target=batch.labels, losses=losses, return_outputs=False)
            if losses:
                total += torch.stack(losses).sum().detach()
        first, last = self.compute.take_span()
        if first is not None:  # this rank's actions, from the first one's start to the last one's end
            self.step_clock.add(first, last)
        # The loss lives on the last stage; the trainer logs from rank 0 (the first).
        dist.broadcast(total, group=self.pp_group, group_src=self.pp - 1)
        if self.tied_weight is not None:  # first and last stage each hold the tied embedding: add their grads
            w = self.tied_weight
            # TP's embedding gradient comes back replicated: shard it as the weight is
            if isinstance(w.grad, DTensor) and w.grad.placements != w.placements:
                w.grad = w.grad.redistribute(placements=w.placements)
            dist.all_reduce(_local(w.grad), group=self.tied_group)
        return total

    def forward_only(self, batch, fn) -> list:
        """Forward only through the pipeline (the schedule's eval): fn of each micro-batch on the last stage."""
        results: list = []
        self.chunk_fn = lambda output, rows: self._rows_loss(
            fn, output[0] if isinstance(output, tuple) else output, rows
        )
        inputs = self._set_rows(batch)
        training = self.model.training
        self.model.eval()
        for stage in self.stages:
            stage.clock = StageClock(self.rt.device)  # not training: the bubble excludes it
        try:
            with torch.no_grad(), self.autocast(), self.loss_context():
                # return_outputs=False: the last stage's outputs may be 0-dim losses (a loss head), which
                # torch's merge of the micro-batches' outputs cannot concatenate; `results` holds what counts
                self.schedule.eval(*inputs, target=batch.labels, losses=results, return_outputs=False)
        finally:
            self.model.train(training)
            for stage in self.stages:
                stage.clock = self.compute
        return results

    def decoding_ring(self):
        """This rank's stages as infer/pipelined.py decodes through them (GRPO's rollout): the stage modules as
        trained (FSDP gathers as in a training forward; DDP's wrapper is left out: nothing to reduce), over two
        groups of this pipeline's ranks. Every rank builds every pipeline's groups (new_group is collective)."""
        from meshlm.infer.pipelined import Ring

        chains = _chains(self.mesh)
        activations, _ = dist.new_subgroups_by_enumeration(chains)
        tokens, _ = dist.new_subgroups_by_enumeration(chains)
        mods = [(s.stage_index, self._decoding(m)) for s, m in zip(self.stages, self.modules)]
        return Ring(sorted(mods, key=lambda x: x[0]), self.pp_group.rank(), self.pp, activations, tokens)

    def _decoding(self, module):
        """A stage module as decoding calls it: a mixture of experts' stage (RouterCarry) returns its output alone,
        its routers counting nothing (their statistics are the training forwards')."""
        module = module.module if isinstance(module, DDP) else module
        if self.routers is None:
            return module
        routers = self.routers

        def run(*args, **kwargs):
            with routers.paused():
                return module(*args, **kwargs)[0]

        return run

    def eval_sum(self, batch):
        """The held-out loss sum: the last stage's, broadcast to every stage."""
        sums = self.forward_only(batch, self.objective.loss_sum)
        total = torch.stack(sums).sum().detach() if sums else torch.zeros((), device=self.rt.device)
        dist.broadcast(total, group=self.pp_group, group_src=self.pp - 1)
        if self.split is not None:  # each context-parallel rank summed its part of the sequences
            dist.all_reduce(total, group=self.split.group)
        return total

    def autocast(self):
        # FSDP's bf16 policy already computes in bf16: autocast on top would only re-cast what it cast.
        if any(isinstance(m, FSDPModule) for m in self.modules):
            return contextlib.nullcontext()
        return super().autocast()

    def norm_parameters(self):
        # The last stage's copy of a tied embedding equals the first stage's: count it once, as one model would.
        keep = self.parameters()
        if self.tied_weight is not None and not any(s.is_first for s in self.stages):
            keep = [p for p in keep if p is not self.tied_weight]
        return keep

    def metrics(self) -> dict:
        """Idle share of the pipeline's step, averaged over its ranks. The step is the pipeline's span of
        actions, from the first one's start to the last one's end: under GPipe, 1F1B and interleaved 1F1B both
        are stage 0's, so it is the longest of the ranks' own spans (each on its own clock: hosts need not
        agree). Time outside the actions (the schedule's set-up, a peer that enters the step late) is not the
        pipeline's bubble; --trace-pipeline's timeline measures the same span."""
        step = torch.tensor([self.step_clock.read_and_reset()], device=self.rt.device)
        busy = torch.tensor([self.compute.read_and_reset()], device=self.rt.device)
        dist.all_reduce(step, op=dist.ReduceOp.MAX, group=self.pp_group)
        dist.all_reduce(busy, group=self.pp_group)
        bubble = 1.0 - busy.item() / (self.pp * step.item()) if step.item() > 0 else 0.0
        formula = (self.pp - 1) / (self.virtual * self.m + self.pp - 1)
        return {"pp_bubble": bubble, "pp_bubble_formula": formula, **super().metrics()}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _chains(mesh) -> list[list[int]]:
    """Every pipeline's global ranks, first stage first (one pipeline per dp/tp coordinate)."""
    ranks = mesh.world.mesh  # (pp, dp_replicate, dp_shard, tp) tensor of global ranks
    return ranks.reshape(ranks.shape[0], -1).T.tolist()


def _first_last_groups(mesh):
    """For every pipeline, a group of its first and last rank. Every rank creates every group in the same order
    (new_group is collective) and keeps its own."""
    mine = None
    for chain in _chains(mesh):
        group = dist.new_group([chain[0], chain[-1]])
        if dist.get_rank() in (chain[0], chain[-1]):
            mine = group
    return mine
