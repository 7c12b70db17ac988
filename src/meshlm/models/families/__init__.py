"""The model-family registry: everything meshlm knows about a transformers decoder family.

- `entries.py`: meshlm's own entry per family (its TP plan or the entries put over transformers', its layer list,
  fused projections, why a layout cannot run it): where a new family's facts go.
- `registry.py`: the `Family` a config gets (transformers' metadata under the entry), and what each layout needs
  of it, or one line why not.
- `parts.py`: a built model's parts, found on the model (decoder, LM head, tied head, blocks).
- `forward.py`: what a decoder's own forward does around its parts, which a pipeline stage repeats (imported from
  there by what runs a decoder in pieces or computes the loss in its head, so other ranks load none of it).
- `facts.py`: a config's dimensions, for the planner and the layout checks.
"""

from meshlm.models.families.facts import Facts, facts, moe_layers, router_experts
from meshlm.models.families.parts import (
    attention,
    base_name,
    decoder,
    head_name,
    model_class,
    router_class,
    supports_attention_interface,
    tied,
    transformer_blocks,
)
from meshlm.models.families.registry import (
    DATA_PARALLEL,
    LINEAR_STYLES,
    TRANSFORMERS_STYLES,
    Family,
    check_sequence_parallel,
    family,
    lora_targets,
    pipeline_parts,
    register,
    still_working,
    tp_plan,
)

__all__ = [
    "DATA_PARALLEL",
    "LINEAR_STYLES",
    "TRANSFORMERS_STYLES",
    "Facts",
    "Family",
    "attention",
    "base_name",
    "check_sequence_parallel",
    "decoder",
    "facts",
    "family",
    "head_name",
    "lora_targets",
    "model_class",
    "moe_layers",
    "pipeline_parts",
    "register",
    "router_class",
    "router_experts",
    "still_working",
    "supports_attention_interface",
    "tied",
    "tp_plan",
    "transformer_blocks",
]
