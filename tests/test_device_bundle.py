"""bench/device_bundle.py's choice of what travels to a lent GPU machine: what the path imports and the image
lacks, at constraints.txt's versions, never the image's own JAX, NumPy, transformers or tokenizers."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("device_bundle", REPO / "bench" / "device_bundle.py")
device_bundle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(device_bundle)


def test_ships_what_the_image_lacks_at_the_pinned_versions():
    pins = device_bundle.read_constraints(REPO / "constraints.txt")
    shipped = dict(device_bundle.to_ship(pins))
    for name in ("levanter", "haliax", "draccus", "ray", "tensorboardX", "jmp"):
        assert shipped[name] == pins[device_bundle.canonical(name)][1]
    keys = {device_bundle.canonical(n) for n in shipped}
    for image_has in ("jax", "jaxlib", "numpy", "torch", "transformers", "tokenizers", "optax", "equinox"):
        assert image_has not in keys
    assert not keys & device_bundle.IMAGE_PACKAGES


def test_a_needed_package_without_a_pin_is_named(tmp_path):
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("levanter==1.0\n")
    with pytest.raises(SystemExit, match="not pinned in constraints.txt: .*haliax"):
        device_bundle.to_ship(device_bundle.read_constraints(constraints))


def test_a_line_that_is_not_a_pin_is_refused_with_its_line_number(tmp_path):
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("# pins\nray==2.60.0\nlevanter>=1.0\n")
    with pytest.raises(SystemExit, match=r"constraints.txt:3: 'levanter>=1.0' is not name==version"):
        device_bundle.read_constraints(constraints)
