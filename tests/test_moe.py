"""Mixture-of-experts models (Qwen3-MoE, Mixtral) under every layout equal one process, in fp32 over 3 steps:
losses (which include the router's load-balancing loss) within 1e-4 relative, the aux loss itself within 1e-4,
and the router's tokens per expert and layer exactly the reference's.

Tiny random models from transformers' own config classes (router_aux_loss_coef 0.02 so the aux loss weighs on
the router), saved with save_pretrained, which writes the per-expert layout transformers converts on load.
Every layout of a world size runs in one launch (tests/helpers/family_runs.py: one process start-up per world
size); the one-process references run in one more. The aux loss is what transformers computes for one forward:
a pipeline forwards its micro-batches one at a time, so its reference accumulates the same micro-batches.

Also here, on the same launches: --pretrained reads transformers' per-expert checkpoint per shard (zero3 2)
with the first loss equal to transformers' own on the same batch (1e-5); export writes transformers'
per-expert layout back, which it loads with the trained model's logits (1e-5); and checkpoints reshard, each
resumed run with the uninterrupted run's losses: the ep 2 run's step-2 checkpoint resumes under zero3 2 and in
one process, zero3 2's under ep 2 and one process's under ep 2 x fsdp 2 (the reverse); and a chain of layouts:
ep 2's step-1 checkpoint resumes under zero3 2, which saves step 2, which resumes in one process. The launches
run in the order these need: 2 ranks, 1, 4.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from meshlm.data.builtin import byte_tokenizer
from uneven_data import uneven_records

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "tests" / "helpers" / "family_runs.py"
SMALL = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    output_router_logits=True,
    router_aux_loss_coef=0.02,
    tie_word_embeddings=False,
    initializer_range=0.1,
)
FAMILIES = {
    "mixtral": lambda vocab: MixtralConfig(
        vocab_size=vocab, **SMALL, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2
    ),
    "qwen3_moe": lambda vocab: Qwen3MoeConfig(
        vocab_size=vocab,
        **SMALL,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        head_dim=8,
        norm_topk_prob=True,
    ),
}
COMMON = [
    "--seq-length", "32", "--builtin-samples", "64", "--loss-on", "all", "--max-steps", "3", "--progress", "false",
    "--log-every", "1", "--save-final", "false", "--dropout-off", "true", "--warmup-steps", "1", "--lr", "0.01",
]  # fmt: skip
GLOBAL_BATCH, PIPELINE_MICRO = 8, 4
UNEVEN = ["--dataset-name", "{uneven}"]  # tests/uneven_data.py's records (written into the runs' directory)
# layout -> (ranks, options, reference): the options keep the global batch at 8 sequences
SAVE_2 = ["--ckpt-every", "2"]  # a checkpoint at step 2 (the last step, 3, is not saved): resumed elsewhere
LAYOUTS = {
    "zero3-2": (2, ["--strategy", "zero3", "--micro-batch-size", "4", "--save-final", "true", *SAVE_2], "ref"),
    "tp-2": (2, ["--parallel.tp", "2", "--micro-batch-size", "8"], "ref"),
    "pp-2": (2, ["--parallel.pp", "2", "--micro-batch-size", "8", "--parallel.micro-batches", "4"], "ref-pp"),
    "ep-2": (2, ["--parallel.ep", "2", "--micro-batch-size", "4", "--ckpt-every", "1"], "ref"),
    "ep-2-fsdp-2": (4, ["--parallel.ep", "2", "--micro-batch-size", "2"], "ref"),
    "ep-2-tp-2": (4, ["--parallel.ep", "2", "--parallel.tp", "2", "--micro-batch-size", "4"], "ref"),
    "ep-2-hsdp-2x2": (4, ["--strategy", "hsdp", "--parallel.shard-size", "2", "--parallel.ep", "2",
                          "--micro-batch-size", "2"], "ref"),
    "ep-2-pp-2": (4, ["--parallel.ep", "2", "--parallel.pp", "2", "--micro-batch-size", "4", "--parallel.micro-batches",
                      "4"], "ref-pp"),
    # each sequence split over 2 cp ranks (ulysses), each routing its own tokens: packed uneven records
    "ep-2-cp-2": (4, ["--parallel.ep", "2", "--parallel.cp", "2", "--micro-batch-size", "4", *UNEVEN], "ref-uneven"),
}  # fmt: skip
LORA = ["--lora.r", "4"]  # the family's default targets: attention (and Qwen3-MoE's dense MLPs, where it has some)
# and on the experts' grouped weights too (peft's target_parameters); saved at the end, for the adapters and export
LORA_EXPERTS = ["--lora.r", "4", "--lora.targets", "q_proj,v_proj,gate_up_proj,down_proj", "--save-final", "true"]
ONE_FAMILY = {"tp-2-sp": (2, ["--parallel.tp", "2", "--parallel.sequence-parallel", "true", "--micro-batch-size", "8"],
                          "ref"),
              "lora-ep-2": (2, [*LORA, "--parallel.ep", "2", "--micro-batch-size", "4"], "lora-ref"),
              "ep-4": (4, ["--parallel.ep", "4", "--micro-batch-size", "2"], "ref"),
              "lora-experts-zero3-2": (2, [*LORA_EXPERTS, "--strategy", "zero3", "--micro-batch-size", "4"],
                                       "lora-experts-ref"),
              "lora-experts-ep-2": (2, [*LORA_EXPERTS, "--parallel.ep", "2", "--micro-batch-size", "4"],
                                    "lora-experts-ref"),
              "lora-experts-ep-2-fsdp-2": (4, [*LORA_EXPERTS, "--parallel.ep", "2", "--micro-batch-size", "2"],
                                           "lora-experts-ref"),
              "lora-experts-tp-2": (2, [*LORA_EXPERTS, "--parallel.tp", "2", "--micro-batch-size", "8"],
                                    "lora-experts-ref"),
              "lora-experts-ep-2-tp-2": (4, [*LORA_EXPERTS, "--parallel.ep", "2", "--parallel.tp", "2",
                                             "--micro-batch-size", "4"], "lora-experts-ref"),
              "lora-experts-pp-2": (2, [*LORA_EXPERTS, "--parallel.pp", "2", "--micro-batch-size", "8",
                                        "--parallel.micro-batches", "4"], "lora-experts-ref-pp")}  # fmt: skip
REFERENCES = {
    "ref": ["--micro-batch-size", "8", *SAVE_2],  # its step 2 resumes under ep 2 x fsdp 2
    "ref-pp": ["--micro-batch-size", "2", "--grad-accum", "4"],  # the pipeline's 4 forwards of 2 sequences
    "ref-uneven": ["--micro-batch-size", "8", *UNEVEN],
}
# resumed in the output directory of the run that saved the step: (ranks, that run, options)
RESUMES = {
    "ep-2 -> zero3-2": (2, "ep-2", ["--strategy", "zero3", "--micro-batch-size", "4"]),
    "ep-2 -> single": (1, "ep-2", ["--micro-batch-size", "8"]),
    "zero3-2 -> ep-2": (2, "zero3-2-step-2", ["--parallel.ep", "2", "--micro-batch-size", "4"]),
    "single -> ep-2-fsdp-2": (4, "ref-step-2", ["--parallel.ep", "2", "--micro-batch-size", "2"]),
    # the chain: ep 2 -> zero3 2 (from step 1; saves step 2) -> one process (step 3), in one directory
    "chain: ep-2 -> zero3-2": (2, "chain", ["--strategy", "zero3", "--micro-batch-size", "4", *SAVE_2]),
    "chain: ep-2 -> zero3-2 -> single": (1, "chain", ["--micro-batch-size", "8"]),
}
# run directories made of another run's checkpoint (family_runs' copy_checkpoint), before the resumes: (ranks, from
# run, its step): the zero3 run also saves its last step (exported below), so its step 2 is resumed from a copy
COPIES = {"zero3-2-step-2": (2, "zero3-2", 2), "chain": (2, "ep-2", 1), "ref-step-2": (4, "ref", 2)}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root, tok = tmp_path_factory.mktemp("moe-models"), byte_tokenizer()
    dirs = {}
    for kind, make in FAMILIES.items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(make((len(tok) + 63) // 64 * 64)).save_pretrained(root / kind)
        tok.save_pretrained(root / kind)
        dirs[kind] = root / kind
    return dirs


def _launch(nproc: int, cases: list[dict], work: Path) -> dict:
    """Every case in one launch of `nproc` ranks (one process without a launcher for 1)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "cases.json").write_text(json.dumps({"cases": cases}))
    ranks = ["--nproc", str(nproc)] if nproc > 1 else []  # the ranks forked from one process that imported meshlm
    cmd = [sys.executable, str(RUNS), *ranks, str(work / "cases.json"), str(work / "out.json")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env={"OMP_NUM_THREADS": "1", **_env()})
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads((work / "out.json").read_text())


