"""Preference records (data/preference.py), their packing, the DPO loss's pieces (objectives/dpo_loss.py), the
config checks of --objective dpo and the planner's reference (plan/memory.py): in-process."""

from __future__ import annotations

import pytest
import torch

from meshlm import config as config_mod
from meshlm.data.builtin import byte_tokenizer, preference_corpus
from meshlm.data.pack import Blocks, BlockWriter
from meshlm.data.preference import encode_pair, pair_documents
from meshlm.errors import MeshlmError
from meshlm.objectives.dpo_loss import pair_counts, pair_losses, sequence_logps

CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_text_pair_shares_the_prompt_and_learns_the_responses_with_eos(tok):
    rec = {"prompt": "add: 1 + 2 =", "chosen": " 3", "rejected": " 4"}
    prompt, chosen, rejected = encode_pair(rec, tok, "r")
    assert prompt == tok("add: 1 + 2 =")["input_ids"]
    assert tok.decode(chosen) == " 3" + tok.eos_token and tok.decode(rejected) == " 4" + tok.eos_token
    (c_ids, c_learned), (r_ids, r_learned) = pair_documents(rec, tok, "r")
    assert c_ids[: len(prompt)] == r_ids[: len(prompt)] == prompt
    assert c_learned == [False] * len(prompt) + [True] * len(chosen) and sum(r_learned) == len(rejected)


def test_chat_pair_goes_through_the_chat_template(tok):
    tok = byte_tokenizer()
    tok.chat_template = CHAT
    rec = {
        "prompt": [{"role": "user", "content": "sky?"}],
        "chosen": [{"role": "assistant", "content": "blue"}],
        "rejected": [{"role": "assistant", "content": "green"}],
    }
    prompt, chosen, _ = encode_pair(rec, tok, "r")
    assert tok.decode(prompt) == "<|user|>sky?\n<|assistant|>"
    assert tok.decode(prompt + chosen) == "<|user|>sky?\n<|assistant|>blue\n"
    # the implicit-prompt layout (chosen and rejected whole conversations) gives the same pair
    implicit = {"chosen": rec["prompt"] + rec["chosen"], "rejected": rec["prompt"] + rec["rejected"]}
    assert encode_pair(implicit, tok, "r") == encode_pair(rec, tok, "r")


def test_implicit_text_prompt_is_the_common_beginning(tok):
    got = encode_pair({"chosen": "The sky is blue", "rejected": "The sky is green"}, tok, "r")
    assert got == encode_pair({"prompt": "The sky is", "chosen": " blue", "rejected": " green"}, tok, "r")


@pytest.mark.parametrize(
    "rec, words",
    [
        ({"prompt": "a", "chosen": "b"}, "no 'rejected'"),
        ({"prompt": "a", "rejected": "b"}, "no 'chosen'"),
        ({"prompt": "a", "chosen": "", "rejected": "b"}, "'chosen' response is empty"),
        ({"prompt": "a", "chosen": "b", "rejected": " \n"}, "'rejected' response is empty"),
        ({"prompt": "a", "chosen": [{"role": "assistant", "content": ""}], "rejected": "b"}, "all be strings"),
        (
            {
                "prompt": [],
                "chosen": [{"role": "assistant", "content": " "}],
                "rejected": [{"role": "assistant", "content": "x"}],
            },
            "'chosen' response is empty",
        ),
        ({"prompt": "a", "chosen": 3, "rejected": "b"}, "all be strings"),
    ],
)
def test_bad_records_are_one_line_errors(tok, rec, words):
    with pytest.raises(MeshlmError, match=words) as e:
        encode_pair(rec, tok, "data.jsonl record 7")
    assert str(e.value).startswith("data.jsonl record 7:") and "\n" not in str(e.value)


def test_pairs_stay_whole_in_one_block_and_a_longer_pair_is_an_error(tok, tmp_path):
    writer = BlockWriter(tmp_path / "b", 128, tok.pad_token_id, packing=True, overflow="split")
    for i, rec in enumerate(preference_corpus(40)):
        writer.add_together(pair_documents(rec, tok, f"record {i}"), f"record {i}")
    assert writer.close()["documents"] == 80
    blocks = Blocks(tmp_path / "b")
    batch = blocks.batch(list(range(len(blocks))))
    assert int(pair_counts(batch.labels, batch.positions).sum()) == 40
    assert 1 < len(blocks) < 40  # several pairs per block
    with pytest.raises(MeshlmError, match="record 9: .* is 130 tokens .*longer than a block of --seq-length 128"):
        rec = {"prompt": "x" * 62, "chosen": "ab", "rejected": "cd"}
        writer = BlockWriter(tmp_path / "c", 128, 0, packing=True, overflow="split")
        writer.add_together(pair_documents(rec, tok, "record 9"), "record 9: the pair")


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    return LlamaForCausalLM(cfg).eval()


