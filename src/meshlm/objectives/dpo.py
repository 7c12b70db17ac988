"""--objective dpo: preference tuning against a frozen reference (DPO, Rafailov et al. 2023), as TRL's DPOTrainer.

The loss of a pair (dpo_loss.py) needs the reference model's log-probabilities of both responses.
Where they come from, decided here once:
- LoRA (--lora.r): the policy's own base, its adapters switched off for one forward without gradients
  (parallel/lora.py adapters_off): no second copy of anything;
- --dpo.precompute-reference: computed once, before training and before a checkpoint is loaded, by the model
  as it starts (LoRA: its base), over every training and held-out block, and kept in the token cache beside
  the blocks (data/pack.py Blocks.reference); no reference model is held while training;
- otherwise: a frozen copy of the starting model, built and parallelized exactly as the policy
  (parallel/apply.py frozen: FSDP-sharded, TP-split, pipeline-staged alike), holding parameters only, in the
  dtype its forward computes with (stored_as_computed).
Every step fills its micro-batches' reference log-probabilities before any of their forwards (`prepare`), so
the engines see one objective with one interface (sft.py TokenMean is the other).

The metrics row gets TRL's figures, means over the pairs since the last row (and over the held-out pairs
with an eval_ prefix): rewards/chosen, rewards/rejected (beta x the log-ratio against the reference),
rewards/accuracies (how often chosen's reward is the larger), rewards/margins, logps/chosen, logps/rejected;
and reference_bytes, rank 0's storage of a reference model's parameters (0 under LoRA and when precomputed).
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

import torch
import torch.distributed as dist

from meshlm.config import Config, DPOConfig
from meshlm.data.batch import Batch
from meshlm.data.preference import ReferenceLogps
from meshlm.engines.base import Engine, storage_bytes
from meshlm.objectives.dpo_loss import STATS, pair_counts, pair_losses, pairs, sequence_logps
from meshlm.parallel import lora


def _reference_logps(logits: torch.Tensor, rows: Batch, cp=None) -> torch.Tensor:
    return sequence_logps(logits, rows.labels, rows.positions, cp)[..., 0]


class AdaptersOff:
    """The reference under LoRA: the policy's base, adapters off."""

    bytes = 0  # nothing of its own
    words = "the base model with the adapters off"

    def __call__(self, engine, batch: Batch) -> list:
        with lora.adapters_off(engine.module):
            return engine.forward_only(batch, _reference_logps)


class EngineForward:
    """The reference as an engine's forward: a frozen copy of the starting model parallelized as the policy is,
    or (precomputing) the policy itself before its first update."""

    words = "a frozen copy of the starting model"

    def __init__(self, engine):
        self.engine = engine

    @property
    def bytes(self) -> int:
        """This rank's storage of the reference's parameters (its shards, its stage)."""
        return storage_bytes(self.engine.model.parameters())

    def __call__(self, engine, batch: Batch) -> list:
        return self.engine.forward_only(batch, _reference_logps)


class Preference:
    """The DPO objective: a step's loss is the mean over its global pairs of each pair's loss."""

    name = "dpo"

    def __init__(self, cfg: DPOConfig, reference, device: torch.device):
        self.cfg, self.reference = cfg, reference
        self.tally = torch.zeros(len(STATS), dtype=torch.float64, device=device)  # sums over pairs (STATS)

    def describe(self, cfg) -> str:
        c = self.cfg
        smoothing = f", label smoothing {c.label_smoothing:g}" * (c.label_smoothing > 0)
        held = self.reference.words if self.reference is not None else "precomputed once by the starting model"
        return f"DPO ({c.loss} loss), beta {c.beta:g}{smoothing}; reference: {held}"

    def units(self, batch: Batch) -> torch.Tensor:
        return pairs(batch.labels, batch.positions)

    def prepare(self, engine, batches: list[Batch]) -> None:
        """Each micro-batch's reference log-probabilities (unless the cache gave them), before any forward of the
        step. Under a pipeline only the last stage gets them: it alone computes the loss."""
        for batch in batches:
            if batch.reference is None and self.reference is not None:
                parts = self.reference(engine, batch)
                batch.reference = torch.cat(parts) if parts else None

    def loss_sum(self, logits: torch.Tensor, batch: Batch, cp=None) -> torch.Tensor:
        """The summed pair losses of `batch`; cp (a SequenceSplit): the logits are this cp rank's part of each row."""
        policy = sequence_logps(logits, batch.labels, batch.positions, cp)
        c = self.cfg
        losses, stats = pair_losses(policy, batch.reference.to(policy.device), c.loss, c.beta, c.label_smoothing)
        self.tally += stats.to(self.tally)
        # under context parallel every cp rank computes the whole loss: 1/C of it each, so its sums over the cp
        # ranks (the logged loss, the gradients of the summed log-probabilities) are those of one rank
        return losses.sum() / (cp.size if cp is not None else 1)

    def _means(self, engine) -> dict:
        """The tally added over every rank that holds a part of it (data-parallel ranks; a pipeline's last stage
        alone computes it), as means over pairs; the tally starts again."""
        total = self.tally.clone()
        for group in (engine.dp_group, engine.pp_group):
            if group is not None:
                dist.all_reduce(total, group=group)
        self.tally.zero_()
        n = total[0].item()
        return {name: (v / n if n else float("nan")) for name, v in zip(STATS[1:], total[1:].tolist())}

    def metrics(self, engine) -> dict:
        held = self.reference.bytes if self.reference is not None else 0
        return {**self._means(engine), "reference_bytes": held}

    @contextlib.contextmanager
    def held_out(self):
        training = self.tally
        self.tally = torch.zeros_like(training)
        try:
            yield
        finally:
            self.tally = training

    def eval_row(self, loss: float, engine) -> dict:
        return {"eval_loss": loss, **{f"eval_{k}": v for k, v in self._means(engine).items()}}


