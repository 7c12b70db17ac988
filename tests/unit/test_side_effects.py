"""Process-wide settings meshlm changes for its own ranks are put back for a program that uses meshlm as a
library (docs/ARCHITECTURE.md lists each one and why): the launcher's environment and torchelastic's logging,
deterministic kernels, datasets' and transformers' progress bars, the hub client's verbosity."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from meshlm import launch, runtime
from meshlm.errors import MeshlmError


def test_the_launchers_environment_and_logging_are_the_ranks_only(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("MESHLM_LAUNCHED", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    elastic = logging.getLogger("torch.distributed.elastic")
    before = elastic.propagate, list(elastic.handlers)
    with launch._for_the_ranks(3, tmp_path / "launcher.log"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # as rendezvous.pin_gloo does inside
        assert (os.environ["OMP_NUM_THREADS"], os.environ["MESHLM_LAUNCHED"]) == ("3", "1")
        assert not elastic.propagate and len(elastic.handlers) == 2
    assert os.environ["OMP_NUM_THREADS"] == "7"
    assert "MESHLM_LAUNCHED" not in os.environ and "GLOO_SOCKET_IFNAME" not in os.environ
    assert (elastic.propagate, list(elastic.handlers)) == before


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_deterministic_kernels_only_while_training(device):
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    with runtime.deterministic_on_cpu(torch.device(device)):
        assert torch.are_deterministic_algorithms_enabled() == (device == "cpu" or before[0])
    assert (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    ) == before


def test_progress_bars_and_hub_verbosity_are_put_back(tmp_path):
    import datasets
    import transformers.utils.logging as tf_logging
    from huggingface_hub.utils import logging as hub_logging

    from meshlm.infer import prompts
    from meshlm.models import source
    from meshlm.plan import spec

    datasets.enable_progress_bars()
    tf_logging.enable_progress_bar()
    with prompts._no_progress_bars(datasets), source._no_progress_bar():
        assert not datasets.is_progress_bar_enabled() and not tf_logging.is_progress_bar_enabled()
    assert datasets.is_progress_bar_enabled() and tf_logging.is_progress_bar_enabled()
    verbosity = hub_logging.get_verbosity()
    with pytest.raises(MeshlmError):  # a directory without a config.json: read locally, no network
        spec.load_model(str(tmp_path))
    assert hub_logging.get_verbosity() == verbosity
