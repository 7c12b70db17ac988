"""The end-to-end check is every one-line-error test under tests/: with torchao installed (the dev extras) they
failed on its import noise before meshlm/__init__.py filtered it
(CI of 944200e: test_lora, test_model_parallel, test_verify, ...)."""

import logging
import subprocess
import sys

import pytest

import meshlm  # noqa: F401  (installs the filters)


def test_only_the_named_import_noise_is_dropped(caplog):
    caplog.set_level(logging.DEBUG)
    logging.getLogger("torchao").warning("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
    logging.getLogger("torchao").warning("float8 recipe rowwise needs a newer torch")
    logging.getLogger("torch.utils._pytree").warning(
        "%s is an Enum subclass and is now natively supported by torch.compile", "KernelPreference"
    )
    logging.getLogger("torch.utils._pytree").warning("some other pytree warning")
    cpu_ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
    cpu_ops.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please ...", "No module")
    cpu_ops.warning("some other bitsandbytes warning")
    assert [r.getMessage() for r in caplog.records] == [
        "float8 recipe rowwise needs a newer torch",
        "some other pytree warning",
        "some other bitsandbytes warning",
    ]


def test_a_lora_run_with_bitsandbytes_installed_prints_nothing_of_it(tmp_path):
    """peft imports bitsandbytes wherever it is installed (the dev extras install it): a LoRA run's stderr holds
    none of its import-time lines."""
    pytest.importorskip("bitsandbytes")
    code = "import meshlm, peft, sys; assert 'bitsandbytes' in sys.modules"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stderr == "", p.stderr
