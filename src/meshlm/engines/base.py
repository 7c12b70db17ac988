"""What the trainer sees of a parallel layout: a small interface with single-process defaults.

The trainer never asks which technique is active; it calls `train_step`,
`clip_grad_norm`, `make_optimizer`, and reads `dp_size` / `dp_rank` for data.
What the loss is (next-token or DPO) is the engine's `objective` (objectives/sft.py
TokenMean, objectives/dpo.py Preference): every engine computes its loss through it.
Each engine in engines/ subclasses Engine and overrides only what differs.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from meshlm.compat import clip_grads_with_norm_, inner_tensors, storage_key
from meshlm.config import Config
from meshlm.data.batch import Batch
from meshlm.models.families import router_class
from meshlm.objectives.sft import TokenMean
from meshlm.parallel.loss import ChunkedLossHead, next_token_targets, targets_loss_sum
from meshlm.runtime import Runtime

# The token-exact loss: the sum of every target token's loss over the global batch, divided by their number. A mean
# of per-micro-batch means equals the token mean only when every micro-batch holds the same number of targets, which
# masked prompts and packed documents break. So the step first counts the global targets (one scalar all-reduce over
# the data-parallel ranks, before any backward), and every micro-batch backpropagates sum / count; DDP and FSDP
# average gradients over the dp ranks, so the loss is multiplied by dp_size to undo that, and the gradients are
# exactly those of the global token mean. Every objective whose loss is a mean over units (objectives/sft.py
# TokenMean: targets; DPO: pairs; GRPO: completions or tokens) follows the same rule: `Engine.count`.


def global_counts(batches: list[Batch], units, dp_group, device) -> tuple[torch.Tensor, ...]:
    """(targets, padding positions, units the loss is a mean over) of the global batch: this rank's, added over the
    dp ranks in one all-reduce, and that all-reduce's work (None without dp ranks): the counts hold the global
    sums once it is waited for. Tensors on `device`: the step needs no host sync for them."""
    counts = torch.stack(
        [
            sum(b.targets().to(device) for b in batches),
            torch.tensor(sum(b.pad_tokens for b in batches), device=device),
            sum(units(b).to(device) for b in batches),
        ]
    )  # int64: exact
    work = dist.all_reduce(counts, group=dp_group, async_op=True) if dp_group is not None else None
    return counts[0], counts[1], counts[2], work


def loss_scale(units: torch.Tensor, dp_size: int) -> torch.Tensor:
    """What a micro-batch's loss sum is multiplied by before backward (the token-exact rule above)."""
    return dp_size / units.clamp(min=1)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _by_kind(tensors: list, per_mesh: bool = True) -> dict:
    """Plain tensors apart from DTensors (foreach kernels cannot mix them), and DTensors per mesh
    (a norm reduces over its own mesh)."""
    groups: dict = {}
    for t in tensors:
        key = (t.device_mesh if per_mesh else "dtensor") if isinstance(t, DTensor) else None
        groups.setdefault(key, []).append(t)
    return groups


def global_grad_norm(grads: list[torch.Tensor], pp_group=None) -> torch.Tensor:
    """The 2-norm of the whole model's gradient on every rank. DTensor shards (TP, FSDP) reduce over their
    mesh; plain tensors are whole (or replicated) here; pipeline stages add their squares over pp_group."""
    device = grads[0].device if grads else torch.device("cpu")
    square = torch.zeros((), device=device)
    for group in _by_kind(grads).values():
        norm = torch.nn.utils.get_total_norm(group, foreach=True)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        square = square + norm.to(device) ** 2
    if pp_group is not None:
        dist.all_reduce(square, group=pp_group)
    return square.sqrt()


@dataclass(frozen=True)
class EngineOptions:
    """What every engine reads of the options (an engine that reads more extends this)."""

    aux_loss: str = "auto"  # --moe.aux-loss: a mixture of experts' router loss (parallel/aux_loss.py)
    activation_offload: bool = False  # --activation-offload: saved activations wait in host memory (GPUs)

    @classmethod
    def of(cls, cfg: Config, **own) -> EngineOptions:
        return cls(aux_loss=cfg.moe.aux_loss, activation_offload=cfg.activation_offload, **own)


