"""meshlm: train and run large language models across many GPUs and nodes.

Importing it drops, at their source, the import-time log lines of optional libraries that tell a meshlm user
nothing. With torchao installed (meshlm[float8], and the dev extras), transformers imports it in every process,
and its import logs two lines about optional C++ kernels it could not load (mxfp8, SM90 cutlass: built
for another Python or GPU; meshlm's float8 does not use them) and torch logs a deprecation aimed at
torchao's own code. With bitsandbytes installed, `import peft` (every LoRA run) imports it, and on CPUs with
AVX512-BF16 it logs that its CPU 4-bit kernels (from the `kernels` package) could not load: meshlm's NF4 is
torchao's and never calls them. A user's mistake must read as one `meshlm: error:` line, and a run's console as
meshlm's, so these records are filtered on their own loggers, by message, and nothing else is.
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"

# logger -> the beginnings (or fragments) of the messages dropped from it
NOISE = {
    "torchao": ("Failed to load ",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward",),
}


class _Drop(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(f in str(record.msg) for f in self.fragments)


def _install_filters() -> None:
    """Idempotent: each logger gets one filter however often meshlm is imported."""
    for name, fragments in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(fragments))


_install_filters()  # before anything imports transformers (and with it torchao)
