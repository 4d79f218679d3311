"""The grain pipeline over prepared tokens: the rows two processes read make the global batch,
and a resumed run continues mid-epoch with the same batches (one dataset and a weighted mixture)."""

import jax
import numpy as np
import pytest

from prepared_data import cfg_for
from shardtrain import mesh as mesh_lib, step
from shardtrain.data import loader, prepare, token_shards


def test_rows_of_two_processes_are_disjoint_and_make_the_batch(prepared, cfg_factory):
    cfg = cfg_for(cfg_factory, prepared)
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    devices = sorted(jax.devices(), key=lambda d: d.id)  # 2 processes x 4 devices, as jax numbers them
    index_map = prog.batch_sharding.devices_indices_map(prog.batch_shape())
    rows = []
    for group in (devices[:4], devices[4:]):
        held = {r for d in group for r in range(8)[index_map[d][0]]}
        rows.append(prog.rows_for(group))
        assert held == set(range(8)[rows[-1]])  # contiguous
    assert not set(range(8)[rows[0]]) & set(range(8)[rows[1]]) and prog.local_rows() == slice(0, 8)
    ds = loader.samples(cfg)
    whole = [b for _, b in loader.batches(ds, 8, slice(0, 8), 0, 3)]
    parts = [[b for _, b in loader.batches(ds, 8, r, 0, 3)] for r in rows]
    for s in range(3):
        for k in whole[s]:
            assert (np.concatenate([parts[0][s][k], parts[1][s][k]]) == whole[s][k]).all()


@pytest.mark.parametrize("mixture", [False, True])
def test_resume_mid_epoch_continues_the_same_batches(prepared, tok_path, corpus, cfg_factory, tmp_path, mixture):
    extra = ()
    if mixture:
        other = tmp_path / "other"
        prepare.prepare([str(corpus / "c*.txt")], prepare.Options(str(tok_path), str(other)), say=lambda _: None)
        extra = ("data.path=null",
                 f"data.mixture=[{{path: {prepared}, weight: 0.7}}, {{path: {other}, weight: 0.3}}]")
    cfg = cfg_for(cfg_factory, prepared, *extra)
    epoch = len(token_shards.windows(cfg, "train", str(prepared))) // 8 + 1
    steps = 2 * epoch + 1  # past an epoch's end: reshuffled windows
    whole = [b for _, b in loader.batches(loader.samples(cfg), 8, slice(0, 8), 0, steps)]
    resumed = [b for _, b in loader.batches(loader.samples(cfg), 8, slice(4, 8), epoch, steps)]  # new process
    for a, b in zip(whole[epoch:], resumed):
        assert all((a[k][4:] == b[k]).all() for k in a)
    if mixture:  # each sample comes from one dataset, by weight
        first = token_shards.windows(cfg, "train", str(other))
        from_other = sum(any((w["tokens"] == first[i]["tokens"]).all() for i in range(len(first)))
                         for b in whole for w in (dict(zip(b, v)) for v in zip(*b.values())))
        assert 0.15 < from_other / (8 * steps) < 0.45
