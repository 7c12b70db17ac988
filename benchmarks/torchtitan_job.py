"""torchtitan's side of peer_torchtitan.py, for torchtitan 0.2.2 (the newest release that imports on torch 2.11:
0.3.0 imports torch.distributed.fsdp.DataParallelMeshDims, which 2.11 lacks).

It makes no decision of its own: peer_torchtitan.options() writes every setting, command_line() turns them
into torchtitan's own options, and torchtitan's trainer imports this module (`--experimental.custom_import`)
with the settings as JSON in MESHLM_PEER_JOB: the import registers a train spec, llama3's with one flavor
holding the job's body and vocabulary (untied, as meshlm's; torchtitan 0.2.2's llama3 has no 1B flavor).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

SPEC = "meshlm_peer"
FLAVOR = "peer"


def command_line(job: dict) -> list[str]:
    """torchtitan.train's options for the settings `job` (torchtitan 0.2.2's JobConfig, read by tyro)."""
    return [
        *["--experimental.custom_import", "torchtitan_job", "--model.name", SPEC, "--model.flavor", FLAVOR],
        *["--model.hf_assets_path", job["tokenizer_dir"], "--job.dump_folder", job["dump_folder"]],
        *["--optimizer.lr", str(job["lr"]), "--lr_scheduler.warmup_steps", str(job["warmup_steps"])],
        *["--training.local_batch_size", str(job["local_batch_size"]), "--training.seq_len", str(job["seq_len"])],
        *["--training.steps", str(job["steps"]), "--training.mixed_precision_param", job["mixed_precision_param"]],
        *["--training.dataset", "c4_test", "--training.dataset_path", job["dataset_dir"]],
        *["--metrics.log_freq", str(job["log_freq"]), "--metrics.disable_color_printing"],
        *["--activation_checkpoint.mode", job["ac"]],
        *(["--compile.enable"] if job["compile"] else []),
    ]


def register(job: dict) -> None:
    """llama3's train spec with the one flavor `job` describes, under SPEC."""
    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

    body = job["body"]
    args = TransformerModelArgs(
        dim=body["dim"],
        n_layers=body["n_layers"],
        n_heads=body["n_heads"],
        n_kv_heads=body["n_kv_heads"],
        vocab_size=job["vocab_size"],
        # the MLP width is 8/3 x dim rounded up to a multiple of multiple_of: the job's width when that is the
        # multiple (the logged parameter count, checked by peer_torchtitan.compare, shows any other outcome)
        multiple_of=body["hidden_dim"],
        rope_theta=500000,
        attn_type=job["attn_backend"],
        attn_mask_type="block_causal",  # attention inside each packed document, as meshlm's flex and varlen
    )
    register_train_spec(SPEC, dataclasses.replace(get_train_spec("llama3"), model_args={FLAVOR: args}))


if "torchtitan" in sys.modules:  # imported by torchtitan's trainer, not by peer_torchtitan.py
    register(json.loads(os.environ["MESHLM_PEER_JOB"]))