class Engine:
    """The engine of layout kind "single" (one rank, or tensor parallel alone) and the base of the others.

    `layout` is the job's meshlm.layout.Layout (not imported here: layout.resolve calls the techniques'
    checks in parallel/ and engines/, so an import of it from an engine's module would close a cycle). An engine reads
    its mesh, precision and facts from it, and the rest from its typed options, never the whole Config."""

    name = "single"

    def __init__(self, model: torch.nn.Module, layout, rt: Runtime, options: EngineOptions = EngineOptions()):
        mesh = layout.mesh(rt.device.type)
        self.model, self.layout, self.rt, self.mesh, self.options = model, layout, rt, mesh, options
        self.dp_size, self.dp_rank = 1, 0
        if mesh is not None:
            self.dp_size, self.dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
        self.dp_group = mesh["dp"].get_group() if mesh is not None and self.dp_size > 1 else None
        # Gradients (and the loss) average over the data-parallel ranks and, within each, its context-parallel
        # ranks, which hold the same sequences' other tokens (parallel/context.py); without cp: the dp ranks.
        self.grad_ranks = layout.degrees.dp_cp
        self.grad_group = mesh["dp_cp"].get_group() if mesh is not None and self.grad_ranks > 1 else None
        self.split = None
        if layout.cp_enabled:  # imported only for a context-parallel job
            from meshlm.parallel.context import SequenceSplit

            self.split = SequenceSplit.of(model)
        self.routers = None
        if router_class(self.module) is not None:  # a mixture of experts: its routers' loss (parallel/aux_loss.py)
            from meshlm.parallel.aux_loss import Routers

            self.routers = Routers.of(self.module, options.aux_loss)

    @property
    def module(self) -> torch.nn.Module:
        """The model without DDP/DataParallel wrappers: what checkpoints and export see."""
        m = self.model
        while isinstance(m, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            m = m.module
        return m

    # ------------------------------------------------------------- training
    def autocast(self):
        if self.layout.precision == "bf16":
            return torch.autocast(self.rt.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def no_sync(self):
        """Skip gradient communication for micro-batches before the last one."""
        return contextlib.nullcontext()

    def loss_context(self):
        """Vocabulary-parallel TP (parallel/tensor.py): the cross-entropy, forward and backward, runs on logits
        sharded over the vocabulary; the full logits are never gathered. (A pipeline gathers its last stage's,
        unless its head computes the loss over chunks: then each chunk's logits stay sharded.)"""
        sharded = self.layout.tp_enabled and (not self.layout.pp_enabled or self.loss_head is not None)
        return loss_parallel() if sharded else contextlib.nullcontext()

    def tokens(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input ids, position ids and targets aligned with them (parallel/loss.py next_token_targets) of the
        positions this rank computes: the whole sequences, or under context parallel its part of each."""
        parts = (batch.ids, batch.positions, next_token_targets(batch.labels))
        return parts if self.split is None else tuple(self.split.local(t) for t in parts)

    @functools.cached_property
    def loss_head(self) -> ChunkedLossHead | None:
        """The LM head when it computes the loss itself over chunks (parallel/loss.py; apply.py swaps it in)."""
        head = self.module.get_output_embeddings()
        return head if isinstance(head, ChunkedLossHead) else None

    def offloading(self):
        """--activation-offload: the forward's saved activations go to host memory (parallel/offload.py); on
        CPU ranks they already are there."""
        if self.options.activation_offload and self.rt.device.type == "cuda":
            from meshlm.parallel.offload import ActivationOffload  # imported only when chosen

            return ActivationOffload(self.rt.device)
        return contextlib.nullcontext()

    def outputs(self, batch: Batch, fn) -> list:
        """fn(logits, rows, cp) of the model's forward on `batch`: one entry (layer split: one per chunk of rows).
        Under context parallel the forward runs on this rank's part of each row, and cp (parallel/context.py
        SequenceSplit, else None) says so."""
        ids, positions = batch.ids, batch.positions
        if self.split is not None:
            ids, positions = self.split.local(ids), self.split.local(positions)
        with (
            self.autocast(),
            self.routers.collecting() if self.routers else contextlib.nullcontext(),
            self.offloading(),
        ):
            logits = self.model(input_ids=ids, position_ids=positions, use_cache=False).logits
        return [fn(logits, batch, self.split)]

    def loss(self, batch: Batch) -> torch.Tensor:
        """The objective's loss summed over `batch` (`count` divides by the global count); run inside
        loss_context, where vocabulary-sharded logits give a replicated DTensor sum. Under context parallel the
        objective's sum over this rank's part of the rows (outputs: cp); with a chunked-loss head (sft only:
        config.py) the head's sum of this rank's positions' targets."""
        if self.loss_head is None:
            loss = sum(self.outputs(batch, self.objective.loss_sum))
        else:
            loss = self.token_loss(batch)
        return loss.to_local() if isinstance(loss, DTensor) else loss

    def token_loss(self, batch: Batch) -> torch.Tensor:
        ids, positions, targets = self.tokens(batch)
        head = self.loss_head
        with (
            self.autocast(),
            self.routers.collecting() if self.routers else contextlib.nullcontext(),
            head.computing_loss(targets) if head is not None else contextlib.nullcontext(),
            self.offloading(),
        ):
            out = self.model(input_ids=ids, position_ids=positions, use_cache=False).logits
        return out if head is not None else targets_loss_sum(out, targets)

    def eval_sum(self, batch: Batch) -> torch.Tensor:
        """The summed loss of `batch` without gradients (held-out evaluation), on every rank."""
        with self.loss_context():
            total = self.loss(batch).detach()
        if self.split is not None:  # each context-parallel rank summed its part of the sequences
            dist.all_reduce(total, group=self.split.group)
        return total

    def forward_only(self, batch: Batch, fn) -> list:
        """fn's results of a forward without gradients and with dropout off (objectives/dpo.py's reference); empty on
        ranks that hold no output (pipeline stages before the last)."""
        training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self.loss_context():
                return self.outputs(batch, fn)
        finally:
            self.model.train(training)

    def count(self, micro_batches: list[Batch], wait: bool = True) -> None:
        """Count the step's global targets and units (one all-reduce, before any backward) and set the loss scale
        (the units are averaged over dp x cp ranks' gradients); wait=False: the all-reduce goes on while the first
        forward runs, and `counted` waits for it and sets the scale."""
        self.targets, self.pad_tokens, self.units, self._counting = global_counts(
            micro_batches, self.objective.units, self.dp_group, self.rt.device
        )
        if self.routers is not None:
            self.routers.steps += 1
        if wait:
            self.counted()

    def counted(self) -> None:
        if self._counting is not None:
            self._counting.wait()
            self._counting = None
        self.scale = loss_scale(self.units, self.grad_ranks)

    def aux_loss(self, forwards: int, stats=None) -> torch.Tensor | float:
        """This rank's term of the routers' load-balancing loss for the forward just run (0 for a dense model),
        one of `forwards` in the step; `stats`: (S, C) carried through a pipeline instead of this rank's."""
        if self.routers is None:
            return 0.0
        prob_sum, counts = stats if stats is not None else self.routers.stats()
        return self.routers.loss_term(prob_sum, counts, self.grad_group, self.grad_ranks / forwards)

    def train_step(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches. Returns this rank's share of the step's mean loss
        times dp_size (detached): what it backpropagated, so its mean over dp ranks is the step's loss."""
        self.objective.prepare(self, micro_batches)
        # A blocking count would make the ranks wait for each other before every step as well as in backward's
        # gradient all-reduce: one more point where a rank that the machine slowed holds the others up.
        self.count(micro_batches, wait=False)
        total = torch.zeros((), device=self.rt.device)
        n = len(micro_batches)
        for i, batch in enumerate(micro_batches):
            last = i == n - 1
            with contextlib.nullcontext() if last else self.no_sync(), self.loss_context():
                loss = self.loss(batch)
                if i == 0:
                    self.counted()
                loss = loss * self.scale + self.aux_loss(n)
                if last:  # parameters as the layout holds them between forward and backward
                    self.param_bytes = storage_bytes(self.model.parameters())
                loss.backward()
            total += loss.detach()
        self.grad_bytes = storage_bytes(p.grad for p in self.model.parameters())
        return total

    def parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def make_optimizer(self, **kw) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.param_groups(kw.pop("weight_decay")), **kw, **self.adamw_impl())

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Weight decay on matrices only (not on norms and biases)."""
        params = self.parameters()
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        # One group per kind of tensor too: foreach kernels cannot mix plain tensors and DTensors (TP).
        return [
            {"params": ps, "weight_decay": w}
            for w, kind in ((weight_decay, decay), (0.0, no_decay))
            for ps in _by_kind(kind, per_mesh=False).values()
        ]

    def adamw_impl(self) -> dict:
        """Fused AdamW where the device has it (CUDA, and CPU since torch 2.4) for plain tensors."""
        if any(isinstance(p, DTensor) for p in self.parameters()):
            return {"foreach": True}
        return {"fused": True}

    def weight_sized_temporaries(self) -> bool:
        """Whether a step allocates and frees weight-sized buffers: the gradients (the trainer's zero_grad frees
        them, the next backward allocates them again), FSDP's gathered weights, foreach AdamW's copy of the second
        moments. On CPU ranks host_memory keeps such buffers out of the heap, which they would fragment."""
        return True

    # the last step's global targets, padding positions, units of its loss (targets, or DPO's pairs), loss scale
    targets, pad_tokens, units, scale = 0, 0, 0, 1.0
    _counting = None  # the count's all-reduce while the first forward runs (count(wait=False))
    objective = TokenMean()  # what the loss is (objectives/); the trainer sets its own
    pp_group = None  # pipeline engines: the ranks holding the other stages (the norm adds over them)

    def norm_parameters(self) -> list[torch.Tensor]:
        """The parameters the gradient norm counts (a pipeline counts a tied weight's second copy once)."""
        return self.parameters()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (max_norm 0: only measure it) and return it."""
        norm = global_grad_norm([p.grad for p in self.norm_parameters() if p.grad is not None], self.pp_group)
        if max_norm > 0:
            for group in _by_kind([p for p in self.parameters() if p.grad is not None]).values():
                clip_grads_with_norm_(group, max_norm, norm)
        return norm

    def metrics(self) -> dict:
        """Layout-specific figures for the metrics row (e.g. the measured pipeline bubble, a mixture of experts'
        aux loss and tokens per expert); called on every rank."""
        return self.routers.metrics(self.grad_ranks, [self.grad_group, self.pp_group]) if self.routers else {}

    def mean_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        """Average a scalar over the ranks that average gradients (the logged loss: each holds its share)."""
        if self.grad_group is None:
            return value
        value = value.clone()
        dist.all_reduce(value, group=self.grad_group)
        return value / self.grad_ranks

    # -------------------------------------------------------------- memory
    param_bytes: int | None = None  # measured by train_step
    grad_bytes: int | None = None

    def model_state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes this rank holds of parameters, gradients and optimizer states (local shards' storage).

        Each is taken where the layout holds the most of it: parameters between the last
        forward and its backward (ZeRO-2 keeps them gathered there, ZeRO-3 only its shards),
        gradients right after backward, optimizer states after the step. Layouts whose
        train_step does not measure fall back to what the model holds now.
        """
        params = self.param_bytes if self.param_bytes is not None else storage_bytes(self.model.parameters())
        grads = (
            self.grad_bytes if self.grad_bytes is not None else storage_bytes(p.grad for p in self.model.parameters())
        )
        # tensors only, skipping 0-dim `step` counters
        states = storage_bytes(
            v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.ndim > 0
        )
        return params + grads + states


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor counts its local shard; None is skipped)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        for inner in inner_tensors(local(t)):  # an NF4 weight: its codes and scales
            storage = inner.untyped_storage()
            key = storage_key(storage)  # the storage itself (fake tensors have no data)
            if storage.nbytes() and key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total