def preference(cfg: Config, rt, engine, frozen_copy, blocks: list) -> Preference:
    """The DPO objective with its reference, decided here once. `frozen_copy()` builds the reference engine when
    one is needed; `blocks` (training, held-out or None) get the precomputed reference when asked for."""
    start = AdaptersOff() if lora.enabled(cfg) else EngineForward(engine)  # the policy, before any update
    if cfg.dpo.precompute_reference:
        precompute(cfg, rt, engine, start, [b for b in blocks if b is not None])
        return Preference(cfg.dpo, None, rt.device)
    if lora.enabled(cfg):
        return Preference(cfg.dpo, start, rt.device)
    return Preference(cfg.dpo, EngineForward(stored_as_computed(frozen_copy(), cfg)), rt.device)


def stored_as_computed(reference, cfg: Config):
    """The frozen copy keeps its parameters in the dtype its forward computes with, so that it computes what the
    policy computes. Under bf16: FSDP's policy gathers bf16 from its shards, and bf16 shards gather the same values
    at half the bytes; bf16 zero1/zero2 compute with bf16 working parameters and no autocast (master_weights.py),
    and so does their copy. Elsewhere bf16 is autocast over fp32 parameters, where bf16 ones would change the
    forward (norms, embeddings, the residual stream in bf16): fp32 there. Only parameters: buffers (rotary
    inv_freq) keep their dtype, as in the policy."""
    from torch.distributed.fsdp import FSDPModule

    model = reference.model
    if cfg.mixed_precision != "bf16":
        return reference
    if reference.layout.masters:
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
        return WithoutAutocast(model, reference.layout, reference.rt, reference.options)
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        return reference
    buffers = [(m, k, b) for m in model.modules() for k, b in m._buffers.items() if b is not None]
    model.to(torch.bfloat16)  # FSDP2's _apply re-registers the cast shards
    for m, k, b in buffers:
        m._buffers[k] = b
    return reference


class WithoutAutocast(Engine):
    """A frozen model whose parameters are already bf16 (a bf16 zero1/zero2 layout's reference): no autocast on top."""

    def autocast(self):
        return contextlib.nullcontext()


def _reference_dir(cfg: Config, engine, blocks) -> Path:
    """Where the precomputed reference of these blocks lives: beside them, keyed by the starting weights, the model's
    config and the precision the reference ran in."""
    from meshlm.models.build import weights_digest

    parts = (weights_digest(cfg), engine.module.config.to_json_string(), cfg.mixed_precision)
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    return blocks.dir.parent / f"reference-{key}" / blocks.dir.name


def precompute(cfg: Config, rt, engine, reference, parts: list) -> None:
    """Every block's reference log-probabilities, computed once by every rank together (each data-parallel rank
    its share of the blocks, as evaluation does) and written to the cache by each node's first rank; then the
    blocks read them with every batch (data/preference.py ReferenceLogps)."""
    for blocks in parts:
        where = _reference_dir(cfg, engine, blocks)
        if not _everyone_has(where, rt):
            found = _reference_of(engine, blocks, reference, cfg.micro_batch_size, rt.device)
            if rt.distributed:
                everyone: list = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, found)
                found = {b: v for part in everyone for b, v in part.items()}
            if rt.local_rank == 0 and not where.exists():
                ReferenceLogps.write(where, found, len(blocks))
            if rt.distributed:
                dist.barrier()
        blocks.reference = ReferenceLogps(where)


def _everyone_has(where: Path, rt) -> bool:
    have = torch.tensor(int((where / "logps.npy").exists()))
    if rt.distributed:
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
    return bool(have.item())


def _reference_of(engine, blocks, reference, micro_batch_size: int, device) -> dict:
    """{block: its pairs' [pairs, 2] reference log-probabilities} for the blocks this rank computed (on a pipeline's
    last stage; the other stages find nothing)."""
    from meshlm.train.evaluate import rows_of

    found, dp, rank = {}, engine.dp_size, engine.dp_rank
    for start in range(0, len(blocks), dp * micro_batch_size):
        mine = list(range(start, min(start + dp * micro_batch_size, len(blocks))))[rank::dp]
        batch = rows_of(blocks, mine, micro_batch_size).to(device)
        computed = reference(engine, batch)
        if computed:
            logps, counts = torch.cat(computed).cpu(), pair_counts(batch.labels, batch.positions).tolist()
            found.update({b: logps[i, : counts[i]].numpy() for i, b in enumerate(mine)})
    return found
