"""The chip table (shardtrain/chips.py) and how the planner applies it: device kinds name their chips, a
host-wide entry is divided among the simulated devices, --memory-limit is per device."""

import jax
import pytest

from shardtrain import chips, config
from shardtrain.plan import planner


def test_device_kinds_name_their_chips():
    assert chips.for_device_kind("TPU v5 lite").name == "v5e"
    assert chips.for_device_kind("TPU v5p").name == "v5p"
    assert chips.for_device_kind("NVIDIA H100 80GB HBM3").name == "h100"
    assert chips.for_device_kind("cpu") is None


def test_the_host_wide_cpu_entry_is_shared_by_the_simulated_devices():
    cpu, h100 = chips.CHIPS["cpu"], chips.CHIPS["h100"]
    per_device = planner.per_device(cpu, 8)
    assert (per_device.peak_flops, per_device.hbm_bytes, per_device.hbm_bandwidth) == pytest.approx(
        (cpu.peak_flops / 8, 1 * 2 ** 30, cpu.hbm_bandwidth / 8))  # 8 GiB of host memory among 8
    assert planner.per_device(h100, 8) == h100


def test_memory_limit_is_per_device_and_unknown_chips_are_config_errors():
    devices = jax.devices()
    assert planner.per_device(planner.pick_chip("cpu", devices, memory_limit=1000), 8).hbm_bytes == 1000
    assert planner.pick_chip("v5e", devices, memory_limit=1000).hbm_bytes == 1000
    assert planner.pick_chip(None, devices).name == "cpu"  # the devices present: simulated CPUs
    with pytest.raises(config.ConfigError, match="--chip: unknown chip 'tpu9'; known: v4, v5e"):
        planner.pick_chip("tpu9", devices)
