"""Packed documents through the train step: attention stays inside each document and positions
restart, so the loss of packed rows is that of the documents run one by one, also through a
pipeline."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import models
from shardtrain import config, step
from shardtrain.parallel import mesh as mesh_lib, sharding

PACKED_LENGTHS = [[7, 10, 7], [24], [3, 5, 16], [12, 12], [1, 2, 21], [20, 4], [8, 8, 8], [5, 19]]


@functools.cache
def packed_loss(*mesh):
    """(summed loss, counted positions) of 8 packed rows of random documents, on `mesh`; the
    documents and the model's parameters (cached: two tests share the 2x2x2 one)."""
    cfg = config.load(None, ["data.source=tokens", "data.path=unused", "model.vocab_size=64", "data.seq_len=23",
                      "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=2",
                      "model.d_ff=64", "train.global_batch_size=8", *mesh])
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    params = nnx.to_pure_dict(nnx.split(models.get("gpt")(cfg.model, rngs=nnx.Rngs(0)))[1])
    rng = np.random.default_rng(1)
    docs = [[rng.integers(0, 64, n) for n in row] for row in PACKED_LENGTHS]
    batch = {"tokens": [np.concatenate(r) for r in docs],
             "segment_ids": [np.repeat(np.arange(len(r)), [len(d) for d in r]) for r in docs],
             "positions": [np.concatenate([np.arange(len(d)) for d in r]) for r in docs]}
    batch = {k: np.stack(v).astype(np.int32) for k, v in batch.items()}
    total, count = jax.jit(prog.loss_sums)(
        jax.device_put(params, prog.state_shardings["params"]), prog.device_batch(batch))
    return (float(total), float(count)), docs, nnx.merge(nnx.split(sharding.abstract_model(cfg))[0], params)


def test_packed_loss_equals_the_documents_run_one_by_one():
    """Attention stays inside each document and rotary positions restart: the loss of packed
    windows (sharded on 2x2x2) is the token-weighted sum of each document's own loss."""
    (total, count), docs, model = packed_loss("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    # each document alone in its own row, right-padded (causal: padding never reaches earlier positions)
    alone = [d for r in docs for d in r if len(d) > 1]
    rows_nt = np.zeros((len(alone), 24), np.int32)
    for i, d in enumerate(alone):
        rows_nt[i, :len(d)] = d
    logits_ntv = jax.jit(lambda t: model(t))(jnp.asarray(rows_nt[:, :-1]))  # unsharded
    ce_nt = optax.softmax_cross_entropy_with_integer_labels(logits_ntv, jnp.asarray(rows_nt[:, 1:]))
    valid_nt = np.arange(23)[None, :] < np.array([len(d) - 1 for d in alone])[:, None]
    want_total, want_count = float((ce_nt * valid_nt).sum()), float(valid_nt.sum())
    assert count == want_count
    assert abs(total - want_total) / want_total < 1e-5


def test_pipeline_carries_packed_documents():
    """Each pipeline stage reads the segment ids and positions of the micro-batch it works on:
    2 stages x 4 micro-batches give the packed loss of the plain 2x2x2 mesh, with GPipe and with an
    explicit schedule (zero_bubble: the documents are among what its forwards hold per micro-batch)."""
    (want, want_count), _, _ = packed_loss("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    for schedule in ("gpipe", "zero_bubble"):
        (got, count), _, _ = packed_loss("mesh.data=1", "mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2",
                                         "train.pipeline.microbatches=4", f"train.pipeline.schedule={schedule}")
        assert count == want_count and abs(got - want) / want < 1e-5, schedule
