"""Compile-only TPU devices of a slice topology (plan/topology.py, libtpu) and the one-line errors
for topologies that do not exist."""

import jax
import pytest

from shardtrain import chips, config
from shardtrain.plan import planner, topology


def test_chip_count_is_the_product_of_the_dimensions_times_the_slices():
    assert topology.chip_count("16x16") == 256 and topology.chip_count("4x4x8", 2) == 256


def test_topology_mistakes_are_one_line_config_errors():
    with pytest.raises(config.ConfigError, match="hardware.topology=16x16: needs hardware.chip to name a TPU"):
        config.load(None, ["hardware.chip=cpu", "hardware.topology=16x16"])
    with pytest.raises(config.ConfigError, match="hardware.chip: unknown chip 'v5x'"):
        config.load(None, ["hardware.chip=v5x"])
    with pytest.raises(config.ConfigError, match="expected chips per dimension"):
        config.load(None, ["hardware.chip=v5e", "hardware.topology=16x"])
    with pytest.raises(config.ConfigError, match=r"mesh.dcn: its product 2 must equal hardware.slices=1"):
        planner.hardware(config.load(None, ["hardware.chip=v5p", "hardware.topology=2x2x1", "mesh.dcn.data=2"]))
    with pytest.raises(config.ConfigError, match="libtpu has no v5e topology 'v5e:3x7'"):
        topology.devices(chips.CHIPS["v5e"], "3x7")


def test_missing_libtpu_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(topology.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(config.ConfigError, match=r"pip install 'shardtrain\[tpu\]'"):
        topology.devices(chips.CHIPS["v6e"], "2x2")


def test_topology_devices_are_the_slices_chips():
    devices = topology.devices(chips.CHIPS["v5p"], "2x2x1", 2)
    assert len(devices) == 8 and {d.platform for d in devices} == {"tpu"}
    assert sorted({d.slice_index for d in devices}) == [0, 1]
    assert jax.devices()[0].platform == "cpu"  # the tests' own devices are untouched
