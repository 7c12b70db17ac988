"""objectives/grpo_loss.py against TRL's GRPOTrainer: the same completions, rewards and old and reference
log-probabilities through TRL's own `_compute_loss` (a GRPOTrainer built offline on a tiny Llama and the byte
tokenizer) and through meshlm's chunked log-probabilities and loss give the same loss, gradients and logged
statistics in fp32 for every loss type, with and without beta, epsilon_high != epsilon."""

from __future__ import annotations

import pytest
import torch

from meshlm.objectives import grpo_loss

G, MAX_NEW, TEMPERATURE = 4, 6, 0.7
EPSILON, EPSILON_HIGH = 0.2, 0.28


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    """TRL's GRPOTrainer over the tiny model (its forward patched with TRL's fused LM head) and a copy of the
    model's weights for meshlm."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from meshlm.data.builtin import byte_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
    )
    model = LlamaForCausalLM(config)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")),
        per_device_train_batch_size=2 * G,
        num_generations=G,
        max_completion_length=MAX_NEW,
        temperature=TEMPERATURE,
        epsilon=EPSILON,
        epsilon_high=EPSILON_HIGH,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "1+1="}, {"prompt": "2+2="}]),
        processing_class=byte_tokenizer(),
    )
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets each step: no accumulation here
    mine = LlamaForCausalLM(config)
    mine.load_state_dict(state)
    return trainer, mine


def batch(eos: int, pad: int) -> dict[str, torch.Tensor]:
    """2 prompts x G completions: prompts left-padded, completions of 1 to MAX_NEW tokens (EOS then padding, one
    truncated without EOS), TRL's layout."""
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, 300, (2 * G, 5), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[:G, :2] = 0  # the first prompt is shorter
    prompt_ids[prompt_mask == 0] = pad
    completion_ids = torch.randint(3, 300, (2 * G, MAX_NEW), generator=g)
    lengths = torch.tensor([1, 3, 6, 2, 4, 5, 6, 2])
    completion_mask = (torch.arange(MAX_NEW) < lengths.unsqueeze(1)).long()
    for i, n in enumerate(lengths.tolist()):
        if i != 2:  # the third runs out of tokens (no EOS)
            completion_ids[i, n - 1] = eos
        completion_ids[i, n:] = pad
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }


def meshlm_loss(model, inputs, loss_type, beta, old, ref, advantages, kl_ratio=True):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    width = inputs["completion_ids"].shape[1]
    predicting = hidden[:, -width - 1 : -1]  # the positions whose next token is a completion token
    logps, entropies = grpo_loss.token_logps(
        predicting, model.lm_head.weight, inputs["completion_ids"], temperature=TEMPERATURE, chunk=7
    )
    per_token, stats = grpo_loss.per_token_loss(logps, advantages, old, ref, EPSILON, EPSILON_HIGH, beta, kl_ratio)
    completion_mask = inputs["completion_mask"]
    loss = grpo_loss.aggregate(per_token, completion_mask, loss_type, MAX_NEW, completion_mask.sum())
    sums = grpo_loss.stat_sums(stats, entropies, completion_mask)
    return loss, torch.cat([sums, grpo_loss.clip_extremes(stats, completion_mask)]), logps.detach()


def trl_advantages(rewards: torch.Tensor, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL 1.16's advantages, grpo_trainer.py `_generate_and_score_completions` (sum_then_normalize), line for
    line with TRL's nanstd: the only code path that computes them also generates."""
    from trl.trainer.utils import nanstd

    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    if scale in ("group", "none"):
        std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    else:
        std = nanstd(rewards).expand_as(rewards)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), torch.isclose(std, torch.zeros_like(std))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_match_trl(scale):
    """A group with equal rewards (zero std), one with an unscored (NaN) completion, one ordinary."""
    pytest.importorskip("trl")
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, float("nan"), 1.0, 0.5, 0.2, 0.9, 0.0, 3.0])
    adv, zero = grpo_loss.advantages(rewards, G, scale)
    want, want_zero = trl_advantages(rewards, scale)
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-6)
    assert torch.equal(zero, want_zero)
    assert zero.sum().item() == (0 if scale == "batch" else G)  # frac_reward_zero_std: 1/3 per group


