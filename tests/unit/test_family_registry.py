"""The family registry in this process: entries read from transformers' metadata, meshlm's overrides, register(),
the planner's facts, and the one-line refusals. The multi-rank proofs are tests/test_families.py."""

from __future__ import annotations

import warnings

import pytest
import transformers as tf

from conftest import family_config, needs_family, needs_working_family
from meshlm.errors import MeshlmError
from meshlm.models import families
from meshlm.models.families import forward
from meshlm.parallel.tensor import check_tp

LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("config", [tf.LlamaConfig, tf.MistralConfig, tf.Qwen2Config])
def test_llama_layout_families_read_from_transformers(config):
    fam = families.family(config())
    assert (fam.embed, fam.layers, fam.norm, fam.rotary, fam.source) == (
        ("embed_tokens",),
        "layers",
        "norm",
        "rotary_emb",
        "transformers",
    )
    assert fam.tp_plan == dict(config.base_model_tp_plan) and fam.lora_targets == LLAMA_PROJECTIONS


def test_overrides_where_transformers_says_nothing_or_less():
    gpt2 = families.family(tf.GPT2Config())
    assert (gpt2.embed, gpt2.layers, gpt2.norm, gpt2.positions, gpt2.conv1d) == (
        ("wte", "wpe", "drop"),
        "h",
        "ln_f",
        "wpe",
        True,
    )
    olmo2 = families.family(tf.Olmo2Config())  # transformers gathers q/k/v; meshlm splits the norm instead
    assert (
        "colwise_gather_output" not in olmo2.tp_plan.values()
        and olmo2.tp_plan["layers.*.self_attn.q_norm"] == "sharded_norm"
    )
    assert olmo2.lora_targets == LLAMA_PROJECTIONS
    phi3 = families.family(tf.Phi3Config())
    assert phi3.fused["self_attn.qkv_proj"] == {"q_proj": "heads", "k_proj": "kv_heads", "v_proj": "kv_heads"}
    assert phi3.lora_targets == LLAMA_PROJECTIONS
    qwen3 = families.family(tf.Qwen3Config())  # transformers' replicated_with_grad_allreduce
    assert qwen3.tp_plan["layers.*.self_attn.q_norm"] == "head_norm"


@pytest.mark.parametrize(
    "config",
    [
        tf.Qwen3Config(num_attention_heads=4, num_key_value_heads=2),
        tf.Gemma2Config(num_attention_heads=4, num_key_value_heads=2),
        tf.Gemma3TextConfig(num_attention_heads=4, num_key_value_heads=2),
        tf.Phi3Config(num_attention_heads=4, num_key_value_heads=2),
        tf.Olmo2Config(num_attention_heads=4, num_key_value_heads=2),
        tf.GraniteConfig(num_attention_heads=4, num_key_value_heads=2),
        tf.GPTNeoXConfig(num_attention_heads=4),
        tf.Starcoder2Config(num_attention_heads=4, num_key_value_heads=2),
        tf.SmolLM3Config(num_attention_heads=4, num_key_value_heads=2),
    ],
    ids=lambda c: c.model_type,
)
def test_dense_families_have_every_style_meshlm_needs(config):
    check_tp(config, 2)  # raises for a style meshlm does not implement
    assert families.pipeline_parts(config, "pipeline parallel").layers == "layers"


def test_refusals_name_what_is_missing_and_what_still_works():
    with pytest.raises(
        MeshlmError, match="tensor parallel needs a TP plan for model family 'bloom'.*still work: single"
    ):
        families.tp_plan(tf.BloomConfig())
    with pytest.raises(
        MeshlmError,
        match="layer list of model family .mpt.*still work: single, ddp, zero1, zero2, zero3, fsdp, hsdp$",
    ):  # MPT: no plans from 5.17 to 5.24 (CodeGen has both from 5.24)
        families.pipeline_parts(tf.MptConfig(), "pipeline parallel")
    with pytest.raises(MeshlmError, match="needs plan styles meshlm does not implement: .*rowwise_split_input"):
        check_tp(tf.Qwen4ExpTextConfig(num_attention_heads=4, num_key_value_heads=4), 2)


