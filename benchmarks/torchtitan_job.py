"""torchtitan's side of peer_torchtitan.py: the config function its trainer loads
(`torchrun -m torchtitan.train --module torchtitan_job --config peer_job`, with benchmarks/ on PYTHONPATH).

It makes no decision of its own: peer_torchtitan.options() writes every setting as JSON into
MESHLM_PEER_JOB, and this file applies them to torchtitan's Llama 3 configs (torchtitan 0.3.0:
models/llama3/config_registry.py and models/llama3/__init__.py). Runs under torchtitan's python only.
"""

from __future__ import annotations

import json
import os
from functools import partial


def _model_spec(job: dict):
    """torchtitan's llama3 flavor with the job's body, its vocabulary replaced by the job's (untied, as meshlm's)."""
    import torch.nn as nn
    from torchtitan.models.llama3 import model_registry

    spec = model_registry(job["flavor"], attn_backend=job["attn_backend"])
    model = spec.model
    block = model.layers[0]
    body = {
        "dim": model.dim,
        "n_layers": len(model.layers),
        "n_heads": block.attention.n_heads,
        "n_kv_heads": block.attention.n_kv_heads or block.attention.n_heads,
        "hidden_dim": block.feed_forward.w1.out_features,
    }
    if body != job["body"]:
        raise ValueError(f"torchtitan_job: flavor {job['flavor']} is {body}, the job needs {job['body']}")
    model.vocab_size = model.tok_embeddings.num_embeddings = model.lm_head.out_features = job["vocab_size"]
    model.enable_weight_tying = job["tied"]
    if not job["tied"]:  # the 1B flavor skips the embedding's init because it ties it to the head
        model.tok_embeddings.param_init = {"weight": partial(nn.init.normal_, std=1.0)}
    return spec


def peer_job():
    """The Trainer.Config of the job in MESHLM_PEER_JOB."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.validate import Validator
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.trainer import Trainer

    job = json.loads(os.environ["MESHLM_PEER_JOB"])
    vocab = job["vocab_size"]
    return Trainer.Config(
        model_spec=_model_spec(job),
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab)),
        hf_assets_path=job["tokenizer_dir"],
        dump_folder=job["dump_folder"],
        optimizer=default_adamw(lr=job["lr"]),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=job["warmup_steps"]),
        training=TrainingConfig(
            local_batch_size=job["local_batch_size"],
            seq_len=job["seq_len"],
            steps=job["steps"],
            mixed_precision_param=job["mixed_precision_param"],
        ),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=job["dataset_dir"]),
        metrics=MetricsProcessor.Config(log_freq=job["log_freq"], disable_color_printing=True),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=FullAC.Config() if job["ac"] == "full" else None,
        compile=CompileConfig(enable=job["compile"], components=["model", "loss"]),
        validator=Validator.Config(enable=False),
    )