def _env() -> dict:
    import os

    return dict(os.environ)


def _case(kind: str, name: str, models, work: Path, options: list[str], out: str = "", **extra) -> dict:
    out_dir = work / (out or f"{kind}-{name}")
    options = [str(uneven_records(work)) if o == "{uneven}" else o for o in options]
    args = [*COMMON, "--model-name", str(models[kind]), "--output-dir", str(out_dir), *options]
    return {"id": f"{kind}/{name}", "kind": "train", "args": args, **extra}


def _layout_cases(ranks: int, models, work: Path) -> list[dict]:
    cases = [_case(k, n, models, work, opts) for k in FAMILIES for n, (r, opts, _) in LAYOUTS.items() if r == ranks]
    cases += [_case("mixtral", n, models, work, opts) for n, (r, opts, _) in ONE_FAMILY.items() if r == ranks]
    return cases


def _resume_cases(ranks: int, models, work: Path) -> list[dict]:
    copies = [
        {"id": f"copy/{name}", "kind": "copy_checkpoint",
         "args": {"src": str(work / f"mixtral-{src}"), "step": step, "dst": str(work / f"mixtral-{name}")}}
        for name, (r, src, step) in COPIES.items()
        if r == ranks
    ]  # fmt: skip
    return copies + [
        _case("mixtral", name, models, work, opts, out=f"mixtral-{saved}")
        for name, (r, saved, opts) in RESUMES.items()
        if r == ranks
    ]