def test_facts_for_the_planner():
    f = families.facts(tf.Gemma2Config(hidden_size=2304, num_attention_heads=8, num_key_value_heads=4, head_dim=256))
    assert (f.hidden, f.heads, f.kv_heads, f.head_dim, f.experts) == (2304, 8, 4, 256, 0)
    assert set(f.layer_types) == {"sliding_attention", "full_attention"}
    m = families.facts(tf.MixtralConfig(num_local_experts=8, num_experts_per_tok=2))
    assert (m.experts, m.active_experts) == (8, 2)
    assert families.facts(tf.GPT2Config(n_embd=64, n_head=4, n_layer=2)).mlp == 256  # n_inner None: 4 x hidden


def test_register_a_family_from_user_code():
    class Renamed(tf.LlamaConfig):
        model_type = "unit_renamed_llama"
        base_model_tp_plan = None
        base_model_pp_plan = None

    tf.AutoConfig.register("unit_renamed_llama", Renamed, exist_ok=True)
    with pytest.raises(MeshlmError, match="needs a TP plan"):
        families.tp_plan(Renamed())
    plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
    fam = families.register("unit_renamed_llama", embed=("embed_tokens",), layers="layers", norm="norm", tp_plan=plan)
    assert families.family(Renamed()) is fam and fam.lora_targets == ("q_proj", "o_proj") and fam.source == "register()"
    with pytest.raises(ValueError, match="unknown fields"):
        families.register("unit_renamed_llama", layer_list="layers")


TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)


@pytest.mark.parametrize(
    "config, changes",
    [
        (tf.LlamaConfig(**TINY), False),
        (tf.GraniteConfig(**TINY, logits_scaling=8.0), True),
        (tf.CohereConfig(**TINY, logit_scale=0.0625), True),  # multiplies: a pipeline's last stage missed it
        (tf.Gemma2Config(**TINY, head_dim=16, final_logit_softcapping=30.0), True),
    ],
    ids=lambda x: getattr(x, "model_type", str(x)),
)
def test_final_logits_are_transformers_own(config, changes):
    """A pipeline's last stage runs the head itself (models/stages.py) and applies final_logits; the chunked-loss
    head refuses models whose logits change after the head. Both must agree with the causal LM's own forward."""
    import torch

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 8))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        hidden = model.model(input_ids=ids).last_hidden_state
        got = forward.final_logits(config, model.lm_head(hidden))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert forward.changes_logits(config) is changes


def test_inkling_divides_the_final_hidden_states_and_leaves_embeddings_alone():
    """Inkling's config answers to embedding_multiplier as an alias of logits_mup_width_multiplier (24), which its
    forward divides the final hidden states by. A pipeline multiplied the token embeddings by it and never
    divided: pp 2 was 2.7e-1 (relative) off one process in the coverage table."""
    import torch

    config = tf.InklingTextConfig(**TINY, vocab_size=128, head_dim=16, swa_head_dim=16, swa_num_attention_heads=2,
                                  swa_num_key_value_heads=1, n_routed_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32)  # fmt: skip
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 8))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = forward.final_logits(config, model.lm_head(model.model(input_ids=ids).last_hidden_state))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # (h / 24) W against (h W) / 24: rounding only
    assert forward.changes_logits(config)
    h = torch.ones(2)
    assert forward.scaled_embeddings(config, h) is h
    assert torch.equal(forward.scaled_embeddings(tf.GraniteConfig(embedding_multiplier=12.0), h), h * 12)


MLA = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=128,
    moe_intermediate_size=64,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    kv_lora_rank=32,
    vocab_size=128,
)


