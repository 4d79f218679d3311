"""The grain pipeline over prepared tokens: the rows two processes read make the global batch,
and a resumed run continues mid-epoch with the same batches (one dataset and a weighted mixture);
what each source reads and refuses."""

import shutil

import jax
import numpy as np
import pytest

from prepared_data import cfg_for, run_cli
from shardtrain import step
from shardtrain.config import ConfigError
from shardtrain.data import loader, prepare, token_shards
from shardtrain.parallel import mesh as mesh_lib


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


def test_text_source_refuses_prepared_data_and_binary_files(prepared, cfg_factory, capsys, tmp_path):
    """data.source=text (the default) over a `prepare` output, or a directory holding one, exits 2
    pointing to data.source=tokens (it used to train on the shards' bytes); a binary file is named."""
    code, _, err = run_cli(capsys, "train", "meshes/demo.yaml", f"data.path={prepared}", f"run_dir={tmp_path / 'r'}")
    assert code == 2 and f"train on it with data.source=tokens data.path={prepared}" in err, err
    assert len(err.strip().splitlines()) == 1
    shutil.copytree(prepared, tmp_path / "holder" / "ds")
    with pytest.raises(ConfigError, match=f"holds a `shardtrain prepare` output, {tmp_path}/holder/ds "):
        loader.sources(cfg_factory(f"data.path={tmp_path}/holder", "data.seq_len=16"))
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "notes.txt").write_text("text " * 400)
    (texts / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    with pytest.raises(ConfigError, match=f"{texts}/logo.png is not text \\(a NUL byte at byte 8"):
        loader.sources(cfg_factory(f"data.path={texts}", "data.seq_len=16"))
    (texts / "logo.png").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ConfigError, match="logo.png is not text \\(not UTF-8 at byte 3\\)"):
        loader.sources(cfg_factory(f"data.path={texts}", "data.seq_len=16"))


def test_every_source_says_what_it_reads(prepared, cfg_factory, tmp_path):
    (tmp_path / "notes.txt").write_text("text " * 400)
    for overrides, line in [
            ([f"data.path={tmp_path}"], f"data: text bytes (ids 0..255) of 1 file in {tmp_path}: 2000 bytes, "
                                        "112 train windows, the last 1/20 held out for eval"),
            (["data.source=synthetic"], "data: synthetic arithmetic sequences modulo model.vocab_size=256 (seed 0)"),
            (["data.source=tokens", f"data.path={prepared}", "model.vocab_size=320"],
             f"data: {prepared}: ")]:
        cfg = cfg_factory("data.seq_len=16", *overrides)
        assert loader.describe(cfg, loader.sources(cfg)).startswith(line)


def test_tokens_source_at_a_file_or_the_import_placeholder_says_to_prepare(corpus, cfg_factory):
    """data.path at a JSONL file says to run `prepare` (it said "cannot read manifest.json"); the
    placeholder data.path of the config import-hf writes is a one-line error until filled in."""
    with pytest.raises(ConfigError, match=f"data.path={corpus}/a.jsonl is a file; .* tokenize it with `shardtrain "
                                          f"prepare {corpus}/a.jsonl --tokenizer TOK --out DIR`"):
        loader.sources(cfg_factory("data.source=tokens", f"data.path={corpus}/a.jsonl"))
    cfg = cfg_factory("data.source=tokens", f"data.path={loader.DATA_PATH_TO_FILL_IN}", "checkpoint.init_from=/m")
    with pytest.raises(ConfigError, match="PREPARED_DATA_DIR is a placeholder to fill in: .* `shardtrain prepare "
                                          "INPUT... --tokenizer /m --out DIR`"):
        loader.sources(cfg)
