"""float8 training through torchao (--float8 tensorwise|rowwise): the model's Linear layers compute their
matmuls in float8 with dynamic scales (torchao's `convert_to_float8_training`, as torchtitan does it).

Converted on the meta device before any other technique wraps the model, so FSDP shards Float8Linear
modules (tensorwise: FSDP's all-gather also in float8, `enable_fsdp_float8_all_gather`) and each rank fills
its part as usual. Left in their precision: the output
head (the logits' precision matters most) and any Linear whose dimensions are not multiples of 16
(float8 matmuls need them). Needs CUDA with compute capability 8.9 or newer (Ada, Hopper, Blackwell);
anything else is refused in one line.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from meshlm.errors import MeshlmError

RECIPES = ("off", "tensorwise", "rowwise")


def refusal(recipe: str, device: torch.device, tp: int, pp: int) -> str:
    """Why --float8 `recipe` cannot run here ("" when it can)."""
    if recipe == "off":
        return ""
    if device.type != "cuda":
        return f"--float8 {recipe} needs a CUDA GPU with compute capability 8.9 or newer; these ranks run on CPU"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"--float8 {recipe} needs compute capability 8.9 or newer (Ada, Hopper); this GPU has {major}.{minor}"
    if importlib.util.find_spec("torchao") is None:
        return f"--float8 {recipe} needs torchao: pip install torchao"
    if tp > 1 or pp > 1:
        return f"--float8 {recipe} runs under single, ddp and FSDP layouts for now; drop --parallel.tp/--parallel.pp"
    return ""


def converts(module: nn.Module, name: str) -> bool:
    """The Linear layers float8 computes: not the output head, dimensions multiples of 16."""
    if not isinstance(module, nn.Linear) or name.split(".")[-1] == "lm_head":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert(model: nn.Module, recipe: str, fsdp: bool, emulate: bool = False) -> int:
    """Swap the Linear layers `converts` picks for torchao's Float8Linear; returns how many.

    emulate: torchao's emulated float8 matmuls (tests on CPU: the same casts and scales, no float8 kernels).
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    changes = {"emulate": emulate, "enable_fsdp_float8_all_gather": fsdp and recipe == "tensorwise"}
    config = type(config)(**{**config.__dict__, **changes})
    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, module_filter_fn=converts, config=config)
    return before - sum(type(m) is nn.Linear for m in model.modules())


def check(recipe: str, device: torch.device, tp: int, pp: int) -> None:
    why = refusal(recipe, device, tp, pp)
    if why:
        raise MeshlmError(why)
