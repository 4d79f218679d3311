"""Rules -> PartitionSpecs: golden files per shipped config, and the loud errors."""

import glob
import os
from pathlib import Path

import jax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

from shardtrain import cli, config, step
from shardtrain.config import MESH_AXES, ConfigError
from shardtrain.parallel import mesh as mesh_lib, sharding

GOLDEN = Path(__file__).parents[1] / "golden"
CONFIGS = sorted(glob.glob("meshes/*.yaml"))


def abstract_mesh(sizes: dict) -> AbstractMesh:
    return AbstractMesh(tuple(sizes.get(a, 1) for a in MESH_AXES), MESH_AXES,
                        axis_types=(AxisType.Auto,) * len(MESH_AXES))


def layout_text(cfg: config.RunConfig) -> str:
    """The resolved config and every parameter's path, shape and PartitionSpec."""
    mesh = abstract_mesh(mesh_lib.resolve_sizes(cfg.mesh, cli.mesh_devices(cfg)))
    _, state = nnx.split(sharding.abstract_model(cfg))
    params = nnx.to_pure_dict(state)
    specs = sharding.param_specs(params, sharding.logical_names(state), cfg.rules, mesh)
    rows = [f"{sharding.path_str(path):32s} {str(x.shape):22s} {spec}" for (path, x), spec in
            zip(jax.tree_util.tree_leaves_with_path(params),
                jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)))]
    return config.dump(cfg) + "\n# mesh " + str(dict(mesh.shape)) + "\n" + "\n".join(rows) + "\n"


@pytest.mark.parametrize("path", CONFIGS, ids=[Path(p).stem for p in CONFIGS])
def test_golden_layout(path):
    """A sharding change is always a visible diff. Regenerate: UPDATE_GOLDEN=1 pytest tests/parallel/test_sharding.py"""
    cfg = config.load(path, ["run_dir=/runs/golden"])  # absolute: paths resolve against the cwd
    text, golden = layout_text(cfg), GOLDEN / (Path(path).stem + ".txt")
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"no golden file for {path}; run with UPDATE_GOLDEN=1"
    assert text == golden.read_text()


def test_demo_golden_has_megatron_and_fsdp_layout():
    text = (GOLDEN / "demo.txt").read_text()
    assert "blocks/w_up_df                   (4, 128, 512)          P(None, 'fsdp', 'tensor')" in text
    assert "blocks/w_down_fd                 (4, 512, 128)          P(None, 'tensor', 'fsdp')" in text


MESH = abstract_mesh({"data": 2, "pipeline": 1, "fsdp": 2, "tensor": 2})


def test_spec_drops_size_one_axes_and_combines_batch_axes():
    rules = config.RulesConfig()
    assert sharding.spec_for(("batch", "seq", "mlp"), rules, MESH) == P(("data", "fsdp"), None, "tensor")
    assert sharding.spec_for(("layers", "embed"), rules, MESH) == P(None, "fsdp")


def test_unknown_logical_axis():
    with pytest.raises(ConfigError, match="unknown logical axis 'hidden'; rules define: batch, embed"):
        sharding.spec_for(("hidden",), config.RulesConfig(), MESH)


def test_mesh_axis_used_twice():
    rules = config.RulesConfig(mlp="fsdp")
    with pytest.raises(ConfigError, match="mesh axis 'fsdp' is used twice .* 'embed' and 'mlp'"):
        sharding.spec_for(("embed", "mlp"), rules, MESH)


def test_indivisible_parameter_names_path_dimension_and_axes(cfg_factory):
    cfg = cfg_factory("mesh.data=1", "mesh.tensor=8", "model.n_heads=4", "model.n_kv_heads=4")
    with pytest.raises(ConfigError) as e:
        step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    assert "parameter blocks/wk_dke (4, 128, 4, 32): dimension 2 ('kv_heads') of size 4 is not divisible " \
           "by mesh axes tensor = 8" in str(e.value)


def test_indivisible_batch(cfg_factory):
    cfg = cfg_factory("mesh.data=8", "train.global_batch_size=12")
    with pytest.raises(ConfigError,
                       match=r"batch .*dimension 0 \('batch'\) of size 12 is not divisible by mesh axes data = 8"):
        step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
