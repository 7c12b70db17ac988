"""float8 training through torchao (--float8 tensorwise|rowwise): the model's Linear layers compute their
matmuls in float8 with dynamic scales (torchao's `convert_to_float8_training`, as torchtitan does it).

Converted on the meta device before any other technique wraps the model (as torchtitan's model converters),
so every layout composes with it:
- FSDP shards Float8Linear modules (tensorwise: FSDP's all-gather also in float8,
  `enable_fsdp_float8_all_gather`) and each rank fills its part as usual;
- a pipeline splits the converted model: each stage keeps its own Float8Linear layers;
- tensor parallel splits their weights as usual; under tensorwise its column- and row-wise layers take
  torchao's float8 styles (`tp_styles`: the input cast to float8 and the gradient cast in backward on the
  DTensor, as torchtitan's float8 TP); rowwise keeps torch's styles (torchao has no rowwise TP styles), and
  its row-wise layers' activation scales are then per row of each rank's slice.
Left in their precision: the output head (the logits' precision matters most) and any Linear whose
dimensions, or their shards under tensor parallel, are not multiples of 16 (float8 matmuls need them).
GPUs need compute capability 8.9 or newer (Ada, Hopper, Blackwell). CPU ranks run torch's CPU float8 matmul
(torch._scaled_mm): the same casts and scales, for checking a recipe's numerics; it is slower than fp32.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from meshlm import compat
from meshlm.errors import MeshlmError


def refusal(recipe: str, device: torch.device, sequence_parallel: bool = False) -> str:
    """Why --float8 `recipe` cannot run on `device` ("" when it can). sequence_parallel: tensor parallel with
    --parallel.sequence-parallel, whose tensorwise float8 styles all-gather float8 tensors (NCCL can, gloo not)."""
    if recipe == "off":
        return ""
    if importlib.util.find_spec("torchao") is None:
        return f"--float8 {recipe} needs torchao: pip install 'meshlm[float8]'"
    if device.type != "cuda":
        if recipe == "tensorwise" and sequence_parallel:
            return (
                "--float8 tensorwise with --parallel.sequence-parallel all-gathers float8 tensors, which gloo "
                "(CPU ranks) cannot: use --float8 rowwise or drop --parallel.sequence-parallel"
            )
        if recipe == "rowwise" and not compat.cpu_rowwise_float8():
            return (
                f"--float8 rowwise on CPU ranks needs torch 2.13 or newer: torch {torch.__version__}'s CPU float8 "
                "matmul takes one scale per tensor; use --float8 tensorwise"
            )
        return ""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"--float8 {recipe} needs compute capability 8.9 or newer (Ada, Hopper); this GPU has {major}.{minor}"
    return ""


def check(recipe: str, device: torch.device, sequence_parallel: bool = False) -> None:
    why = refusal(recipe, device, sequence_parallel)
    if why:
        raise MeshlmError(why)


def check_model(recipe: str, model_config) -> None:
    """Before any rank starts: the model has Linear layers for float8 to compute."""
    from meshlm.models.families import family

    if recipe != "off" and family(model_config).conv1d:
        raise MeshlmError(
            f"--float8 {recipe} computes torch's Linear layers; {model_config.model_type}'s projections are "
            f"transformers' Conv1D: drop --float8"
        )


def converts(module: nn.Module, name: str, tp: int = 1) -> bool:
    """The Linear layers float8 computes: not the output head, dimensions (each rank's shard under tensor
    parallel of `tp`) multiples of 16."""
    if not isinstance(module, nn.Linear) or name.split(".")[-1] == "lm_head":
        return False
    return module.in_features % (16 * tp) == 0 and module.out_features % (16 * tp) == 0


def convert(model: nn.Module, recipe: str, fsdp: bool, tp: int = 1) -> int:
    """Swap the Linear layers `converts` picks for torchao's Float8Linear; returns how many."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    config = type(config)(**{**config.__dict__, "enable_fsdp_float8_all_gather": fsdp and recipe == "tensorwise"})
    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, module_filter_fn=lambda m, n: converts(m, n, tp), config=config)
    return before - sum(type(m) is nn.Linear for m in model.modules())


def tensorwise(module: nn.Module) -> bool:
    """A Float8Linear with tensorwise (dynamic) scales: the layers torchao's float8 TP styles take."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    return (
        isinstance(module, Float8Linear)
        and module.config.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE
    )


class PerModuleStyle(ParallelStyle):
    """A plan entry that splits each module it matches with torchao's float8 style where the module is a
    tensorwise Float8Linear and with torch's style otherwise (a pattern may match both)."""

    def __init__(self, plain: ParallelStyle, float8: type[ParallelStyle]):
        super().__init__()
        self.plain, self.float8 = plain, float8.__new__(float8)
        self.float8.__dict__.update(plain.__dict__)  # the same layouts and local-output choice

    def _apply(self, module: nn.Module, device_mesh):
        style = self.float8 if tensorwise(module) else self.plain
        style.src_data_rank = self.src_data_rank  # parallelize_module sets it on the plan's entry
        return style._apply(module, device_mesh)


def tp_styles(plan: dict) -> dict:
    """`plan` (pattern -> torch ParallelStyle) with torchao's Float8ColwiseParallel / Float8RowwiseParallel (the
    same split) for the tensorwise Float8Linear layers its plain column- and row-wise entries match."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    float8 = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}
    return {k: PerModuleStyle(s, float8[type(s)]) if type(s) in float8 else s for k, s in plan.items()}