# the final adapters' largest difference from one process's, over how far those moved (a missed update: 1);
# observed 5.2e-4 (zero3 2), 5.6e-4 (ep 2), 3.6e-4 (ep 2 x fsdp 2), 1.19e-3 (tp 2), 1.27e-3 (ep 2 x tp 2): all in
# one element (layers.1 down_proj lora_A[69]) whose step-2 gradient nearly cancels, 4.85e-9 in one process, 4.83e-9
# under ep 2, 4.80e-9 under tp 2 (the tensor's largest 3.7e-3), so near AdamW's eps (1e-8) the summation order's
# rounding moves its update g / (|g| + eps); a missed update or a wrong expert slice differs by 1
ADAPTER_DIFF = 2e-3
PROBE = [[5, 17, 33, 60, 71, 90, 101, 7]]  # token ids whose logits the exported model must reproduce


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("moe-runs")


@pytest.fixture(scope="module")
def world2(models, work) -> dict:
    cases = _layout_cases(2, models, work)
    for case in cases:
        if case["id"].endswith(("/zero3-2", "/lora-experts-ep-2")):  # they save their last step: exported below
            case["logits"] = PROBE
    first = ["--strategy", "zero3", "--micro-batch-size", "2", "--pretrained", "true", "--max-steps", "1"]
    cases += [_case(k, "pretrained", models, work, first) for k in FAMILIES]  # per-shard per-expert reads
    cases.append(_generate("tp", models, work))
    cases.append(_generate("tp", models, work, checkpoint=work / "mixtral-lora-experts-ep-2"))  # saved above
    return _launch(2, cases + _resume_cases(2, models, work), work / "launch-2")


