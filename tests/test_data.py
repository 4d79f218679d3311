"""Real data: `shardtrain prepare` round trip, the packed token stream, rows per process, exact
resume, mixtures, the packed loss against documents run one by one, eval, bad inputs."""

import functools
import http.server
import json
import os
import threading
import urllib.parse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flax import nnx
from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers

import models
from shardtrain import cli, config, data, mesh as mesh_lib, prepare, step, storage, tokenize, tokens_source
from shardtrain.config import ConfigError

DOCS = [f"document {i}: " + " ".join(f"w{(i * 7 + j) % 13}" for j in range(3 + i % 9)) for i in range(60)]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """DOCS[:30] as JSONL (with a blank line), DOCS[30:50] as Parquet, DOCS[50:] as text files."""
    d = tmp_path_factory.mktemp("corpus")
    (d / "a.jsonl").write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(DOCS[:30])) + "\n\n")
    pq.write_table(pa.table({"text": DOCS[30:50]}), d / "b.parquet")
    for i, t in enumerate(DOCS[50:]):
        (d / f"c{i}.txt").write_text(t)
    return d


@pytest.fixture(scope="module")
def prepared(tok_path, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ds")
    inputs = [str(corpus / "a.jsonl"), str(corpus / "b.parquet"), str(corpus / "c*.txt")]
    prepare.prepare(inputs, prepare.Options(str(tok_path), str(out), eval_fraction=0.25), workers=1, say=lambda _: None)
    return out


class FakeGcs(http.server.BaseHTTPRequestHandler):
    """GCS's JSON API media downloads as GCS answers them (206 with the bytes of a Range, cut at
    the end; 416 for a range starting past the end; 404 for no object), from local directories:
    bucket name -> directory in `buckets`."""
    buckets: dict[str, Path] = {}

    def do_GET(self):  # noqa: N802 (the http.server hook's name)
        bucket, _, name = urllib.parse.urlparse(self.path).path.removeprefix("/storage/v1/b/").partition("/o/")
        path = self.buckets[bucket] / urllib.parse.unquote(name)
        body = path.read_bytes() if path.is_file() else None
        status, headers = (200, {}) if body is not None else (404, {})
        if body is not None and (byte_range := self.headers.get("Range")):
            first, last = byte_range.removeprefix("bytes=").split("-")
            size, first, last = len(body), int(first), int(last or len(body) - 1)
            status, headers = (206, {"Content-Range": f"bytes {first}-{min(last, size - 1)}/{size}"}) \
                if first < size else (416, {"Content-Range": f"bytes */{size}"})
            body = body[first:last + 1] if first < size else b""
        self.send_response(status)
        for k, v in {**headers, "x-goog-generation": "1", "Content-Length": str(len(body or b""))}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def gcs():
    """gcs(DIR) -> a gs:// URL that tensorstore's real `gcs` driver reads DIR through, from a fake
    GCS server on 127.0.0.1 (TENSORSTORE_GCS_HTTP_URL, a fixed bearer token). Its listen backlog
    holds the 32 connections a split opens with (the default 5 would drop some for a second)."""
    server = type("Server", (http.server.ThreadingHTTPServer,), {"request_queue_size": 128})(("127.0.0.1", 0), FakeGcs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    saved = {k: os.environ.get(k) for k in ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")}
    os.environ.update(TENSORSTORE_GCS_HTTP_URL=f"http://127.0.0.1:{server.server_address[1]}",
                      GOOGLE_AUTH_TOKEN_FOR_TESTING="test")

    def url(directory: Path) -> str:
        name = f"bucket{len(FakeGcs.buckets)}"
        FakeGcs.buckets[name] = directory
        return f"gs://{name}/data"
    yield url
    server.shutdown()
    server.server_close()
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def cfg_for(cfg_factory, ds, *extra):
    return cfg_factory("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "data.source=tokens", f"data.path={ds}",
                       "model.vocab_size=320", "data.seq_len=15",
                       "train.global_batch_size=8", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2",
                       "model.n_layers=2", "model.d_ff=64", *extra)


def split_docs(ds: Path, split: str) -> list[list[int]]:
    """The split's documents as the stream reads them (cut where the document id changes)."""
    s = tokens_source.TokenSplit(str(ds), split)
    tokens, doc_ids, _ = s.read(0, len(s), 1 << 20)
    return [t.tolist() for t in np.split(tokens, np.flatnonzero(np.diff(doc_ids)) + 1)]


def test_prepare_round_trip_gives_each_documents_tokens_and_eos(prepared, tok_path):
    tok = tokenize.load(str(tok_path))
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["eos_id"] == tok.eos_id == tok.tok.token_to_id("<|endoftext|>")
    assert manifest["vocab_size"] == 300 and manifest["dtype"] == "uint16"
    names = ["a.jsonl"] * 30 + ["b.parquet"] * 20 + [f"c{i}.txt" for i in range(10)]
    index = list(range(30)) + list(range(20)) + [0] * 10
    want = {"train": [], "eval": []}
    for doc, name, i in zip(DOCS, names, index):
        ids = tok.tok.encode(doc, add_special_tokens=False).ids + [tok.eos_id]
        want["eval" if prepare.is_eval(name, i, 0.25) else "train"].append(ids)
    assert want["eval"] and want["train"]
    for split in ("train", "eval"):
        assert split_docs(prepared, split) == want[split]
        assert manifest["splits"][split]["documents"] == len(want[split])
    assert tok.decode(want["train"][0][:-1]) in DOCS


def test_packed_windows_cut_the_stream_with_segments_and_positions(prepared):
    split = tokens_source.TokenSplit(str(prepared), "train")
    windows = tokens_source.PackedWindows(split, 16, 300)
    stream = np.concatenate([windows[i]["tokens"] for i in range(len(windows))])
    assert (stream == split.read(0, len(windows) * 16, 300)[0]).all()
    docs = split_docs(prepared, "train")
    doc_of = np.repeat(np.arange(len(docs)), [len(d) for d in docs])
    pos_of = np.concatenate([np.arange(len(d)) for d in docs])
    for i in range(len(windows)):
        w, span = windows[i], slice(i * 16, (i + 1) * 16)
        assert (w["segment_ids"] == doc_of[span] - doc_of[span][0]).all()
        assert (w["positions"] == pos_of[span]).all()


def test_prepare_resumes_and_runs_in_parallel(tok_path, corpus, tmp_path):
    inputs, opts = [str(corpus / "a.jsonl"), str(corpus / "b.parquet")], prepare.Options(str(tok_path), str(tmp_path))
    first = prepare.prepare(inputs, opts, workers=2, say=lambda _: None)
    (tmp_path / "parts" / "00001.json").unlink()  # as if killed while writing file 1
    (tmp_path / "train" / "00000.bin").write_bytes(b"")  # a finished file is not read again
    said = []
    assert prepare.prepare(inputs, opts, workers=1, say=said.append) == first
    assert said[0].startswith("prepare: 1 of 2 input files or parts already done")


def test_large_files_split_into_parts_give_the_same_bytes(tok_path, tmp_path):
    """A JSONL file cut into byte ranges at line starts (and a Parquet file into runs of row
    groups) tokenized by 2 processes gives the same shards, byte for byte, as 1 process, and the
    same token stream, eval split and error line numbers as the file read whole."""
    jsonl, table = tmp_path / "big.jsonl", tmp_path / "big.parquet"
    jsonl.write_text("".join(json.dumps({"text": t}) + ("\n\n" if i % 7 == 3 else "\n") for i, t in enumerate(DOCS)))
    pq.write_table(pa.table({"text": DOCS}), table, row_group_size=8)
    opts = dict(eval_fraction=0.25)
    dirs = {}
    for name, workers, part_bytes in (("whole", 1, 1 << 30), ("parts1", 1, 700), ("parts2", 2, 700)):
        dirs[name] = tmp_path / name
        prepare.prepare([str(jsonl), str(table)], prepare.Options(str(tok_path), str(dirs[name]), **opts),
                        workers=workers, say=lambda _: None, part_bytes=part_bytes)
    parts = sorted(p.name for p in (dirs["parts1"] / "parts").iterdir())
    assert len(parts) > 6 and "00000.0000.json" in parts and "00001.0001.json" in parts  # both files were cut

    def files(d):
        return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}
    assert files(dirs["parts1"]) == files(dirs["parts2"])
    (dirs["parts2"] / "parts" / "00000.0001.json").unlink()  # as if killed while writing that part
    (dirs["parts2"] / "train" / "00000.0001.bin").unlink()
    prepare.prepare([str(jsonl), str(table)], prepare.Options(str(tok_path), str(dirs["parts2"]), **opts),
                    workers=2, say=lambda _: None, part_bytes=700)
    assert files(dirs["parts1"]) == files(dirs["parts2"])
    for split in ("train", "eval"):
        assert split_docs(dirs["parts1"], split) == split_docs(dirs["whole"], split)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(jsonl.read_text() + '{"body": 1}\n')
    with pytest.raises(ConfigError, match=f"bad.jsonl:{len(jsonl.read_text().splitlines()) + 1}: no string field"):
        prepare.prepare([str(bad)], prepare.Options(str(tok_path), str(tmp_path / "bad")), workers=1,
                        say=lambda _: None, part_bytes=700)


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
    ds = data.samples(cfg)
    whole = [b for _, b in data.batches(ds, 8, slice(0, 8), 0, 3)]
    parts = [[b for _, b in data.batches(ds, 8, r, 0, 3)] for r in rows]
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
    epoch = len(tokens_source.windows(cfg, "train", str(prepared))) // 8 + 1
    steps = 2 * epoch + 1  # past an epoch's end: reshuffled windows
    whole = [b for _, b in data.batches(data.samples(cfg), 8, slice(0, 8), 0, steps)]
    resumed = [b for _, b in data.batches(data.samples(cfg), 8, slice(4, 8), epoch, steps)]  # new process
    for a, b in zip(whole[epoch:], resumed):
        assert all((a[k][4:] == b[k]).all() for k in a)
    if mixture:  # each sample comes from one dataset, by weight
        first = tokens_source.windows(cfg, "train", str(other))
        from_other = sum(any((w["tokens"] == first[i]["tokens"]).all() for i in range(len(first)))
                         for b in whole for w in (dict(zip(b, v)) for v in zip(*b.values())))
        assert 0.15 < from_other / (8 * steps) < 0.45


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
    return (float(total), float(count)), docs, nnx.merge(nnx.split(step.abstract_model(cfg))[0], params)


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
    2 stages x 4 micro-batches give the packed loss of the plain 2x2x2 mesh."""
    (want, want_count), _, _ = packed_loss("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    (got, count), _, _ = packed_loss("mesh.data=1", "mesh.pipeline=2", "mesh.fsdp=2",
                                     "mesh.tensor=2", "train.pipeline.microbatches=4")
    assert count == want_count and abs(got - want) / want < 1e-5


@pytest.mark.slow
def test_streaming_a_large_corpus_keeps_memory_flat(tmp_path):
    """300 MB of tokens read window by window: the process grows by far less than the corpus."""
    n_tokens, doc = 150_000_000, 997
    shard = tmp_path / "train" / "00000.bin"
    shard.parent.mkdir()
    with open(shard, "wb") as f:
        for start in range(0, n_tokens, 1 << 24):
            f.write((np.arange(start, min(n_tokens, start + (1 << 24))) % 50_000).astype(np.uint16).tobytes())
    offsets = np.append(np.arange(0, n_tokens, doc), n_tokens).astype(np.int64)
    np.save(tmp_path / "train" / "00000.idx.npy", offsets)
    entry = {"file": "train/00000.bin", "index": "train/00000.idx.npy", "tokens": n_tokens,
             "documents": len(offsets) - 1, "sha256": ""}
    (tmp_path / "manifest.json").write_text(json.dumps({
        "vocab_size": 50_000, "eos_id": 0, "dtype": "uint16", "splits": {"train": {"shards": [entry]}}}))
    del offsets

    def rss_mb():
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    windows = tokens_source.PackedWindows(tokens_source.TokenSplit(str(tmp_path), "train"), 1 << 16, 50_000)
    before = rss_mb()
    for i in range(len(windows)):
        w = windows[i]
    assert w["positions"][-1] == (len(windows) * (1 << 16) - 1) % doc
    assert rss_mb() - before < 30, f"RSS grew {rss_mb() - before:.0f} MB over {n_tokens * 2 / 2**20:.0f} MB of tokens"


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    captured = capsys.readouterr()
    run_cli.out = captured.out
    return e.value.code, captured.err


@pytest.mark.parametrize("content, message", [
    ('{"text": "fine"}\n{"body": "x"}\n', "bad.jsonl:2: no string field 'text' (has: body)"),
    ('{"text": "fine"}\nnot json\n', "bad.jsonl:2: not valid JSON"),
])
def test_bad_jsonl_exits_2_naming_file_and_line(capsys, tmp_path, tok_path, content, message):
    (tmp_path / "bad.jsonl").write_text(content)
    code, err = run_cli(capsys, "prepare", str(tmp_path / "bad.jsonl"), "--tokenizer", str(tok_path),
                        "--out", str(tmp_path / "out"))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err  # found at once: no bar


def test_prepare_errors(capsys, tmp_path, tok_path, corpus):
    cases = [(["--tokenizer", str(tmp_path / "none.json")], "no tokenizer file there"),
             (["--tokenizer", str(tok_path), "--eos", "<nope>"], "--eos <nope>: no such token"),
             (["--tokenizer", str(tok_path), "--eval-fraction", "0.0001"], "held out none of the 10 documents"),
             (["--tokenizer", str(tok_path), "--text-field", "body"], "no column 'body'"),
             (["--tokenizer", str(tok_path), "--out", "gs://b/ds"], "--out gs://b/ds: prepare writes to local disk")]
    for args, message in cases:
        inputs = [str(corpus / "b.parquet")] if "body" in args else [str(corpus / "c*.txt")]
        code, err = run_cli(capsys, "prepare", *inputs, "--out", str(tmp_path / "out"), *args)
        assert code == 2 and message in err.strip().splitlines()[-1] and "Traceback" not in err, err


def test_range_arrays_read_what_numpy_reads(tmp_path, monkeypatch):
    """Elements and slices of a .npy file, read by range from disk and through a URL, with index
    blocks of 8 entries so that reads cross blocks."""
    monkeypatch.setattr(storage, "INDEX_BLOCK", 64)
    storage._index_block.cache_clear()
    want = np.random.default_rng(0).integers(0, 1 << 40, 1000)
    np.save(tmp_path / "a.npy", want)
    rng = np.random.default_rng(1)
    for store in (storage.LocalStore(str(tmp_path)), storage.KvStore(f"file://{tmp_path}")):
        array = storage.npy_array(store, "a.npy")
        assert len(array) == 1000 and [array[i] for i in range(1000)] == want.tolist() and array[-1] == want[-1]
        for start, stop in [(0, 1000), (5, 6), (7, 9), (8, 16), (990, 1005), (3, 3)] + \
                [sorted(rng.integers(0, 1000, 2)) for _ in range(50)]:
            assert array[start:stop].tolist() == want[start:stop].tolist(), (start, stop)
        assert storage.npy_array(store, "none.npy") is None
    storage._index_block.cache_clear()


@pytest.mark.parametrize("where", ["local", "file", "gs"])
def test_streaming_errors_name_the_shard(prepared, cfg_factory, tmp_path, gcs, where):
    """The same checks on a local directory and through URLs: file:// and gs:// (tensorstore's
    kvstore; gs:// through its gcs driver and a fake GCS server)."""
    import shutil
    ds = tmp_path / "data"
    shutil.copytree(prepared, ds)
    where = {"local": str(ds), "file": f"file://{ds}", "gs": gcs(tmp_path)}[where]
    shard, name = ds / "train" / "00000.bin", f"{where}/train/00000.bin"
    with pytest.raises(ConfigError, match="smaller than the tokenizer's 300"):
        tokens_source.windows(cfg_for(cfg_factory, where, "model.vocab_size=256"), "train")
    tokens = np.fromfile(shard, np.uint16)
    tokens[3] = 999
    tokens.tofile(shard)
    windows = tokens_source.windows(cfg_for(cfg_factory, where), "train")  # size matches: found when read
    with pytest.raises(ConfigError, match=f"{name}: token id 999 >= model.vocab_size=320"):
        windows[0]
    with pytest.raises(ConfigError, match=f"{name}: sha256 does not match"):
        tokens_source.windows(cfg_for(cfg_factory, where, "data.verify=checksum"), "train")
    for cut, problem in ((tokens[:-1], "(.* bytes|fewer than .*)"), (np.append(tokens, 1), "(.* bytes|more than .*)")):
        cut.tofile(shard)
        with pytest.raises(ConfigError, match=f"{name}: {problem}, manifest.json says"):
            tokens_source.windows(cfg_for(cfg_factory, where), "train")
    shard.unlink()
    with pytest.raises(ConfigError, match=f"{name}: shard listed in manifest.json is missing"):
        tokens_source.windows(cfg_for(cfg_factory, where), "train")
    (ds / "manifest.json").unlink()
    with pytest.raises(ConfigError, match=f"data.path={where}: no manifest.json there"):
        tokens_source.windows(cfg_for(cfg_factory, where), "train")


@pytest.mark.parametrize("scheme", ["file", "gs"])
def test_a_url_streams_the_same_windows_as_the_local_directory(prepared, cfg_factory, gcs, tmp_path, scheme):
    """data.path=file://DIR or gs://BUCKET/DIR (a fake GCS server) goes through tensorstore's
    kvstore: the same windows (tokens, segment ids, positions) as reading DIR from disk, and the
    same batches read ahead by REMOTE_READ_THREADS threads."""
    (tmp_path / "data").symlink_to(prepared)
    url = f"file://{prepared}" if scheme == "file" else gcs(tmp_path)
    local = tokens_source.windows(cfg_for(cfg_factory, prepared), "eval")
    remote = tokens_source.windows(cfg_for(cfg_factory, url), "eval")
    assert isinstance(remote.split.shards[0].tokens.store, storage.KvStore) and len(remote) == len(local) > 2
    for i in range(len(local)):
        assert all((remote[i][k] == local[i][k]).all() for k in local[i])
    cfg, local_cfg = cfg_for(cfg_factory, url), cfg_for(cfg_factory, prepared)
    assert data.read_threads(cfg) == data.REMOTE_READ_THREADS and data.read_threads(local_cfg) == 1
    got = list(data.batches(data.samples(cfg), 8, slice(0, 8), 0, 10, data.read_threads(cfg)))
    want = list(data.batches(data.samples(local_cfg), 8, slice(0, 8), 0, 10))
    assert [s for s, _ in got] == list(range(10))  # many threads read ahead, in order
    assert all((a[k] == b[k]).all() for (_, a), (_, b) in zip(got, want) for k in a)


@pytest.mark.slow
def test_train_evaluates_and_eval_command_agrees(prepared, capsys, tmp_path):
    """Training on prepared tokens logs eval rows; `shardtrain eval` of its checkpoint gives the
    last row's eval_loss again."""
    args = ["meshes/demo.yaml", "data.source=tokens", f"data.path={prepared}", "model.vocab_size=320",
            "data.seq_len=15", "train.global_batch_size=8", "model.d_model=32", "model.n_layers=1",
            "model.d_ff=64", "train.steps=4", "train.eval_every=2", "train.eval_steps=2", f"run_dir={tmp_path}"]
    code, err = run_cli(capsys, "train", *args)
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(np.isclose(r["eval_perplexity"], np.exp(r["eval_loss"])) for r in evals)
    code, _ = run_cli(capsys, "eval", args[0], str(tmp_path / "checkpoints" / "4"), *args[1:])
    row = json.loads(run_cli.out.strip().splitlines()[-1]) if code == 0 else None
    assert code == 0 and row["step"] == 4 and abs(row["eval_loss"] - evals[-1]["eval_loss"]) < 1e-5
