"""One rank of `meshlm train`, started by torchrun, with its resident memory recorded per phase.

    python -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/rss_phases.py OUT_DIR train ARGS

(`python benchmarks/peak_memory.py --profile JOB` runs this and prints the table.) A thread samples the RSS
(/proc/self/statm) every 3 ms, and it is sampled again at every boundary; each sample counts for the phase the
rank is in: start-up (until the first forward), `<unit> forward` (from the unit's forward on; units are FSDP's,
or the decoder blocks and the model where nothing is FSDP), `<unit> backward` (from the gradient of the unit's
output on), `optimizer step`, `between steps` (logging, zero_grad). Each rank writes OUT_DIR/rank-R.json:
phase -> peak bytes, in the order the phases first occurred (the maximum over every step).
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import sys
import threading
import time
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


class MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2 (malloc.h), all size_t
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def _mallinfo():
    """glibc's mallinfo2, or None: where the RSS of a peak is (the heap in use and free, mmapped blocks)."""
    try:
        f = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    f.restype = MallInfo2
    return f


class Phases:
    def __init__(self):
        self.phase, self.peaks, self.lock = "start-up", {}, threading.Lock()
        self.heap, self.mallinfo = {}, _mallinfo()  # phase -> glibc's split of the RSS at its peak

    def sample(self) -> None:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * PAGE
        with self.lock:
            if rss > self.peaks.get(self.phase, 0):
                self.peaks[self.phase] = rss
                if self.mallinfo is not None:
                    m = self.mallinfo()
                    self.heap[self.phase] = {"heap used": m.uordblks, "heap free": m.fordblks, "mmapped": m.hblkhd}

    def enter(self, phase: str) -> None:
        self.sample()  # the end of the phase before
        with self.lock:
            self.phase = phase
        self.sample()

    def keep_sampling(self, every: float = 0.003) -> None:
        while True:
            self.sample()
            time.sleep(every)


def install(phases: Phases) -> None:
    """Global module and optimizer hooks that move `phases` along."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from meshlm.compat import tree_leaves

    names: dict[int, str] = {}  # id(module) -> its name in the model, filled at the model's first forward
    fsdp = []  # [True] when the model has FSDP units

    def unit(module) -> bool:
        return (
            isinstance(module, FSDPModule)
            if fsdp[0]
            else type(module).__name__.endswith(("DecoderLayer", "ForCausalLM"))
        )

    def pre_forward(module, args):
        if not names and type(module).__name__.endswith("ForCausalLM"):
            names.update({id(m): n or "model" for n, m in module.named_modules()})
            fsdp.append(any(isinstance(m, FSDPModule) for m in module.modules()))
        if names and unit(module):
            phases.enter(f"{names.get(id(module), type(module).__name__)} forward")

    def post_forward(module, args, output):
        if not (names and unit(module) and torch.is_grad_enabled()):
            return
        out = next((t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad), None)
        if out is not None:
            name = names.get(id(module), type(module).__name__)
            out.register_hook(lambda grad: phases.enter(f"{name} backward"))

    torch.nn.modules.module.register_module_forward_pre_hook(pre_forward)
    torch.nn.modules.module.register_module_forward_hook(post_forward)
    register_optimizer_step_pre_hook(lambda *a: phases.enter("optimizer step"))
    register_optimizer_step_post_hook(lambda *a: phases.enter("between steps"))


def main() -> int:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    phases = Phases()
    threading.Thread(target=phases.keep_sampling, daemon=True).start()
    install(phases)

    def write() -> None:
        phases.sample()
        out.mkdir(parents=True, exist_ok=True)
        rank = os.environ.get("RANK", "0")
        (out / f"rank-{rank}.json").write_text(json.dumps(phases.peaks, indent=1))
        (out / f"rank-{rank}.heap.json").write_text(json.dumps(phases.heap, indent=1))

    atexit.register(write)
    from meshlm import runtime
    from meshlm.cli import main as meshlm

    leave = runtime.leave_rank  # a finished rank leaves with os._exit, past atexit: write first
    runtime.leave_rank = lambda status: (write(), leave(status))
    return meshlm(argv)


if __name__ == "__main__":
    sys.exit(main())