def test_latent_attention_plans_split_the_heads():
    """DeepSeek-V3's plan from transformers splits only its MLPs: meshlm adds DeepSeek-V2's attention entries.
    Every latent-attention plan names the query latent (q_a_proj), which transformers leaves a plain module."""
    from meshlm.parallel.tensor_styles import STYLES

    for config in (tf.DeepseekV3Config(**MLA), tf.DeepseekV2Config(**MLA)):
        plan = families.tp_plan(config)
        assert plan["layers.*.self_attn.kv_a_proj_with_mqa"] == "mla_kv_a_proj"
        assert plan["layers.*.self_attn.q_a_proj"] == "replicated"
        assert plan["layers.*.self_attn.q_b_proj"] == "colwise" and plan["layers.*.self_attn.o_proj"] == "rowwise"
        assert all(s in STYLES for s in plan.values())
        check_tp(config, 2)  # 4 heads, 4 kv heads, 4 experts: accepted


SINKS = {**{k: MLA[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")},
         "num_key_value_heads": 2, "intermediate_size": 128, "num_experts_per_tok": 2}  # fmt: skip
ONE_RANK_TP = {
    "deepseek_v3": tf.DeepseekV3Config(**MLA),  # dense blocks (first_k_dense_replace 3)
    "deepseek_v3 q_lora": tf.DeepseekV3Config(**MLA, q_lora_rank=32),
    "deepseek_v32": tf.DeepseekV32Config(**MLA, q_lora_rank=32),  # a sparse-attention indexer
    "minimax": tf.MiniMaxConfig(  # a linear-attention block and a softmax one
        **{k: MLA[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")},
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_local_experts=4,
        layer_types=["linear_attention", "full_attention"],
    ),
    "granite_swa": tf.GraniteSWAConfig(**SINKS),  # attention sinks: local_params
    # a normed token embedding (an RMSNorm inside) split over the vocabulary; plan: replicate it, experts only
    "inkling2_text": family_config(
        "Inkling2TextConfig",
        **SINKS,
        head_dim=16,
        swa_head_dim=16,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        n_routed_experts=4,
        moe_intermediate_size=32,
    ),
    "beam": family_config(
        "BeamConfig", **SINKS, head_dim=16, n_routed_experts=4, moe_intermediate_size=64
    ),  # gate_bias
    # dt_proj reduce-scattered by head, A split with the heads; a MoE MLP of expert embeddings fed its input whole
    "doge": tf.DogeConfig(**SINKS, is_moe=True, num_experts=16, keep_window_size=8),
    "doge dense": tf.DogeConfig(**SINKS, keep_window_size=8),  # runs where transformers' own MoE forward fails
    # whole experts (every token through each) beside a dense MLP at the same path; a shared expert added to in place
    "llama4_text": tf.Llama4TextConfig(
        **SINKS, head_dim=16, intermediate_size_mlp=128, num_local_experts=4, interleave_moe_layer_step=2
    ),
}


@pytest.mark.parametrize("case", ONE_RANK_TP)
def test_tp_styles_compose_on_one_rank(case):
    """apply_tp over a 1-rank mesh gives the unsplit model's logits and gradients: every module of a split
    attention meets its replicated DTensor input, and a block with nothing split keeps plain tensors. Before:
    "mixed torch.Tensor and DTensor" in MLA's q_a_proj and kv_a_proj_with_mqa, DeepSeek-V3.2's indexer, and
    MiniMax's linear-attention blocks. The sums over ranks are the coverage table's tp 2 rows."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshlm.parallel.tensor import apply_tp

    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        config = needs_family(ONE_RANK_TP[case], case)
        needs_working_family(case)
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=families.attention(config))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            split = apply_tp(copy.deepcopy(model), init_device_mesh("cpu", (1,)))
        unresolved = [str(w.message)[:80] for w in seen if "could not be resolved" in str(w.message)]
        assert not unresolved, unresolved  # the plan holds only modules this model has
        ids = torch.randint(0, 128, (2, 12))
        want, got = model(input_ids=ids, labels=ids), split(input_ids=ids, labels=ids)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        want.loss.backward()
        got.loss.backward()
        for (name, p), q in zip(model.named_parameters(), split.parameters()):
            g = q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad
            assert (g is None) == (p.grad is None), name  # the indexer's projections get none
            if g is not None:
                torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    finally:
        if mine:
            dist.destroy_process_group()


def test_unsplittable_families_refuse_stages_in_one_line():
    """A decoder whose blocks pass more than hidden states to the next (GLM-MoE-DSA's indexer choices) has a
    layer list but no stage cut: pp and layer split refuse, naming why and what still runs."""
    config = tf.GlmMoeDsaConfig()
    with pytest.raises(MeshlmError, match=r"cannot cut model family 'glm_moe_dsa' into stages: its blocks pass"):
        families.pipeline_parts(config, "pipeline parallel")
    assert "--parallel.pp" not in families.still_working(config)
    assert families.pipeline_parts(tf.DeepseekV32Config(), "layer split").layers == "layers"


def test_experts_under_aria_names():
    """Aria names its experts moe_num_experts and moe_topk (ZeroDivisionError in the inactive-parameter count
    when the planner's facts read 0 experts)."""
    f = families.facts(tf.AriaTextConfig(moe_num_experts=8, moe_topk=2))
    assert (f.experts, f.active_experts) == (8, 2)


def test_two_stack_and_recurrent_families_refuse_in_one_line():
    """HRM splits blocks under two recurrent stacks: tp names them, pp says why no stage cut exists."""
    config = tf.HrmTextConfig()
    with pytest.raises(MeshlmError, match=r"its plan splits blocks under H_module.layers, L_module.layers"):
        check_tp(config, 2)
    with pytest.raises(MeshlmError, match=r"cannot cut model family 'hrm_text' into stages: it runs its two"):
        families.pipeline_parts(config, "pipeline parallel")


@pytest.mark.parametrize(
    "config, norm",
    [
        (tf.MiniMaxM2Config(), "sharded_norm"),  # q/k norms over the full projection width, as OLMo 2's
        (tf.OlmoHybridConfig(), "sharded_norm"),
        (tf.FlexOlmoConfig(), "sharded_norm"),
        (tf.MiniMaxM3VLTextConfig(), "head_norm"),  # per-head norms
    ],
    ids=lambda x: getattr(x, "model_type", str(x)),
)
def test_gathered_attention_plans_stay_split_by_heads(config, norm):
    """transformers' plan gathers q, k and v (colwise_gather_output) for these families' q/k norms; meshlm's
    splits them by heads and keeps the plan's other entries (the experts', the MLP's)."""
    plan = families.tp_plan(config)
    assert {plan[f"layers.*.self_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj")} == {"colwise"}
    assert plan["layers.*.self_attn.q_norm"] == plan["layers.*.self_attn.k_norm"] == norm
    assert plan["layers.*.self_attn.o_proj"] == "rowwise"
    assert "colwise_gather_output" not in plan.values() and "rowwise_split_input" not in plan.values()


def test_attention_sinks_split_with_the_heads():
    """transformers' local_params: the sinks (one per head) become Shard(0) DTensors beside the split projections,
    and the attention's forward sees their local tensors. Before: the owner's own style was skipped with its
    parameter's entry, and the whole sinks met each rank's half of the heads (tp 2: size 4 against 2)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from meshlm.parallel.tensor import apply_tp

    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        config = ONE_RANK_TP["granite_swa"]
        model = apply_tp(tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager"),
                         init_device_mesh("cpu", (1,)))  # fmt: skip
        attn = model.model.layers[0].self_attn
        assert isinstance(attn.sinks, DTensor) and attn.sinks.placements == (Shard(0),)
        assert isinstance(attn.q_proj.weight, DTensor)
    finally:
        if mine:
            dist.destroy_process_group()


def test_a_plan_of_experts_only_keeps_the_blocks_whole():
    """Inkling's plan splits only its mixture of experts (routed and shared), which meshlm splits by whole experts:
    an empty plan, not none, so tp runs with the rest of each block whole on every rank (as transformers' own tp
    keeps its attention). Before: "its config has no base_model_tp_plan", which it has."""
    config = tf.InklingTextConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  n_routed_experts=4, num_experts_per_tok=2)  # fmt: skip
    # 5.17-5.22 also name the token embedding, which meshlm splits over the vocabulary whatever the plan says
    assert {k: v for k, v in families.tp_plan(config).items() if k != "embed_tokens"} == {}
    assert "--parallel.tp" in families.still_working(config)
    check_tp(config, 2)
    with pytest.raises(MeshlmError, match="no base_model_tp_plan"):
        families.tp_plan(tf.BloomConfig())


@pytest.mark.parametrize("case", ["deepseek_v3", "deepseek_v3 q_lora", "minimax"])
def test_planner_counts_what_tp_keeps_whole(case):
    """The planner's parameters on a rank of tp 2 against meshlm's own placements (apply_tp on a 1-rank mesh: a
    Shard parameter holds half on each of 2 ranks, a replicated or plain one all of it, experts split whole).
    Multi-head latent attention's latents (q_a_proj, kv_a_proj_with_mqa) and the routers stay whole: the planner
    counted every block matrix split: 6% under for the coverage table's DeepSeek-V3 (81,472 against 86,720)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from meshlm.parallel.expert import experts_modules
    from meshlm.parallel.tensor import apply_tp
    from meshlm.plan.shape import StageShape
    from meshlm.plan.spec import from_hf_config

    config = needs_family(ONE_RANK_TP[case], case)
    planned = StageShape(layers=config.num_hidden_layers, first=True, last=True, in_flight=1, tp=2).params(
        from_hf_config(case, config)
    )
    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = tf.AutoModelForCausalLM.from_config(config)
        experts = {id(p) for _, e in experts_modules(model) for p in e.parameters()}
        apply_tp(model, init_device_mesh("cpu", (1,)))
        split = [isinstance(p, DTensor) and isinstance(p.placements[0], Shard) or id(p) in experts
                 for p in model.parameters()]  # fmt: skip
        placed = sum(p.numel() // 2 if s else p.numel() for p, s in zip(model.parameters(), split))
    finally:
        if mine:
            dist.destroy_process_group()
    assert planned == placed


def test_the_planners_split_styles_are_styles():
    """The planner counts a matrix split by tp when its style is one of SPLITS_MATRICES: each is a style meshlm
    applies (a renamed or removed style would leave the planner counting it whole or split by mistake)."""
    from meshlm.parallel.tensor_styles import SPLITS_MATRICES, STYLES

    assert SPLITS_MATRICES and SPLITS_MATRICES <= set(STYLES)
    assert not SPLITS_MATRICES & {"replicated", "replicate", "mla_kv_a_proj", "head_norm", "sharded_norm"}


def test_llama4_text_is_split_by_whole_experts_and_cut_into_stages():
    """Llama 4's text model: transformers' plan splits every expert's width (packed_rowwise, moe_tp_experts, styles
    meshlm does not implement) and it ships no pp plan; the registry splits whole experts and names the layer list.
    Its causal LM holds the decoder as `model` though its base_model_prefix says language_model."""
    config = tf.Llama4TextConfig(**SINKS, head_dim=16, num_local_experts=4)
    fam = families.family(config)
    assert fam.tp_plan["layers.*.feed_forward.experts"] == "whole_experts"
    assert not any(s.startswith(("packed", "moe_")) for s in fam.tp_plan.values()), fam.tp_plan
    assert families.pipeline_parts(config, "--parallel.pp 2").layers == "layers"
    model = tf.AutoModelForCausalLM.from_config(config)
    assert families.decoder(model) is model.model
    from transformers.masking_utils import create_chunked_causal_mask

    assert forward.mask_function(model, "chunked_attention") is create_chunked_causal_mask
