"""Writes bitsandbytes_nf4.safetensors: bitsandbytes' CPU NF4 (blocks of 64, compressed statistics) of
tests/unit/test_nf4.py's weight, so that the comparison with an independent implementation runs where bitsandbytes
is not installed (importing it costs every LoRA process a CPU second: peft imports it). Run where it is:

    python tests/data/make_bitsandbytes_nf4.py

Holds the packed codes (two a byte, high nibble first), each block's absmax as bitsandbytes decodes it and its code
table: its dequantised weight is table[code] x absmax, exactly (dequantize_4bit's own output, checked here).
"""

from pathlib import Path

import bitsandbytes
import torch
from bitsandbytes import functional
from safetensors.torch import save_file

OUT = Path(__file__).with_name("bitsandbytes_nf4.safetensors")


def weight(rows=512, cols=256, seed=0) -> torch.Tensor:
    """tests/unit/test_nf4.py's _weight."""
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.02


def main() -> None:
    w = weight()
    packed, state = functional.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    absmax = functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    flat = packed.flatten()
    codes = torch.stack([(flat >> 4).long(), (flat & 15).long()], -1).flatten()
    values = (state.code[codes].view(-1, 64) * absmax[:, None]).view(w.shape)
    assert torch.equal(values, functional.dequantize_4bit(packed, state))
    tensors = {"packed": flat.contiguous(), "absmax": absmax.float().contiguous(), "table": state.code.float()}
    save_file(tensors, OUT, metadata={"bitsandbytes": bitsandbytes.__version__})
    print(f"wrote {OUT} (bitsandbytes {bitsandbytes.__version__})")


if __name__ == "__main__":
    main()
