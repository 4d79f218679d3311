"""The shipped configs for real targets build their shardings against their model without the
hardware: an AbstractMesh of the target's size stands in for the devices, so a rule, mesh or
shape mistake in one of them fails here. (Tracing and compiling them: tests/plan/test_plan_tpu.py plans
every shipped config on the hardware it names.)"""

import dataclasses
import math

import jax
import pytest
from jax.sharding import AbstractMesh, AxisType

from shardtrain import config, step
from shardtrain.config import MESH_AXES
from shardtrain.parallel import mesh as mesh_lib

TARGETS = {  # config: (devices, devices per host, slices/hosts joined over DCN)
    "tpu_v5e_256": (256, 4, 1),
    "tpu_v5p_2slices": (256, 4, 2),
    "gpu_1x8": (8, 8, 1),
    "gpu_2x8": (16, 8, 2),
    "llama3_8b_v5p_128": (128, 4, 1),
    "llama3_70b_v5p_512": (512, 4, 1),
    "llama3_8b_gpu_8": (8, 8, 1),
    "llama3_70b_gpu_64": (64, 8, 8),
    "mixtral_8x7b_gpu_32": (32, 8, 4),
    "mixtral_8x7b_v5p_128": (128, 4, 1),
    "gemma2_9b_v5p_64": (64, 4, 1),
    "olmo2_7b_v5p_64": (64, 4, 1),
    "deepseek_v2_lite_v5p_64": (32, 4, 1),
    "llama4_scout_v5p_128": (128, 4, 1),
    "deepseek_v3_v5p_512": (256, 4, 1),
    "deepseek_v3_h100_256": (256, 8, 32),
}


def target_program(name, *overrides):
    cfg = config.load(f"meshes/{name}.yaml", overrides)
    sizes = mesh_lib.resolve_sizes(cfg.mesh, TARGETS[name][0])
    mesh = AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    return cfg, step.build(cfg, mesh)


@pytest.mark.parametrize("name", TARGETS)
def test_target_config_shards_its_model(name):
    devices, per_host, granules = TARGETS[name]
    cfg, prog = target_program(name)
    n_params = prog.param_count()
    assert 3e8 < n_params < 7e11, f"{name}: {n_params / 1e9:.2f}B parameters is not a realistic size"  # V3 671B
    assert math.prod(getattr(cfg.mesh.dcn, a) for a in MESH_AXES) == granules
    assert per_host % cfg.mesh.tensor == 0, "tensor parallelism must stay within a host"
    assert cfg.mesh.dcn.tensor == 1
    # Every large parameter is sharded (FSDP and/or tensor): none is replicated on all devices.
    for path, x in jax.tree_util.tree_leaves_with_path(prog.abstract_state["params"]):
        if math.prod(x.shape) >= 2 ** 20:
            assert any(part is not None for part in x.sharding.spec), f"{name}: {path} {x.shape} is replicated"
    assert prog.batch_sharding.spec[0] is not None


@pytest.mark.parametrize("override,field", [("model.n_kv_heads=2", "kv_heads"),
                                            ("train.global_batch_size=100", "global_batch_size")])
def test_a_shape_mistake_in_a_target_config_fails(override, field):
    with pytest.raises(config.ConfigError, match=field):
        target_program("tpu_v5p_2slices", override)


@pytest.mark.slow
def test_an_activation_mistake_fails_only_when_traced():
    _, prog = target_program("tpu_v5p_2slices", "rules.seq=data")  # parameters never use 'seq'
    with pytest.raises(config.ConfigError, match="mesh axis 'data' is used twice"):
        prog.step.trace(prog.abstract_state, prog.abstract_batch())


def test_deepseek_v3_configs_hold_the_published_model():
    """DeepSeek-V3's parameters from its config.json's shapes (without the multi-token-prediction
    layer): untied embeddings, 61 MLA layers (q_lora 1536, kv_lora 512 + 64 rotary, 128 heads of 192
    query/key and 128 value channels, their norms), 3 dense MLPs of 18432, 58 MoE layers of 256 + 1
    experts of 2048 with a router and its bias; the same model on v5p and on H100s (but for the
    attention implementation: splash there, chunked here)."""
    d, heads, vocab = 7168, 128, 129280
    attention = d * 1536 + 1536 + 1536 * heads * 192 + d * (512 + 64) + 512 + 512 * heads * 256 + heads * 128 * d
    moe = d * 256 + 256 + 257 * 3 * d * 2048
    published = 2 * vocab * d + 61 * (attention + 2 * d) + 3 * 3 * d * 18432 + 58 * moe + d  # 671.03B
    programs = {name: target_program(name) for name in ("deepseek_v3_v5p_512", "deepseek_v3_h100_256")}
    (tpu_cfg, tpu), (gpu_cfg, gpu) = programs.values()
    assert tpu_cfg.model == dataclasses.replace(gpu_cfg.model, attention=tpu_cfg.model.attention)
    assert tpu.param_count() == gpu.param_count() == published
