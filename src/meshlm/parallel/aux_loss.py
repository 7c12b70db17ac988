"""The routers of a mixture-of-experts model and their auxiliary load-balancing loss, token-exact in every layout.

transformers adds `router_aux_loss_coef * load_balancing_loss_func(router_logits)` to a MoE model's loss
when its config sets `output_router_logits`. Over the rows R (tokens x MoE layers) of one forward, with C_i
the top-k assignments to expert i (no gradient) and S_i the sum of its routing probabilities:

    aux = E * sum_i (C_i / R) * (S_i / R)

That is not a mean of per-token terms: a data-parallel rank that computed it on its own slice of the batch
would get a different value (and gradient) than one process on the whole batch. Here each forward counts
C and R, adds them over the data-parallel ranks (one all-reduce of E + 1 numbers), and backpropagates
E * sum_i C_i * S_i(local) / R^2: the ranks' terms add up to transformers' loss over the global micro-batch
(every rank's sequences of this forward), and so do their gradients. A step's aux loss is the mean over its
forwards (each holds the same number of rows). A pipeline carries C and S from stage to stage
(`carry`): the last stage holds every layer's and computes the loss, and backward returns each stage the
gradient of its own S. Tensor-parallel ranks see the same router logits and compute the same loss.
The router itself (its top-k, normalisation) is the model's own and runs unchanged.
"""

from __future__ import annotations

import contextlib
import re

import torch
import torch.distributed as dist
from torch import nn

from meshlm.models.families import facts, router_experts
from meshlm.models.families.parts import router_class, router_recorder


