"""The planner's parameters per tensor-parallel rank against what meshlm's TP really places on a rank: the
coverage table's tiny models (benchmarks/families.py) split by apply_tp and apply_experts over 2 gloo ranks,
and StageShape.params for the same model at tp 2. Multi-head latent attention keeps its latents (q_a_proj,
kv_a_proj_with_mqa) whole on every rank, as do routers; "all split" is the planner counting every block matrix
split, as it did before ModelSpec.layer_whole_matmul.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/tp_params.py deepseek_v3 minicpm3
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
import torch.distributed as dist
import transformers
from families import tiny
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from meshlm.parallel.expert import apply_experts
from meshlm.parallel.tensor import apply_tp
from meshlm.plan.shape import StageShape
from meshlm.plan.spec import from_hf_config


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if dist.get_rank() == 0:
        print("| family | held by rank 0 | planner | planner, all split |\n|---|---|---|---|")
    for kind in sys.argv[1:]:
        config = tiny(kind)
        spec = from_hf_config(kind, config)
        stage = StageShape(layers=config.num_hidden_layers, first=True, last=True, in_flight=1, tp=mesh.size())
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        apply_tp(model, mesh)
        apply_experts(model, mesh, mesh)
        held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
        if dist.get_rank() == 0:
            all_split = stage.params(replace(spec, layer_whole_matmul=0))
            print(f"| {kind} | {held:,} | {stage.params(spec):,} | {all_split:,} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