@pytest.fixture(scope="module")
def world4(models, work, references) -> dict:
    return _launch(4, _layout_cases(4, models, work) + _resume_cases(4, models, work), work / "launch-4")


def _generate(mode: str, models, work: Path, checkpoint: Path | None = None) -> dict:
    """Greedy decoding of a few prompts by the qwen3_moe model (whole experts per rank under tp), or by a
    checkpoint's model (a LoRA run's: its adapters merged)."""
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("2 + 2 =", "reverse: abc", "x")))
    name = f"{mode}-{checkpoint.name}" if checkpoint else mode
    args = {"prompts": str(prompts), "out": str(work / f"generate-{name}.jsonl"), "mode": mode}
    model = (
        {"checkpoint": str(checkpoint), "model_name": ""} if checkpoint else {"model_name": str(models["qwen3_moe"])}
    )
    return {"id": f"generate/{name}", "kind": "generate", "args": {**args, **model, "max_new_tokens": 8}}


@pytest.fixture(scope="module")
def references(models, work, world2) -> dict:
    cases = [_case(k, name, models, work, opts) for k in FAMILIES for name, opts in REFERENCES.items()]
    cases.append(_case("mixtral", "lora-ref", models, work, ["--micro-batch-size", "8", *LORA]))
    cases.append(_case("mixtral", "lora-experts-ref", models, work, ["--micro-batch-size", "8", *LORA_EXPERTS]))
    cases.append(_case("mixtral", "lora-experts-ref-pp", models, work, [*REFERENCES["ref-pp"], *LORA_EXPERTS]))
    cases.append(_generate("dp", models, work))
    cases.append(_generate("dp", models, work, checkpoint=work / "mixtral-lora-experts-ep-2"))
    return _launch(1, cases + _resume_cases(1, models, work), work / "launch-1")


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == 3, (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _check(got: dict, ref: dict) -> None:
    assert "error" not in got, got
    assert _rel(got["losses"], ref["losses"]) <= 1e-4
    assert _rel(got["aux_losses"], ref["aux_losses"]) <= 1e-4
    assert got["router_tokens"] == ref["router_tokens"]
    assert _rel(got["grad_norms"], ref["grad_norms"]) <= 1e-3


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("layout", [k for k, v in LAYOUTS.items() if v[0] == 2])
def test_two_rank_layouts_equal_one_process(references, world2, kind, layout):
    _check(world2[f"{kind}/{layout}"], references[f"{kind}/{LAYOUTS[layout][2]}"])


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("layout", [k for k, v in LAYOUTS.items() if v[0] == 4])
def test_four_rank_expert_parallel_compositions_equal_one_process(references, world4, kind, layout):
    _check(world4[f"{kind}/{layout}"], references[f"{kind}/{LAYOUTS[layout][2]}"])


def test_generate_tp_gives_one_process_tokens(references, world2):
    assert "error" not in world2["generate/tp"], world2["generate/tp"]
    assert world2["generate/tp"]["tokens"] == references["generate/dp"]["tokens"]
    assert all(references["generate/dp"]["tokens"])  # something was generated


def test_generate_tp_from_a_lora_on_experts_checkpoint_gives_one_process_tokens(references, world2):
    """tp splits experts whole, and peft merges an expert adapter only whole: the model is read whole, merged,
    then split (infer/load.py per_shard)."""
    got, want = world2["generate/tp-mixtral-lora-experts-ep-2"], references["generate/dp-mixtral-lora-experts-ep-2"]
    assert "error" not in got and "error" not in want, (got, want)
    assert got["tokens"] == want["tokens"] and all(want["tokens"])


def test_sequence_parallel_moe_block_equals_one_process(references, world2):
    _check(world2["mixtral/tp-2-sp"], references["mixtral/ref"])


def test_one_expert_per_rank_equals_one_process(references, world4):
    """ep 4 on 4 experts."""
    _check(world4["mixtral/ep-4"], references["mixtral/ref"])
    assert world4["mixtral/ep-4"]["expert_state_bytes"] * 4 == references["mixtral/ref"]["expert_state_bytes"]


def test_lora_on_attention_under_expert_parallel_equals_one_process(references, world2):
    _check(world2["mixtral/lora-ep-2"], references["mixtral/lora-ref"])


# the steps in a resumed run's metrics.jsonl: its directory's rows up to the resumed step (a copied checkpoint
# brings none), then its own
LOGGED = {"ep-2 -> zero3-2": 3, "ep-2 -> single": 3, "zero3-2 -> ep-2": 1, "single -> ep-2-fsdp-2": 1,
          "chain: ep-2 -> zero3-2": 2, "chain: ep-2 -> zero3-2 -> single": 2}  # fmt: skip


@pytest.mark.parametrize("layout", [k for k in ONE_FAMILY if k.startswith("lora-experts-")])
def test_lora_on_experts_equals_one_process(references, world2, world4, work, layout):
    """Adapters on attention and on every expert's weights (an r-wide slice of peft's A and B per expert), under
    zero3, pp and ep, where each rank runs its experts' slices (ep 2 x fsdp 2: two ranks hold each expert, and
    FSDP's average over all four adds their slices; under tp the TP ranks split the experts and their slices'
    gradients are summed over tp): the losses, and the final adapters against how far one process moved them
    (verify.param_diff: a missed update differs by 1, however small the tensor)."""
    from meshlm.verify import _read_params, param_diff

    ref = ONE_FAMILY[layout][2]
    _check({**world2, **world4}[f"mixtral/{layout}"], references[f"mixtral/{ref}"])
    want, got = (_read_params(work / f"mixtral-{run}", 3) for run in (ref, layout))
    assert {k for k in want if "experts" in k} == {
        f"model.layers.{i}.mlp.experts.{wrapper}lora_{ab}.default.weight"
        for i in range(2) for wrapper in ("", "base_layer.") for ab in "AB"
    }  # fmt: skip
    for k, v in want.items():  # every adapter trained (A from step 2: B starts at zero)
        assert (v - _initial_adapter(k, v)).abs().max() >= 1e-3, k
    diff, problem = param_diff(want, got, _initial_adapter)
    assert not problem and diff <= ADAPTER_DIFF, (diff, problem)


# what rank 0 holds under each LoRA-on-experts run: (strategy as the planner names it, FSDP shard, tp, ep, layers)
PLANNED_ADAPTERS = {"lora-experts-ref": ("single", 1, 1, 1, 2), "lora-experts-zero3-2": ("zero3", 2, 1, 1, 2),
                    "lora-experts-ep-2": ("zero3", 2, 1, 2, 2), "lora-experts-ep-2-fsdp-2": ("zero3", 4, 1, 2, 2),
                    "lora-experts-tp-2": ("ddp", 1, 2, 1, 2), "lora-experts-ep-2-tp-2": ("zero3", 2, 2, 2, 2),
                    "lora-experts-pp-2": ("ddp", 1, 1, 1, 1)}  # fmt: skip


def test_the_planner_counts_expert_adapters_per_rank(models, references, world2, world4):
    """plan/lora_memory.py lora_states with --lora.targets naming the experts' weights: rank 0's adapters, their
    gradients and AdamW states (the metrics row: local shards) byte for byte, in every layout above (the expert
    adapters are whole in their block, sharded by FSDP over every data-parallel rank, not split by tp)."""
    from transformers import AutoConfig

    from meshlm.plan.lora_memory import expert_adapter_params, lora_states
    from meshlm.plan.shape import StageShape
    from meshlm.plan.spec import from_hf_config

    spec = from_hf_config("mixtral", AutoConfig.from_pretrained(models["mixtral"]))
    targets = tuple(LORA_EXPERTS[LORA_EXPERTS.index("--lora.targets") + 1].split(","))
    assert expert_adapter_params(spec, 4, targets, 2) == 2 * 4 * 4 * (32 + 64 + 32 + 32)  # layers x E x r x (in+out)
    runs = {**world2, **world4, **references}
    for layout, (strategy, shard, tp, ep, layers) in PLANNED_ADAPTERS.items():
        stage = StageShape(layers, True, layers == 2, 1, tp, ep=ep)
        want = lora_states(spec, stage, strategy, shard, 4, 4, targets)
        row = runs[f"mixtral/{layout}"]
        got = {"adapters": row["adapter_bytes"], "gradients": row["grad_bytes"], "optimizer": row["optim_bytes"]}
        assert got == {k: want[k] for k in got}, (layout, got, want)


def _initial_adapter(name: str, like: torch.Tensor) -> torch.Tensor:
    from meshlm.config import Config
    from meshlm.parallel.lora import initial_value

    return initial_value(name, like, Config().seed)


@pytest.mark.parametrize("resume", RESUMES)
def test_checkpoints_reshard_between_expert_parallel_and_other_layouts(references, world2, world4, resume):
    """The resumed run's steps (up to the third) have the uninterrupted reference's losses; in the chain, the one
    process's step 3 follows zero3 2's step 2, which followed ep 2's step 1."""
    got = {**world2, **references, **world4}[f"mixtral/{resume}"]
    assert "error" not in got, got
    want = references["mixtral/ref"]["losses"][-LOGGED[resume] :]
    assert len(got["losses"]) == len(want), (got["losses"], want)
    assert max(abs(a - b) / b for a, b in zip(got["losses"], want)) <= 1e-4, (got["losses"], want)


def test_each_rank_holds_its_share_of_the_experts(references, world2, world4):
    """Expert weights, gradients and AdamW states of the largest rank: ep 2 and zero3 2 half of one process's,
    ep 2 x fsdp 2 a quarter, ep 2 x cp 2 a quarter (the cp ranks shard the experts), ep 2 under hsdp 2 x 2
    (replicated twice) a half; only a dispatching layout spends
    time in all-to-all."""
    for kind in FAMILIES:
        whole = references[f"{kind}/ref"]["expert_state_bytes"]
        assert whole == 16 * 2 * 4 * 3 * 32 * 32  # bytes x layers x experts x (gate, up, down) x hidden x width
        shares = {"ep-2": 2, "zero3-2": 2, "ep-2-tp-2": 4, "ep-2-fsdp-2": 4, "ep-2-hsdp-2x2": 2, "ep-2-cp-2": 4}
        for layout, share in shares.items():
            assert {**world2, **world4}[f"{kind}/{layout}"]["expert_state_bytes"] * share == whole, layout
        assert world2[f"{kind}/ep-2"]["all_to_all_s"] > 0 and world2[f"{kind}/zero3-2"]["all_to_all_s"] == 0


def test_the_aux_loss_is_in_the_loss(references):
    """The reference itself: aux loss near its floor (top-k: about k) and the logged loss moves with it."""
    for kind in FAMILIES:
        ref = references[f"{kind}/ref"]
        assert all(1.5 < a < 4 for a in ref["aux_losses"]), ref["aux_losses"]
        assert sum(sum(layer) for layer in ref["router_tokens"][0]) == 2 * GLOBAL_BATCH * 32 * 2  # layers x rows x k


def test_expert_and_context_parallel_steps_hold_documents_crossing_the_cp_boundary(models, work):
    """What ep 2 x cp 2 (above, against one process) trained on: in each of its 3 global batches of 8 packed
    blocks a document runs across token 16, where cp 2 cuts the sequence, and the blocks' target counts differ."""
    from helpers.data import load_blocks
    from meshlm import config as config_mod
    from meshlm.data.batch import IGNORE
    from meshlm.data.sampler import ResumableSampler
    from meshlm.models.build import load_tokenizer

    keys = [("model_name", str(models["mixtral"])), ("seq_length", "32"), ("dataset_name", str(uneven_records(work)))]
    cfg = config_mod.load(None, [*keys, ("loss_on", "all")])
    blocks = load_blocks(cfg, *load_tokenizer(cfg))
    sampler = ResumableSampler(len(blocks), 1, 0, shuffle=True, seed=cfg.seed, batch_size=GLOBAL_BATCH)
    for _, indices in zip(range(3), sampler):
        batch = blocks.batch(indices)
        assert (batch.positions[:, 16] > 0).any(), indices
        assert len({int((row != IGNORE).sum()) for row in batch.labels}) > 1


def _first_batch_loss(model_dir: Path) -> float:
    """transformers' loss (token mean + coef x aux_loss) on the first global batch meshlm draws."""
    from helpers.data import load_blocks
    from meshlm import config as config_mod
    from meshlm.data.sampler import ResumableSampler
    from meshlm.models.build import load_tokenizer
    from meshlm.parallel.loss import token_loss_sum

    keys = [("model_name", str(model_dir)), ("seq_length", "32"), ("builtin_samples", "64"), ("loss_on", "all")]
    cfg = config_mod.load(None, keys)
    tok, tok_id = load_tokenizer(cfg)
    blocks = load_blocks(cfg, tok, tok_id)
    sampler = ResumableSampler(len(blocks), 1, 0, shuffle=True, seed=cfg.seed, batch_size=4)
    b = blocks.batch(next(iter(sampler))).to("cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model(input_ids=b.ids, position_ids=b.positions, use_cache=False, output_router_logits=True)
        return (token_loss_sum(out.logits, b.labels) / b.targets()).item() + 0.02 * out.aux_loss.item()


@pytest.mark.parametrize("kind", FAMILIES)
def test_pretrained_reads_transformers_per_expert_files_per_shard(models, world2, kind):
    from safetensors import safe_open

    with safe_open(str(models[kind] / "model.safetensors"), "pt") as f:
        assert any(".experts.0." in k for k in f.keys())  # per expert, as transformers saves them
    got = world2[f"{kind}/pretrained"]
    assert "error" not in got, got
    want = _first_batch_loss(models[kind])
    assert abs(got["losses"][0] - want) / want <= 1e-5, (got["losses"][0], want)


@pytest.mark.parametrize("kind", FAMILIES)
def test_export_writes_transformers_layout_with_the_trained_logits(world2, work, kind, tmp_path):
    from safetensors import safe_open

    from meshlm.train.export import export

    out = export(str(work / f"{kind}-zero3-2"), str(tmp_path / "hf"))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert not any("gate_up_proj" in n for n in names) and any(".experts.3." in n for n in names)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROBE), use_cache=False).logits
    torch.testing.assert_close(logits, torch.tensor(world2[f"{kind}/zero3-2"]["logits"]), rtol=1e-5, atol=1e-5)