def _routing(logits: torch.Tensor, top_k: int, product_keys: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a router's logits: its probabilities over the experts and the top-k experts it chose, as the
    family's load_balancing_loss_func counts them. A router over product keys gives logits [2, rows, keys]:
    expert x * keys + y scores x's logit plus y's, taken in the order its own loss sorts them (rows of equal logits,
    a zero embedding's, then choose the same experts)."""
    if not product_keys:
        routing = torch.softmax(logits, dim=-1)
        return routing, torch.topk(routing, top_k, dim=-1).indices.reshape(-1)
    keys = logits.shape[-1]
    (x, y), (ix, iy) = logits.topk(keys, dim=-1)
    scores, experts = (
        (x.unsqueeze(-1) + y.unsqueeze(-2)).flatten(-2),
        (ix.unsqueeze(-1) * keys + iy.unsqueeze(-2)).flatten(-2),
    )
    routing = torch.zeros_like(scores).scatter(-1, experts, torch.softmax(scores, dim=-1))
    return routing, experts.gather(-1, scores.topk(top_k, dim=-1).indices).reshape(-1)


def aux_loss_coef(config, mode: str = "auto") -> float:
    """The coefficient the loss adds the router loss with: transformers' (router_aux_loss_coef when the config
    sets output_router_logits), or forced on/off with --moe.aux-loss."""
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    if mode == "off":
        return 0.0
    if mode == "on":
        return coef
    return coef if getattr(config, "output_router_logits", False) else 0.0


def _layer_of(name: str) -> int:
    """The block index in a module path (model.layers.3.mlp.gate -> 3)."""
    found = re.search(r"\.(\d+)\.", f".{name}.")
    return int(found.group(1)) if found else 0


class Routers:
    """The routers of a model (or of this rank's pipeline stages) and what they routed.

    Forward hooks record each router's logits while `collecting` (so recomputation under activation
    checkpointing, which runs in backward, records nothing twice). `stats` turns one forward's logits into
    (S, C): S the routing probabilities summed per expert (differentiable), C the top-k assignments per
    expert with the row count appended (int64). `step_counts` keeps this rank's assignments per layer."""

    def __init__(self, model: nn.Module, config, coef: float):
        cls = router_class(model)
        f = facts(config)  # the registry reads each config's own names (num_local_experts, n_routed_experts)
        self.experts = router_experts(config)  # with identity (zero) experts, scored after the routed ones
        self.top_k, self.coef = f.active_experts, coef
        self.recording: list[tuple[int, torch.Tensor]] | None = None
        self.recording_done: list[tuple[int, torch.Tensor]] = []
        self.muted = False  # a pipeline's metadata inference runs its stages on placeholder tensors: not counted
        self.index = getattr(router_recorder(model), "index", None) or 0  # which output holds the logits
        # A router over product keys: its family's loss counts each expert's share of the top-k slots, not of the
        # rows: its aux is 1 / top-k of the usual formula
        self.product_keys = any(hasattr(m, "num_keys") for m in model.modules() if cls and isinstance(m, cls))
        self.slots = self.top_k if self.product_keys else 1
        self.layers = sorted({_layer_of(n) for n, m in model.named_modules() if cls and isinstance(m, cls)})
        for name, m in model.named_modules():
            if cls is not None and isinstance(m, cls):
                m.register_forward_hook(self._record(_layer_of(name)))
        self.step_counts = torch.zeros(config.num_hidden_layers, self.experts, dtype=torch.int64)
        self.aux_parts = torch.zeros(())  # this rank's share of the aux loss since metrics were last read
        self.steps = 0

    @classmethod
    def of(cls, model: nn.Module, mode: str = "auto") -> Routers:
        """The routers of a mixture of experts (families.router_class names their class); `mode`: --moe.aux-loss."""
        routers = cls(model, model.config, aux_loss_coef(model.config, mode))
        model.config.output_router_logits = False  # computed here: the model's own forward need not again
        return routers

    def _record(self, layer: int):
        def hook(module, args, out):
            if self.recording is not None:
                self.recording.append((layer, out[self.index] if isinstance(out, tuple) else out))

        return hook

    @contextlib.contextmanager
    def collecting(self):
        """Record the routers' logits of the forward run inside."""
        self.recording = []
        try:
            yield
        finally:
            self.recording_done, self.recording = self.recording or [], None

    @contextlib.contextmanager
    def paused(self):
        """Forwards inside count nothing (the pipeline's metadata inference on placeholder tensors, which must
        still give (S, C) as a real forward does: the pipeline learns from it what to send and receive)."""
        self.muted = True
        try:
            yield
        finally:
            self.muted = False

    def stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, C) of the last collected forward, as load_balancing_loss_func counts them."""
        got, self.recording_done = self.recording_done, []
        device = got[0][1].device if got else torch.device("cpu")
        prob_sum = torch.zeros(self.experts, dtype=torch.float32, device=device)
        counts = torch.zeros(self.experts + 1, dtype=torch.int64, device=device)
        from meshlm.parallel.expert import ROUTING

        counted = device.type != "meta" and not self.muted and not ROUTING.balanced  # (balanced: fake tensors)
        if counted:
            self.step_counts = self.step_counts.to(device)
        for layer, logits in got:
            # layer split and nn.DataParallel: several devices
            routing, chosen = _routing(logits.to(device), self.top_k, self.product_keys)
            if counted:
                self.step_counts[layer].scatter_add_(0, chosen, torch.ones_like(chosen))
            counts[:-1].scatter_add_(0, chosen, torch.ones_like(chosen))
            counts[-1] += routing.shape[0]
            prob_sum = prob_sum + routing.float().sum(dim=0)
        return prob_sum, counts

    def loss_term(self, prob_sum: torch.Tensor, counts: torch.Tensor, dp_group, weight: float) -> torch.Tensor:
        """This rank's term of coef x aux over the global micro-batch, times `weight` (dp_size / forwards per
        step: DDP and FSDP average gradients over the dp ranks, the step averages its forwards)."""
        if self.muted:  # metadata inference: the pipeline only learns the loss's graph from this
            return torch.sum(prob_sum * 0.0)  # (a gradient the pipeline can send: contiguous)
        counts = counts.clone()
        if dp_group is not None:
            dist.all_reduce(counts, group=dp_group)
        rows = counts[-1].clamp(min=1).to(torch.float32)
        part = self.experts * torch.sum((counts[:-1].to(torch.float32) / (rows * self.slots)) * (prob_sum / rows))
        self.aux_parts = self.aux_parts.to(part.device) + part.detach() * weight
        return part * (self.coef * weight)

    def metrics(self, dp_size: int, groups: list) -> dict:
        """The aux loss (mean over the steps since the last call, without the coefficient) and the router's
        assignments per MoE layer and expert over those steps, summed over the job's tokens. `groups`: the dp
        group (ranks routing other tokens) and the pp group (ranks holding other layers)."""
        device = self.aux_parts.device
        known = torch.zeros(self.step_counts.shape[0], 1, dtype=torch.int64, device=device)
        known[self.layers] = 1
        counts = torch.cat([self.step_counts.to(device), known], dim=1)
        aux = self.aux_parts.detach().to(torch.float64).reshape(1)
        for group in groups:
            if group is not None:
                dist.all_reduce(counts, group=group)
                dist.all_reduce(aux, group=group)
        from meshlm.parallel.expert import ROUTING

        steps, self.steps = max(self.steps, 1), 0
        a2a = ROUTING.take_seconds()
        self.step_counts.zero_()
        self.aux_parts = torch.zeros((), device=device)
        return {
            "aux_loss": aux.item() / dp_size / steps,
            "router_tokens": [row[:-1].tolist() for row in counts.cpu() if row[-1] > 0],
            "all_to_all_s": a2a / steps,  # this rank's, per step (parallel/expert.py: 0 without a dispatch)
        }


class RouterCarry(nn.Module):
    """A pipeline stage of a MoE model: runs the stage and passes its routers' running (S, C) on with its output,
    added to what the previous stage passed, so the last stage returns (logits, S, C) of every layer. The
    pipeline sends them like activations; S's gradient comes back to each stage in backward. It goes around the
    stage before FSDP or DDP wrap it (the pipeline must see those wrappers); the engine gives it `routers`."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage, self.routers = stage, None
        self.config = stage.config  # what the family registry reads (the experts FSDP shards apart)

    def get_input_embeddings(self):
        return self.stage.get_input_embeddings()

    def get_output_embeddings(self):
        return self.stage.get_output_embeddings()

    def forward(self, x, prob_sum=None, counts=None, **kwargs):
        with self.routers.collecting():
            out = self.stage(x, **kwargs)
        own_sum, own_counts = self.routers.stats()
        if prob_sum is not None:
            own_sum, own_counts = own_sum + prob_sum, own_counts + counts
        return out, own_sum, own_counts
