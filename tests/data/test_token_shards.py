"""Reading prepared token shards: packed windows with segment ids and positions, flat memory over
a large corpus, errors that name the shard (on disk and through file:// and gs:// URLs), the same
windows through a URL as from disk, and the console line that describes the data."""

import http.server
import json
import os
import shutil
import threading
import urllib.parse
from pathlib import Path

import numpy as np
import pytest

from prepared_data import cfg_for, split_docs
from shardtrain.config import ConfigError
from shardtrain.data import loader, storage, token_shards


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

    def url(directory: Path) -> str:
        name = f"bucket{len(FakeGcs.buckets)}"
        FakeGcs.buckets[name] = directory
        return f"gs://{name}/data"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TENSORSTORE_GCS_HTTP_URL", f"http://127.0.0.1:{server.server_address[1]}")
        env.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "test")
        yield url
    server.shutdown()
    server.server_close()


def test_packed_windows_cut_the_stream_with_segments_and_positions(prepared):
    split = token_shards.TokenSplit(str(prepared), "train")
    windows = token_shards.PackedWindows(split, 16, 300)
    stream = np.concatenate([windows[i]["tokens"] for i in range(len(windows))])
    assert (stream == split.read(0, len(windows) * 16, 300)[0]).all()
    docs = split_docs(prepared, "train")
    doc_of = np.repeat(np.arange(len(docs)), [len(d) for d in docs])
    pos_of = np.concatenate([np.arange(len(d)) for d in docs])
    for i in range(len(windows)):
        w, span = windows[i], slice(i * 16, (i + 1) * 16)
        assert (w["segment_ids"] == doc_of[span] - doc_of[span][0]).all()
        assert (w["positions"] == pos_of[span]).all()


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

    windows = token_shards.PackedWindows(token_shards.TokenSplit(str(tmp_path), "train"), 1 << 16, 50_000)
    before = rss_mb()
    for i in range(len(windows)):
        w = windows[i]
    assert w["positions"][-1] == (len(windows) * (1 << 16) - 1) % doc
    assert rss_mb() - before < 30, f"RSS grew {rss_mb() - before:.0f} MB over {n_tokens * 2 / 2**20:.0f} MB of tokens"


@pytest.mark.parametrize("where", ["local", "file", "gs"])
def test_streaming_errors_name_the_shard(prepared, cfg_factory, tmp_path, gcs, where):
    """The same checks on a local directory and through URLs: file:// and gs:// (tensorstore's
    kvstore; gs:// through its gcs driver and a fake GCS server)."""
    ds = tmp_path / "data"
    shutil.copytree(prepared, ds)
    where = {"local": str(ds), "file": f"file://{ds}", "gs": gcs(tmp_path)}[where]
    shard, name = ds / "train" / "00000.bin", f"{where}/train/00000.bin"
    with pytest.raises(ConfigError, match="smaller than the tokenizer's 300"):
        token_shards.windows(cfg_for(cfg_factory, where, "model.vocab_size=256"), "train")
    tokens = np.fromfile(shard, np.uint16)
    tokens[3] = 999
    tokens.tofile(shard)
    windows = token_shards.windows(cfg_for(cfg_factory, where), "train")  # size matches: found when read
    with pytest.raises(ConfigError, match=f"{name}: token id 999 >= model.vocab_size=320"):
        windows[0]
    with pytest.raises(ConfigError, match=f"{name}: sha256 does not match"):
        token_shards.windows(cfg_for(cfg_factory, where, "data.verify=checksum"), "train")
    for cut, problem in ((tokens[:-1], "(.* bytes|fewer than .*)"), (np.append(tokens, 1), "(.* bytes|more than .*)")):
        cut.tofile(shard)
        with pytest.raises(ConfigError, match=f"{name}: {problem}, manifest.json says"):
            token_shards.windows(cfg_for(cfg_factory, where), "train")
    shard.unlink()
    with pytest.raises(ConfigError, match=f"{name}: shard listed in manifest.json is missing"):
        token_shards.windows(cfg_for(cfg_factory, where), "train")
    manifest = json.loads((ds / "manifest.json").read_text())
    for dtype in ("float16", "uint8"):  # the same bytes read as floats (ids 0 .. 300 are ~0.0), or too narrow
        (ds / "manifest.json").write_text(json.dumps({**manifest, "dtype": dtype}))
        with pytest.raises(ConfigError, match=f"manifest.json: dtype '{dtype}' cannot hold the ids of a 300-token"):
            token_shards.windows(cfg_for(cfg_factory, where), "train")
    (ds / "manifest.json").unlink()
    with pytest.raises(ConfigError, match=f"data.path={where}: no manifest.json there"):
        token_shards.windows(cfg_for(cfg_factory, where), "train")


@pytest.mark.parametrize("scheme", ["file", "gs"])
def test_a_url_streams_the_same_windows_as_the_local_directory(prepared, cfg_factory, gcs, tmp_path, scheme):
    """data.path=file://DIR or gs://BUCKET/DIR (a fake GCS server) goes through tensorstore's
    kvstore: the same windows (tokens, segment ids, positions) as reading DIR from disk, and the
    same batches read ahead by REMOTE_READ_THREADS threads."""
    (tmp_path / "data").symlink_to(prepared)
    url = f"file://{prepared}" if scheme == "file" else gcs(tmp_path)
    local = token_shards.windows(cfg_for(cfg_factory, prepared), "eval")
    remote = token_shards.windows(cfg_for(cfg_factory, url), "eval")
    assert isinstance(remote.split.shards[0].tokens.store, storage.KvStore) and len(remote) == len(local) > 2
    for i in range(len(local)):
        assert all((remote[i][k] == local[i][k]).all() for k in local[i])
    cfg, local_cfg = cfg_for(cfg_factory, url), cfg_for(cfg_factory, prepared)
    assert loader.read_threads(cfg) == loader.REMOTE_READ_THREADS and loader.read_threads(local_cfg) == 1
    got = list(loader.batches(loader.samples(cfg), 8, slice(0, 8), 0, 10, loader.read_threads(cfg)))
    want = list(loader.batches(loader.samples(local_cfg), 8, slice(0, 8), 0, 10))
    assert [s for s, _ in got] == list(range(10))  # many threads read ahead, in order
    assert all((a[k] == b[k]).all() for (_, a), (_, b) in zip(got, want) for k in a)


def test_describe_names_each_dataset_its_tokens_and_the_vocabulary_padding(prepared, cfg_factory, tmp_path):
    """The console line of a run on tokens, from the datasets the loader opened (a mixture: one
    entry each)."""
    manifest = json.loads((prepared / "manifest.json").read_text())
    train = manifest["splits"]["train"]["tokens"]
    mixture = f"data.mixture=[{{path: {prepared}, weight: 0.5}}, {{path: {prepared}, weight: 0.5}}]"
    opened = loader.sources(cfg_for(cfg_factory, prepared, "data.path=null", mixture))
    one = f"{prepared}: {train} train tokens, tokenizer vocab 300, model.vocab_size 320 pads it by 20"
    assert token_shards.describe(opened) == f"data: {one}; {one}"
