"""The part of the model one rank of a layout holds (its stage, split by TP, cp and ep) and the bytes of what it
computes with: the shapes every planner term (memory, activations, communication) is priced on."""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.plan.job import Job
from meshlm.plan.spec import ModelSpec


@dataclass(frozen=True)
class StageShape:
    """The part of the model one rank holds: layers of a pipeline stage, split by tensor parallel."""

    layers: int
    first: bool  # holds the embedding
    last: bool  # holds final norm, LM head and loss
    in_flight: int  # micro-batches whose activations it holds at once (1F1B: pp - stage index)
    tp: int
    cp: int = 1  # context parallel: this rank computes 1/cp of every sequence's tokens (parallel/context.py)
    ep: int = 1  # expert parallel: a mixture of experts' experts split over ep x tp ranks (parallel/expert.py)

    def cp_scheme(self, spec: ModelSpec, choice: str = "auto") -> str:
        """parallel/context.py's choice (auto: ulysses where a TP rank's heads and key/value heads divide by cp,
        else ring)."""
        from meshlm.parallel.context import scheme_for

        return scheme_for(choice, spec.heads // self.tp, spec.kv_heads // self.tp, self.cp)

    def params(self, spec: ModelSpec) -> int:
        """Parameters on this rank: TP shards the blocks' matrices and the vocabulary rows of the token
        embedding and LM head (parallel/tensor.py, vocabulary parallel)."""
        block = (spec.layer_matmul_per_rank(self.tp) + spec.layer_params - spec.layer_matmul) * self.layers
        lm_head = spec.vocab * spec.hidden
        n = block + (spec.embed_params - lm_head + lm_head // self.tp if self.first else 0)
        if self.last:
            if spec.tied:  # under PP the last stage keeps its own copy of the tied weight
                n += spec.head_params + (lm_head // self.tp if not self.first else 0)
            else:
                n += spec.head_params - lm_head + lm_head // self.tp
        return n

    def matmul_params(self, spec: ModelSpec) -> int:
        return spec.layer_matmul_per_rank(self.tp) * self.layers + (spec.vocab * spec.hidden if self.last else 0)

    def active_matmul_params(self, spec: ModelSpec) -> int:
        """The matrices one token computes with on this rank: a mixture of experts' k of E (their FLOPs)."""
        return self.matmul_params(spec) - spec.inactive_params // spec.layers // self.tp * self.layers

    def float8_params(self, spec: ModelSpec, job: Job) -> int:
        """Of one block's matrices on this rank, what --float8 computes in float8: the dense projections
        (parallel/float8.py; a mixture of experts' grouped experts stay in their dtype)."""
        if job.float8 == "off":
            return 0
        return spec.layer_matmul_per_rank(self.tp) - spec.expert_layer_params // self.tp

    def whole_params(self, spec: ModelSpec) -> int:
        """Parameters this rank holds gathered where FSDP keeps them so (zero2 from forward to backward): its
        part, less other ranks' experts under expert parallel (a rank of the expert group has experts / ep x tp)."""
        experts = spec.expert_layer_params // self.tp
        return self.params(spec) - (experts - experts // self.ep) * self.layers

    def gathered_unit(self, spec: ModelSpec) -> int:
        """Parameters FSDP gathers to run one block: all of it, or under expert parallel its dense part and
        this rank's experts (each expert a unit of its own, sharded over the ranks holding the same experts)."""
        experts = spec.expert_layer_params // self.tp
        return spec.layer_params // self.tp - experts + experts // self.ep


@dataclass(frozen=True)
class Dtypes:
    """Bytes of what a block computes with, in each of meshlm's three precision set-ups:
    fp32; bf16 autocast over fp32 parameters (single, ddp, zero1): matmuls in bf16, the residual stream fp32,
    every projection casting its own input; bf16 parameters (FSDP2 mixed precision: zero2/3, hsdp; and
    engines/master_weights.py: zero1/2): the parameters computed with are bf16, so is the residual stream, and
    projections share one bf16 input."""

    compute: int
    stream: int
    casts: bool

    @classmethod
    def of(cls, job: Job, bf16_params: bool) -> "Dtypes":
        if job.precision == "fp32":
            return cls(4, 4, False)
        return cls(2, 2, False) if bf16_params else cls(2, 4, True)