def test_export_of_expert_adapters_gives_the_trained_logits(world2, work, tmp_path):
    """The ep 2 run's adapters on attention and experts: merged into transformers' model, and alone as the
    adapter directory peft loads onto the base (target_parameters), both with the trained model's logits."""
    from peft import PeftModel

    from meshlm import config as config_mod
    from meshlm.models.build import build_model, load_tokenizer
    from meshlm.models.materialize import InitialWeights, materialize
    from meshlm.train.export import export

    run = work / "mixtral-lora-experts-ep-2"
    merged, adapter = (
        export(str(run), str(tmp_path / "merged")),
        export(str(run), str(tmp_path / "a"), adapter_only=True),
    )
    cfg = config_mod.load(str(run / "config.toml"))
    base = build_model(cfg, load_tokenizer(cfg)[0], "meta")  # the base as training built it: the name-seeded init
    materialize(base, InitialWeights.of(base, cfg.seed), "cpu")
    ids, want = torch.tensor(PROBE), torch.tensor(world2["mixtral/lora-experts-ep-2"]["logits"])
    with torch.no_grad():
        untrained = base.eval()(input_ids=ids, use_cache=False).logits
        got = {
            "merged": AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(input_ids=ids).logits,
            "adapter": PeftModel.from_pretrained(base, adapter).eval()(input_ids=ids, use_cache=False).logits,
        }
    assert not torch.allclose(want, untrained, atol=1e-3)  # the adapters changed the model
    for how, logits in got.items():
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5, msg=lambda m, how=how: f"{how}: {m}")