CASES = [(loss, beta, True, True) for loss in grpo_loss.LOSSES for beta in (0.0, 0.04)]
CASES += [("grpo", 0.04, False, True), ("dapo", 0.04, True, False), ("grpo", 0.04, False, False)]


@pytest.mark.parametrize("loss_type, beta, off_policy, kl_ratio", CASES)
def test_loss_gradients_and_statistics_match_trl(trl_trainer, loss_type, beta, off_policy, kl_ratio):
    """Old log-probabilities 0.3 nats away from the current ones (iterations > 1: the clip bites on both sides),
    or none (old = the current ones detached); a reference as far; the KL term with and without the ratio."""
    trainer, mine = trl_trainer
    tok = trainer.processing_class
    inputs = batch(tok.eos_token_id, tok.pad_token_id)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.2, 0.0])
    adv, _ = grpo_loss.advantages(rewards, G, "group")
    mine.zero_grad()
    _, _, current = meshlm_loss(mine, inputs, loss_type, 0.0, None, None, adv)
    noise = torch.Generator().manual_seed(2)
    old = current + 0.3 * torch.randn(current.shape, generator=noise) if off_policy else None
    ref = current + 0.3 * torch.randn(current.shape, generator=noise)
    loss, sums, _ = meshlm_loss(mine, inputs, loss_type, beta, old, ref, adv, kl_ratio)
    loss.backward()

    trainer.loss_type, trainer.beta = loss_type, beta
    trainer.args.use_bias_correction_kl = kl_ratio
    theirs_inputs = {**inputs, "advantages": adv, "num_items_in_batch": inputs["completion_mask"].sum()}
    theirs_inputs["ref_per_token_logps"] = ref
    if old is not None:
        theirs_inputs["old_per_token_logps"] = old
    trainer.model.train()
    trainer.model.zero_grad()
    theirs = trainer._compute_loss(trainer.model, theirs_inputs)
    theirs.backward()

    assert abs(loss.item() - theirs.item()) <= 1e-5 * max(1.0, abs(theirs.item())), (loss.item(), theirs.item())
    for name in ("lm_head.weight", "model.layers.0.self_attn.q_proj.weight"):
        a, b = mine.get_parameter(name).grad, trainer.model.get_parameter(name).grad
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
    logged = trainer._metrics["train"]
    means = (sums[1:6] / sums[0]).tolist() + sums[6:].tolist()
    for key, value in zip([*grpo_loss.STATS[1:], "clip_ratio/low_min", "clip_ratio/high_max"], means):
        if key != "kl" or beta:
            assert abs(value - logged[key][-1]) <= 1e-5, (key, value, logged[key][-1])
    if off_policy:
        assert means[0] > 0 and means[1] > 0  # both sides of the clip were exercised


def test_units_and_sums_give_the_global_mean_over_micro_batches():
    """Split into micro-batches of unequal token counts, each sum / the global units adds up to the whole batch's
    loss for the layout-invariant types (the token-exact rule, engines/base.py); bnpo's global token mean, not a mean
    of means."""
    g = torch.Generator().manual_seed(3)
    loss = torch.randn(6, 5, generator=g)
    mask = (torch.arange(5) < torch.tensor([[1], [5], [2], [4], [3], [5]])).long()
    for loss_type in grpo_loss.LOSSES:
        whole = grpo_loss.aggregate(loss, mask, loss_type, 5, mask.sum())
        total = grpo_loss.units(mask, loss_type, 5)
        assert total.dtype == torch.int64
        parts = sum(grpo_loss.loss_sum(loss[a : a + 2], mask[a : a + 2], loss_type) / total for a in (0, 2, 4))
        torch.testing.assert_close(parts, whole)
    with pytest.raises(ValueError, match="whole groups of 4"):
        grpo_loss.advantages(torch.zeros(6), 4)