def test_packed_sequence_logps_equal_each_document_alone(tok):
    """A row of three packed pairs: each document's summed log-probability of its response equals the document
    run alone (the document mask from the restarting position ids), and the slots past the pairs are empty."""
    from meshlm.data.pack import labels_of

    model = _tiny_llama()
    docs = [d for rec in preference_corpus(3, seed=5) for d in pair_documents(rec, tok, "r")]
    ids, labels, positions = [], [], []
    for doc, learned in docs:
        ids, labels, positions = ids + doc, labels + labels_of(doc, learned), positions + list(range(len(doc)))
    row = [torch.tensor([x]) for x in (ids, labels, positions)]
    with torch.no_grad():
        got = sequence_logps(model(input_ids=row[0], position_ids=row[2], use_cache=False).logits, *row[1:])
        for k, (doc, learned) in enumerate(docs):
            lab = torch.tensor([labels_of(doc, learned)])
            alone = sequence_logps(model(input_ids=torch.tensor([doc])).logits, lab, torch.arange(len(doc))[None])
            torch.testing.assert_close(got[0, k // 2, k % 2], alone[0, 0, 0], rtol=1e-5, atol=1e-5)
    assert got[0, 3:].abs().sum() == 0 and got.shape[1] == (len(ids) + 1) // 2


def test_pair_losses_of_the_variants():
    """Hand-computed values: Delta = 1 nat, chosen 2 tokens, rejected 4."""
    policy = torch.tensor([[[[-3.0, 2.0], [-5.0, 4.0]], [[0.0, 0.0], [0.0, 0.0]]]])  # one real pair, one empty slot
    reference = torch.tensor([[[-4.0, -5.0], [0.0, 0.0]]])  # chosen +1, rejected 0: Delta 1
    beta, e = 0.5, 0.1
    sig = lambda x: torch.nn.functional.logsigmoid(torch.tensor(x)).item()
    loss, stats = pair_losses(policy, reference, "sigmoid", beta, e)
    assert loss[0, 0].item() == pytest.approx(-(1 - e) * sig(0.5) - e * sig(-0.5)) and loss[0, 1] == 0
    assert stats.tolist() == pytest.approx([1, 0.5, 0.0, 1, 0.5, -3, -5])
    norm = 1 / 2 - 0 / 4
    assert pair_losses(policy, reference, "sigmoid_norm", beta, 0)[0][0, 0].item() == pytest.approx(-sig(beta * norm))
    assert pair_losses(policy, reference, "ipo", beta, 0)[0][0, 0].item() == pytest.approx((norm - 1) ** 2)


@pytest.mark.parametrize(
    "keys, words",
    [
        ([("objective", "dpo"), ("loss_on", "all")], "drop --loss-on all"),
        ([("dpo.beta", "0")], "--dpo.beta must be positive"),
        ([("dpo.label_smoothing", "0.5")], "in [0, 0.5)"),
        ([("dpo.loss", "ipo"), ("dpo.label_smoothing", "0.1")], "ipo has none"),
        ([("dpo.loss", "hinge")], "must be one of sigmoid, ipo, sigmoid_norm"),
        ([("objective", "kto")], "must be one of sft, dpo"),
        ([("objective", "dpo"), ("chunked_loss", "on")], "--chunked-loss on sums a next-token loss"),
        ([("objective", "dpo"), ("chunked_loss", "300")], "drop --chunked-loss"),
    ],
)
def test_bad_dpo_options(keys, words):
    with pytest.raises(MeshlmError) as e:
        config_mod.load(None, keys)
    assert words in str(e.value)


def test_planner_counts_the_reference_as_the_layout_shards_parameters():
    from meshlm.plan.job import Job
    from meshlm.plan.memory import memory
    from meshlm.plan.shape import StageShape
    from meshlm.plan.spec import load_model

    spec = load_model("llama-7b")
    stage = StageShape(spec.layers, first=True, last=True, in_flight=1, tp=1)

    def states(strategy, n, **job):
        return memory(spec, Job(**job), stage, strategy, 8, n, 1, False, False).states

    full = states("single", 1, objective="dpo")["reference"]  # bf16 autocast over fp32 parameters: fp32
    assert full == 4 * stage.params(spec) and states("ddp", 1, objective="dpo")["reference"] == full
    assert states("zero3", 4, objective="dpo", precision="fp32")["reference"] == full // 4
    assert states("zero3", 4, objective="dpo")["reference"] == full // 8  # bf16 shards: what FSDP gathers
    assert states("zero2", 4, objective="dpo")["reference"] == full // 2  # bf16 zero2: a whole bf16 copy
    assert "reference" not in states("zero3", 4, objective="dpo", lora_r=16)  # the base, adapters off
    assert "reference" not in states("zero3", 4, objective="dpo", precompute_reference=True)
    assert "reference" not in states("zero3", 4)


def test_dpo_chunked_loss_auto_keeps_whole_logits_and_on_is_refused_by_the_planner_too():
    from meshlm.plan.activations import loss_chunk
    from meshlm.plan.job import Job
    from meshlm.plan.shape import StageShape
    from meshlm.plan.spec import load_model

    for setting in ("auto", "off"):  # accepted: train and plan keep the whole logits under dpo
        config_mod.load(None, [("objective", "dpo"), ("chunked_loss", setting)])
    spec = load_model("llama-7b")
    stage = StageShape(spec.layers, first=True, last=True, in_flight=1, tp=1)
    assert loss_chunk(spec, Job(chunked_loss="on"), stage, 4096) > 0
    assert loss_chunk(spec, Job(objective="dpo"), stage, 1 << 16) == 0  # sft's auto would chunk these
    assert loss_chunk(spec, Job(), stage, 1 << 16) > 0
    with pytest.raises(MeshlmError, match="drop --chunked-loss"):
        Job(objective="dpo", chunked_loss="on").check(spec, 8)


def test_plan_objective_dpo_prints_the_reference_and_the_command(capsys):
    import json

    from meshlm import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--model", "llama-7b", "--gpus-per-node", "8", "--objective", "dpo", "--json"])
    assert e.value.code == 0
    plan = json.loads(capsys.readouterr().out)
    best = plan["layouts"][0]
    assert (
        best["strategy"] == "zero3" and best["states"]["reference"] == best["states"]["parameters"] // 2
    )  # bf16 shards
    assert plan["recommendation"]["command"].endswith("--objective dpo")


def test_dpo_with_cp_and_pp_is_planned_and_verified(capsys):
    """cp x pp runs under dpo (the last stage adds each document's log-probabilities over its cp group): the command
    `plan --objective dpo --cp 2 --pp 2` prints resolves as meshlm train resolves it, and verify runs pp+cp."""
    import json
    import shlex

    from meshlm import cli, verify
    from meshlm.layout import resolve
    from meshlm.models.build import model_config

    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--gpus-per-node", "4", "--objective", "dpo", "--cp", "2", "--pp", "2", "--json"])
    assert e.value.code == 0
    command = shlex.split(json.loads(capsys.readouterr().out)["recommendation"]["command"])
    assert command[:4] == ["meshlm", "train", "--nproc", "4"]
    cfg = config_mod.load(None, config_mod.parse_args(command[4:]))
    assert (cfg.objective, cfg.parallel.cp, cfg.parallel.pp) == ("dpo", 2, 2)
    layout = resolve(cfg, 4, model_config(cfg))
    assert (layout.cp, layout.pp) == (2, 2)
    tiny = config_mod.load(None, [*config_mod.parse_args(verify.PRESETS["tiny"]), ("objective", "dpo")])
    (case,) = [c for c in verify.layouts(4, 0) if c.name == "pp+cp"]
    assert verify.unavailable(case, tiny, 8) == ""


def test_plan_simulate_says_a_dpo_step_is_not_simulated(capsys):
    """The simulation runs the engine's sft step (no pairs, no reference forward): under --objective dpo it would
    compare an sft step with a DPO plan (model states 3.13 simulated vs 3.52 planned MiB), so it says so."""
    from meshlm import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--model", "tiny", "--gpus-per-node", "2", "--objective", "dpo", "--simulate"])
    assert e.value.code == 0
    assert "not simulated: the simulation runs sft steps: --objective dpo" in capsys.readouterr().out
