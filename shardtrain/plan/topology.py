"""Compile-only devices of a TPU slice or of GPU nodes, for compiling with the target's own compiler
on any machine.

`jax.experimental.topologies` describes hardware that is not here: its devices are compile-only, so
a program lowered on a mesh of them and compiled gets that compiler's own memory analysis and
collectives. Nothing runs and nothing is allocated.

- TPUs (`pip install 'shardtrain[tpu]'`, libtpu): a slice topology such as "4x4x8"; several slices
  (multi-slice over DCN) carry a `slice_index` each.
- NVIDIA GPUs (`pip install 'shardtrain[gpu]'`, jax's CUDA plugin, whose XLA:GPU compiles without a
  GPU): "NODESxGPUS" nodes of GPUs per node, the chip described by its `GpuTarget`; each node's
  devices carry its `process_index`.

`mesh.make_mesh` places the `mesh.dcn` axes across slices (TPU) or nodes (GPU).
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import math
import os

from shardtrain.chips import Chip
from shardtrain.config import ConfigError


def tpu_present() -> bool:
    """Whether this machine has TPU chips (their device files), without initialising a backend."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def gpu_present() -> bool:
    """Whether this machine has NVIDIA GPUs (their device files), without initialising a backend."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def cuda_plugin_installed() -> bool:
    return any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def quiet_libtpu() -> None:
    """Without a TPU, libtpu asks the (absent) TPU VM metadata for the accelerator type and worker
    hostnames when it loads and prints warnings; naming them here is harmless: a compile-only
    topology does not use them. Left alone on a TPU VM, where they are real."""
    if not tpu_present():
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu's lockfile


def chip_count(topology: str, slices: int = 1) -> int:
    """Chips of `slices` slices of a topology such as "16x16" or "4x4x8"."""
    return math.prod(int(s) for s in topology.split("x")) * slices


def gpu_nodes(topology: str) -> tuple[int, int]:
    """(nodes, GPUs per node) of a GPU topology "NODESxGPUS"."""
    nodes, per_node = (int(s) for s in topology.split("x"))
    return nodes, per_node


def wraparound(topology: str) -> tuple[bool, bool, bool]:
    """Which dimensions of a TPU slice close into a ring, as Cloud TPU wires them: a 3D (v4, v5p) slice
    whose every dimension is a multiple of 4 is a torus; in a 2D (v5e, v6e) slice a dimension of 16
    chips wraps. libtpu's default is no wraparound, and on a mesh without it the TPU compiler writes
    every large gather as a zero-padded all-reduce (twice the traffic)."""
    dims = [int(s) for s in topology.split("x")]
    if len(dims) == 3:
        return (all(d % 4 == 0 for d in dims),) * 3
    return (dims[0] == 16, dims[1] == 16, False)


@functools.cache
def devices(chip: Chip, topology: str, slices: int = 1) -> tuple:
    """The compile-only devices of `slices` slices of `topology` chips of `chip` (a TPU), or of
    `topology` = "NODESxGPUS" GPUs of `chip` (a GPU)."""
    if chip.gpu is not None:
        return gpu_devices(chip, topology)
    if chip.tpu_name is None:
        raise ConfigError(f"topology {topology}: chip '{chip.name}' is neither a TPU nor a GPU; a topology needs "
                          "one of v4, v5e, v5p, v6e, tpu7x, a100, h100, h200, b200 (cpu plans on the devices present)")
    if importlib.util.find_spec("libtpu") is None:
        raise ConfigError(f"planning for TPU {chip.name} {topology} compiles with the TPU compiler, which needs "
                          "libtpu: pip install 'shardtrain[tpu]' (or plan on the devices present: omit "
                          "--topology and hardware.topology)")
    quiet_libtpu()
    from jax.experimental import topologies

    name = f"{chip.tpu_name}:{topology}"
    try:
        kwargs = {"num_slices": slices} if slices > 1 else {}
        found = topologies.get_topology_desc(topology_name=name, platform="tpu", wrap=wraparound(topology),
                                             **kwargs).devices
    except Exception as e:  # libtpu rejects the shape: say which and why, in one line
        reason = str(e).strip().splitlines()[0][:200]
        raise ConfigError(f"hardware.topology={topology}: libtpu has no {chip.name} topology '{name}' ({reason}); "
                          f"use the chips per dimension of a real {chip.name} slice") from None
    if len(found) != chip_count(topology, slices) * chip.devices_per_chip:
        raise ConfigError(f"hardware.topology={topology}: libtpu made {len(found)} devices, expected "
                          f"{chip_count(topology, slices) * chip.devices_per_chip}")
    return tuple(found)


def gpu_devices(chip: Chip, topology: str) -> tuple:
    """Compile-only GPUs of `chip`, "NODESxGPUS" of them, for XLA:GPU (no GPU needed)."""
    if not cuda_plugin_installed():
        raise ConfigError(f"planning for {chip.name} GPUs compiles with XLA:GPU, which needs jax's CUDA plugin: "
                          "pip install 'shardtrain[gpu]' (or plan on the devices present: hardware.chip=cpu)")
    from jax.experimental import topologies

    nodes, per_node = gpu_nodes(topology)
    found = topologies.get_topology_desc(platform="cuda", topology=f"1x{nodes}x{per_node}",
                                         target_config=chip.gpu.target_config(chip.hbm_bandwidth)).devices
    return tuple(found)
