"""A model family meshlm has never heard of, added from this file alone: a renamed copy of Llama's config and
model without transformers' TP and PP plans, registered with transformers' Auto classes and with meshlm's
family registry. tests/test_families.py runs it in every rank (tests/helpers/family_runs.py `setup`)."""

from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from meshlm.models import families


class RenamedConfig(LlamaConfig):
    model_type = "renamed_llama"
    base_model_tp_plan = None  # nothing from transformers: the registry entry below is all meshlm knows
    base_model_pp_plan = None


class RenamedForCausalLM(LlamaForCausalLM):
    config_class = RenamedConfig


AutoConfig.register("renamed_llama", RenamedConfig, exist_ok=True)
AutoModelForCausalLM.register(RenamedConfig, RenamedForCausalLM, exist_ok=True)
families.register(
    "renamed_llama",
    embed=("embed_tokens",),
    layers="layers",
    norm="norm",
    tp_plan={
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    },
)
