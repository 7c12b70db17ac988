"""Every numeric and path option declares its domain beside its field in config.py, and the check applies it."""

from __future__ import annotations

import pytest

from meshlm import config
from meshlm.errors import MeshlmError


def test_every_number_and_path_option_declares_its_domain():
    keys = config.flat_keys()
    undeclared = [k for k, (typ, f) in keys.items() if typ in (int, float) and "domain" not in f.metadata]
    assert not undeclared, f"declare domain= beside these fields in config.py: {undeclared}"
    assert keys["output_dir"][1].metadata["domain"].on_disk


@pytest.mark.parametrize("key", [k for k, (typ, _) in config.flat_keys().items() if typ is float])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_no_float_option_takes_nan_or_infinity(key, value):
    with pytest.raises(MeshlmError, match=f"^--{key.replace('_', '-')} .*, got {value}$"):
        config.load(None, [(key, value)])


def test_defaults_are_inside_their_domains_and_read():
    config.load(None, [])
