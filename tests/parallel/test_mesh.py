"""mesh.py: axis sizes from the mesh config (-1 takes the rest, the product must match the devices,
ici x dcn), and the Mesh over the devices in MESH_AXES order."""

import jax
import numpy as np
import pytest

from shardtrain import config
from shardtrain.config import MESH_AXES, ConfigError
from shardtrain.parallel import mesh as mesh_lib


def test_mesh_product_must_match_devices():
    with pytest.raises(ConfigError, match="needs 12 devices but 8 are present"):
        mesh_lib.make_mesh(config.MeshConfig(data=3, fsdp=2, tensor=2))
    with pytest.raises(ConfigError, match="does not divide the 8 devices"):
        mesh_lib.make_mesh(config.MeshConfig(data=-1, tensor=3))


def test_minus_one_takes_the_rest():
    mesh = mesh_lib.make_mesh(config.MeshConfig(data=-1, tensor=2))
    assert dict(mesh.shape) == {"data": 4, "pipeline": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 2}
    assert mesh_lib.make_mesh(config.MeshConfig(), devices=jax.devices()[:1]).size == 1


def test_dcn_multiplies_the_ici_size_of_its_axis():
    cfg = config.MeshConfig(data=1, fsdp=-1, tensor=2, dcn=config.DcnConfig(data=2))
    assert mesh_lib.resolve_sizes(cfg, 16) == {"data": 2, "pipeline": 1, "fsdp": 4, "expert": 1, "context": 1,
                                               "tensor": 2}
    with pytest.raises(ConfigError, match=r"needs 16 devices but 8 are present"):
        mesh_lib.resolve_sizes(config.MeshConfig(data=1, fsdp=4, tensor=2, dcn=config.DcnConfig(data=2)), 8)


def test_simulated_devices_fill_the_grid_in_order_and_axes_are_auto():
    devices = jax.devices()
    mesh = mesh_lib.make_mesh(config.MeshConfig(data=2, fsdp=2, tensor=2))
    assert mesh.axis_names == MESH_AXES
    np.testing.assert_array_equal(np.vectorize(lambda d: d.id)(mesh.devices).ravel(), [d.id for d in devices])
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Auto}
