"""The planner's inputs. The ZeRO paper's Table 1 (Rajbhandari et al. 2019): a 7.5B-parameter model on 64
data-parallel GPUs with mixed-precision Adam holds 120 GB (ddp), 31.4 GB (zero1), 16.6 GB (zero2) and 1.88 GB
(zero3) of model states per GPU. `meshlm plan --params 7.5B` states that case; the plan must give the paper's
numbers within 1%."""

from __future__ import annotations

import json

import pytest

from meshlm.cli import main

PAPER_GB = {"ddp": 120, "zero1": 31.4, "zero2": 16.6, "zero3": 1.88}


def test_plan_reproduces_zero_table_1(capsys):
    with pytest.raises(SystemExit) as done:
        main(
            [
                "plan",
                "--model-name",
                "llama-7b",
                "--params",
                "7.5B",
                "--nodes",
                "8",
                "--gpus-per-node",
                "8",
                "--mixed-precision",
                "bf16",
                "--optimizer",
                "adamw",
                "--parallel.tp",
                "1",
                "--parallel.pp",
                "1",
                "--dp",
                "64",
                "--strategy",
                "ddp,zero1,zero2,zero3",
                "--activation-checkpointing",
                "none",
                "--all",
                "--json",
            ]
        )
    assert done.value.code in (0, None)
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["params"] == 7_500_000_000
    states = {e["layout"]: sum(e["states"].values()) / 1e9 for e in data["layouts"] if not e["offload"]}
    assert set(states) == set(PAPER_GB)
    for name, paper in PAPER_GB.items():
        assert states[name] == pytest.approx(paper, rel=0.01), (name, states[name], paper)


def test_params_is_read_as_a_count(capsys):
    with pytest.raises(SystemExit) as bad:
        main(["plan", "--params", "seven billion"])
    assert bad.value.code == 2
    assert capsys.readouterr().err.strip().startswith("meshlm: error: --params: cannot read")


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--model-name", "llama-7b", "--gpus-per-node", "6", "--parallel.tp", "3"],
            "--parallel.tp 3 does not divide the model's 32 attention heads",
        ),
        (
            ["--model-name", "gpt2", "--nodes", "2", "--parallel.pp", "16"],
            "--parallel.pp 16 is more than gpt2's 12 blocks",
        ),
        (
            ["--model-name", "llama-7b", "--nodes", "2", "--parallel.tp", "4", "--parallel.pp", "2", "--dp", "3"],
            "= 24 GPUs, but the cluster has 16",
        ),
        (["--model-name", "llama-7b", "--params", "7.5B", "--simulate"], "--simulate builds the model with meshlm"),
        (
            ["--model-name", "llama-7b", "--lora.r", "16", "--lora.quantize", "nf4", "--simulate"],
            "which torchao's NF4Tensor does not support",
        ),
    ],
)
def test_layouts_that_cannot_split_the_model(args, message, capsys):
    with pytest.raises(SystemExit) as bad:
        main(["plan", *args])
    assert bad.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize(
    "family,args,message",
    [
        ("t5", [], "meshlm builds causal language models (transformers' AutoModelForCausalLM), and a t5 model"),
        ("opt", ["--parallel.pp", "2"], "pipeline parallel needs the layer list of model family 'opt'"),
        ("opt", ["--parallel.tp", "2"], "tensor parallel needs a TP plan for model family 'opt'"),
    ],
)
def test_simulate_refuses_a_model_meshlm_cannot_build(family, args, message, tmp_path, capsys):
    """--simulate with a family meshlm cannot build (or cannot split this way): one line, exit 2."""
    from transformers import OPTConfig, T5Config

    dims = dict(vocab_size=256, num_attention_heads=4, max_position_embeddings=128)
    if family == "t5":
        T5Config(vocab_size=256, d_model=64, d_ff=128, num_layers=2, num_heads=4).save_pretrained(tmp_path)
    else:
        OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, word_embed_proj_dim=64, **dims).save_pretrained(
            tmp_path
        )
    with pytest.raises(SystemExit) as bad:
        main(
            ["plan", "--model-name", str(tmp_path), "--gpus-per-node", "4", "--strategy", "zero3", *args, "--simulate"]
        )
    assert bad.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
