"""The decoder's scale paths against the defaults: attention impls, rolled vs unrolled scan,
gather vs one-hot embedding, packed documents (segment ids + positions), remat offload on TPU."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from shardtrain import config, step
from shardtrain.parallel import mesh as mesh_lib
from shardtrain.plan import planner


def logits(cfg_model, tokens, **kw):
    model = models.get("gpt")(cfg_model, rngs=nnx.Rngs(0))
    return model(tokens, **kw)


@pytest.fixture(scope="module")
def small():
    cfg = config.load(None, ["model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=2",
                             "model.d_ff=128"]).model
    tokens = jax.random.randint(jax.random.key(1), (2, 128), 0, 256)
    return cfg, tokens, logits(cfg, tokens)


@pytest.mark.parametrize("field", ["attention=chunked", "attention=splash", "embed=one_hot"])
def test_model_paths_match_default(small, field):
    cfg, tokens, ref = small
    key, value = field.split("=")
    np.testing.assert_allclose(logits(dataclasses.replace(cfg, **{key: value}), tokens), ref,
                               atol=2e-5, rtol=1e-5)


def test_packed_rows_equal_separate_documents(small):
    """Two documents packed in one row (segment ids, positions restarting) give each document's
    logits as if it were alone in its row."""
    cfg, _, _ = small
    a = jax.random.randint(jax.random.key(2), (1, 48), 0, 256)
    b = jax.random.randint(jax.random.key(3), (1, 80), 0, 256)
    seg = jnp.concatenate([jnp.zeros((1, 48), jnp.int32), jnp.ones((1, 80), jnp.int32)], 1)
    pos = jnp.concatenate([jnp.arange(48), jnp.arange(80)])[None]
    for impl in ("xla", "chunked"):
        c = dataclasses.replace(cfg, attention=impl)
        packed = logits(c, jnp.concatenate([a, b], 1), segment_ids_bt=seg, positions_bt=pos)
        np.testing.assert_allclose(packed[:, :48], logits(c, a), atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(packed[:, 48:], logits(c, b), atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_rolled_scan_and_chunked_loss_same_step(cfg_factory):
    """One train step: rolled scan + gather + chunked loss == unrolled + one-hot + plain loss."""
    base = ["model.n_layers=2", "train.global_batch_size=8", "data.seq_len=64", "data.source=synthetic",
            "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
    results = []
    for extra in (["train.scan_unroll=2", "model.embed=one_hot", "train.loss_chunk=0"],
                  ["train.scan_unroll=1", "model.embed=gather", "train.loss_chunk=16"]):
        cfg = cfg_factory(*base, *extra)
        prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
        tokens = jax.device_put(jax.random.randint(jax.random.key(0), (8, 65), 0, 256), prog.batch_sharding)
        state, metrics = prog.step(prog.init(0), tokens)
        results.append((float(metrics["loss"]), state["params"]))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), results[0][1], results[1][1])


def test_remat_offload_compiles_for_tpu(cfg_factory):
    from jax.experimental import topologies
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    cfg = cfg_factory("train.remat=offload", "mesh.fsdp=4", "train.global_batch_size=8", "data.seq_len=256",
                      "model.d_model=256", "model.n_heads=2", "model.n_kv_heads=2", "model.n_layers=2",
                      "train.compute_dtype=bfloat16")
    lowered = step.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices=topo.devices)).lower()
    hlo = planner.compile_fast(lowered, "tpu").as_text()  # the compilation cache held off, as plan holds it
    assert "S(5)" in hlo  # pinned host memory space: the saved activations live on the host
