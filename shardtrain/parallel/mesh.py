"""The device mesh from the mesh config: axis sizes, -1 resolution, hybrid ICI x DCN placement."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from shardtrain.config import MESH_AXES, ConfigError, MeshConfig


def resolve_sizes(cfg: MeshConfig, n_devices: int) -> dict[str, int]:
    """Axis -> total size (ici x dcn), with -1 resolved; checks the product against the devices."""
    sizes = cfg.sizes()
    known = math.prod(s for s in sizes.values() if s > 0)
    shown = ", ".join(f"{a}={getattr(cfg, a)}" for a in MESH_AXES)
    for axis, size in sizes.items():
        if size < 0:
            if n_devices % known:
                raise ConfigError(f"mesh ({shown}): the fixed axes use {known} devices, which does not "
                                  f"divide the {n_devices} devices present; change the mesh sizes")
            sizes[axis] = n_devices // known
    if math.prod(sizes.values()) != n_devices:
        raise ConfigError(f"mesh ({shown}) needs {math.prod(sizes.values())} devices but {n_devices} are "
                          f"present; make the product of {', '.join(f'mesh.{a}' for a in MESH_AXES)} "
                          f"(x mesh.dcn) equal {n_devices}, or set one axis to -1")
    return sizes


def granule(device) -> int:
    """What the `mesh.dcn` axes run across: a TPU's slice, any other device's host (GPU node). A
    compile-only TPU topology of one slice has no slice_index (its hosts are not slices)."""
    if device.platform == "tpu":
        return getattr(device, "slice_index", 0)
    return device.process_index


def cross_granule_axes(mesh: Mesh) -> set[str]:
    """The mesh axes along which devices sit in different slices / hosts (costed at DCN bandwidth)."""
    grid = np.vectorize(granule, otypes=[int])(mesh.devices)
    return {a for i, a in enumerate(mesh.axis_names) if grid.shape[i] > 1 and (np.diff(grid, axis=i) != 0).any()}


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """Builds the mesh over `devices` (default: all devices of all processes), axes in MESH_AXES
    order with Auto axis types (classic GSPMD: jit shardings + sharding constraints)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_sizes(cfg, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    dcn = tuple(getattr(cfg.dcn, a) for a in MESH_AXES)
    n_granules = len({granule(d) for d in devices})
    if math.prod(dcn) > 1 and n_granules > 1:
        if math.prod(dcn) != n_granules:
            raise ConfigError(f"mesh.dcn: product {math.prod(dcn)} must equal the number of slices/hosts "
                              f"({n_granules})")
        ici = tuple(s // d for s, d in zip(shape, dcn))
        by_process = devices[0].platform != "tpu" or not hasattr(devices[0], "slice_index")
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=by_process)
    else:
        # One granule (or simulated devices): a plain mesh of the combined shape.
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True) \
            if devices[0].platform == "tpu" else np.array(devices).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
