"""The routers' load-balancing loss meshlm backpropagates is transformers' own, term by term.

One process: `Routers` on a forward gives exactly the `aux_loss` transformers' causal LM returns for the
same batch (qwen3_moe, mixtral, olmoe; doge, whose router scores product keys, within 1 ulp). Split over
"ranks" by hand (each computing its term from its own slice with the counts added over the slices, as the
all-reduce does): the terms add up to transformers' loss over the whole batch, and so do their gradients,
while a per-slice transformers loss does not.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DogeConfig, MixtralConfig, OlmoeConfig, Qwen3MoeConfig

from conftest import needs_working_family
from meshlm.parallel.aux_loss import Routers, aux_loss_coef

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    output_router_logits=True,
    router_aux_loss_coef=0.02,
)
CONFIGS = {
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **SMALL,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=8,
        norm_topk_prob=True,
    ),
    "mixtral": lambda: MixtralConfig(**SMALL, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
    "olmoe": lambda: OlmoeConfig(
        **SMALL,
        intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    ),
    # product keys: the router scores 4 + 4 keys, expert x * 4 + y; its loss counts shares of the top-k slots
    "doge": lambda: DogeConfig(**SMALL, intermediate_size=16, is_moe=True, num_experts=16, num_experts_per_tok=4),
}


def _model(kind):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[kind]())


@pytest.mark.parametrize("kind", CONFIGS)
def test_one_forward_is_transformers_aux_loss(kind):
    needs_working_family(kind)
    model = _model(kind)
    ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(1))
    theirs = model(input_ids=ids, labels=ids).aux_loss
    routers = Routers(model, model.config, coef=1.0)
    with routers.collecting():
        model(input_ids=ids)
    prob_sum, counts = routers.stats()
    mine = routers.loss_term(prob_sum, counts, None, weight=1.0)
    assert counts[-1].item() == 2 * 3 * 10  # rows: MoE layers x tokens
    assert counts[:-1].sum().item() == 2 * 3 * 10 * model.config.num_experts_per_tok
    # Doge's own loss sums its routing probabilities over all layers' rows at once, meshlm per layer: 1 ulp apart
    tolerance = 1e-6 if kind == "doge" else 0
    torch.testing.assert_close(mine, theirs, rtol=tolerance, atol=0)


def test_split_batch_terms_add_up_to_the_whole_batch():
    model = _model("mixtral")
    ids = torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(2))
    whole = model(input_ids=ids, labels=ids).aux_loss
    (g_whole,) = torch.autograd.grad(whole, model.model.layers[0].mlp.gate.weight)

    routers = Routers(model, model.config, coef=1.0)
    stats = []
    for part in ids.chunk(2):  # two "ranks", each its half of the batch
        with routers.collecting():
            model(input_ids=part)
        stats.append(routers.stats())
    counts = stats[0][1] + stats[1][1]  # what the all-reduce over the data-parallel ranks gives
    terms = [routers.loss_term(s, counts, None, weight=1.0) for s, _ in stats]
    (g_split,) = torch.autograd.grad(sum(terms), model.model.layers[0].mlp.gate.weight)
    torch.testing.assert_close(sum(terms), whole, rtol=1e-6, atol=0)
    torch.testing.assert_close(g_split, g_whole, rtol=1e-5, atol=1e-9)
    # what each rank would get from transformers on its own half: not the whole batch's loss
    halves = [model(input_ids=p, labels=p).aux_loss for p in ids.chunk(2)]
    assert abs((halves[0] + halves[1]) / 2 - whole).item() > 1e-4


def test_coefficient_follows_the_model_config():
    config = CONFIGS["mixtral"]()
    assert aux_loss_coef(config) == 0.02
    config.output_router_logits = False
    assert aux_loss_coef(config) == 0.0  # transformers adds no aux loss then
    assert aux_loss_coef(config, "on") == 0.02
    assert aux_loss_coef(CONFIGS["mixtral"](), "off") == 0.0


def test_routers_count_zero_experts_too():
    """LongCat-Flash's router scores its routed experts and then its zero (identity) experts: the counts hold
    them all (an index past the routed experts failed in one process before)."""
    import transformers as tf

    from meshlm.parallel.aux_loss import Routers

    config = tf.LongcatFlashConfig(
        hidden_size=64, num_layers=1, num_attention_heads=4, n_routed_experts=4, zero_expert_num=4, moe_topk=2,
        ffn_hidden_size=128, expert_ffn_hidden_size=64, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, head_dim=16, qk_head_dim=32, num_key_value_heads=4, vocab_size=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config)
    if "router_logits" not in type(model)._can_record_outputs:
        pytest.skip(f"transformers {tf.__version__}'s LongCat-Flash records no router logits: no router loss")
    routers = Routers.of(model)
    with routers.collecting():
        model(input_ids=torch.randint(0, 128, (2, 8)))
    prob_sum, counts = routers.stats()
    assert prob_sum.shape == (8,) and counts[-1] == 2 * 8 * len(routers.layers)
    assert counts[:-1].sum() == 2 * counts[-1]  # top-2 of the 8 per routed row
