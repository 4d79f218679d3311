"""Abstract TPU devices of a slice topology, for compiling with the real TPU compiler on any machine.

With libtpu installed (`pip install 'shardtrain[tpu]'`), `jax.experimental.topologies` describes a
TPU slice without a TPU: its devices are compile-only, so a program lowered on a mesh of them and
compiled gets the TPU compiler's own memory analysis, collectives and cost model. Nothing runs and
nothing is allocated. Several slices (multi-slice over DCN) carry a `slice_index` each, which
`mesh.make_mesh` uses to place the `mesh.dcn` axes across slices.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import math
import os

from shardtrain.config import ConfigError
from shardtrain.plan.chips import Chip


def tpu_present() -> bool:
    """Whether this machine has TPU chips (their device files), without initialising a backend."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


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


@functools.cache
def devices(chip: Chip, topology: str, slices: int = 1) -> tuple:
    """The compile-only devices of `slices` slices of `topology` chips of `chip` (a TPU)."""
    if chip.tpu_name is None:
        raise ConfigError(f"topology {topology}: chip '{chip.name}' is not a TPU; a topology needs one of v4, v5e, "
                          "v5p, v6e (GPUs and cpu plan on the devices present)")
    if importlib.util.find_spec("libtpu") is None:
        raise ConfigError(f"planning for TPU {chip.name} {topology} compiles with the TPU compiler, which needs "
                          "libtpu: pip install 'shardtrain[tpu]' (or plan on the devices present: omit "
                          "--topology and hardware.topology)")
    quiet_libtpu()
    from jax.experimental import topologies

    name = f"{chip.tpu_name}:{topology}"
    try:
        kwargs = {"num_slices": slices} if slices > 1 else {}
        found = topologies.get_topology_desc(topology_name=name, platform="tpu", **kwargs).devices
    except Exception as e:  # libtpu rejects the shape: say which and why, in one line
        reason = str(e).strip().splitlines()[0][:200]
        raise ConfigError(f"hardware.topology={topology}: libtpu has no {chip.name} topology '{name}' ({reason}); "
                          f"use the chips per dimension of a real {chip.name} slice") from None
    if len(found) != chip_count(topology, slices):
        raise ConfigError(f"hardware.topology={topology}: libtpu made {len(found)} devices, expected "
                          f"{chip_count(topology, slices)}")
    return tuple(found)
