"""The `tokens` data source: token shards written by `shardtrain prepare`, read by byte range.

A prepared directory holds manifest.json and, per split, its shards (TokenFile: the tokens, a
document index, the loss mask of chat data). A split's shards are one concatenated token stream;
window i is tokens [i W, (i+1) W) with W = seq_len + 1, crossing document and shard boundaries
(packing). Each window comes with
  segment_ids  the document of each token, counted from 0 at the window's first token
  positions    each token's offset inside its document (0 at a document's first token; a
               document that began in an earlier window continues its count)
  loss_mask    1 where the token is one the loss predicts: the mask `prepare --chat` wrote (the
               assistant's tokens), all ones for other data
The training loss masks position t (input token t predicting token t+1) when the two belong to
different documents: the input is a document's EOS and the target the next document's first
token. EOS itself is predicted (from the document's last token). It also masks position t when
loss_mask[t + 1] is 0 (a prompt token of a conversation).

Reads go through storage.py, by byte range from local disk (os.pread) or a gs:// URL
(tensorstore): a window is one range of its shard plus a binary search over the shard's document
index (cached blocks), never a memory map: what a host holds is its batch, not the pages of a
corpus it has walked through, so memory stays flat however large the corpus.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from shardtrain.config import ConfigError, RunConfig
from shardtrain.data import storage, tokenize


class EmptySplit(ConfigError):
    """A split asked for holds no documents."""


TOKEN_DTYPES = ("uint16", "uint32")
"""What `shardtrain prepare` stores token ids as (data/prepare.py token_dtype)."""


def read_manifest(directory: str) -> dict:
    if not storage.is_url(directory) and Path(directory).is_file():
        raise ConfigError(f"data.path={directory} is a file; data.source=tokens reads a `shardtrain prepare` output "
                          f"directory: tokenize it with `shardtrain prepare {directory} --tokenizer TOK --out DIR`, "
                          "then pass data.path=DIR")
    store = storage.open_store(directory)
    try:
        text = store.read_all("manifest.json")
    except Exception as e:  # tensorstore raises ValueError for a bad URL or bucket, with a long text
        first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise ConfigError(f"data.path={directory}: cannot read manifest.json ({first})") from None
    if text is None:
        raise ConfigError(f"data.path={directory}: no manifest.json there; write one with "
                          f"`shardtrain prepare INPUT... --tokenizer TOK --out {directory}`")
    try:
        manifest = json.loads(text)
    except ValueError:
        raise ConfigError(f"{store.name('manifest.json')}: not valid JSON; rerun `shardtrain prepare` "
                          f"into {directory}") from None
    dtype, vocab = manifest.get("dtype"), manifest.get("vocab_size")
    if dtype not in TOKEN_DTYPES or not isinstance(vocab, int) or vocab - 1 > np.iinfo(dtype).max:
        raise ConfigError(f"{store.name('manifest.json')}: dtype {str(dtype)[:40]!r} cannot hold the ids of a "
                          f"{str(vocab)[:40]}-token vocabulary (prepare writes {' or '.join(TOKEN_DTYPES)}); rerun "
                          f"`shardtrain prepare` into {directory}")
    return manifest


def check_vocab(cfg: RunConfig, manifest: dict, directory: str) -> None:
    """model.vocab_size must hold the tokenizer's ids; a larger (padded) vocabulary is allowed."""
    n = manifest["vocab_size"]
    if cfg.model.vocab_size < n:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {n} tokens "
                          f"({directory}/manifest.json); set model.vocab_size={n} or more")


def tokenizer_fingerprint(manifest: dict, directory: str) -> str | None:
    """The fingerprint (tokenize.fingerprint) of the tokenizer a prepared directory was made with: its
    manifest's, else (an older prepare) `bytes` or its local tokenizer.json's; None if unknown."""
    if manifest.get("tokenizer_fingerprint"):
        return manifest["tokenizer_fingerprint"]
    if manifest.get("tokenizer") == "bytes":
        return tokenize.BYTES
    return None if storage.is_url(directory) else tokenize.fingerprint_of(Path(directory))


class TokenFile:
    """One token file of a split (a shard of the manifest), its size (or checksum) checked
    against the manifest: `tokens`, `mask` (None but for chat data) and the document `offsets`."""

    def __init__(self, store: storage.Store, entry: dict, dtype: np.dtype, verify: str):
        key, stem = entry["file"], entry["file"].rsplit("/", 1)[-1].removesuffix(".bin")
        self.name = store.name(key)
        redo = f"rerun `shardtrain prepare` into {store} after deleting {store}/parts/{stem}.json"
        want = entry["tokens"] * dtype.itemsize
        problem = store.check_size(key, want)
        if problem == "missing":
            raise ConfigError(f"{self.name}: shard listed in manifest.json is missing; {redo}")
        if problem:
            raise ConfigError(f"{self.name}: {problem}, manifest.json says {want}; the shard is "
                              f"truncated or corrupt: {redo}")
        if verify == "checksum":
            sha = hashlib.sha256()
            for start in range(0, want, 1 << 24):
                sha.update(store.read(key, start, min(want, start + (1 << 24))))
            if sha.hexdigest() != entry["sha256"]:
                raise ConfigError(f"{self.name}: sha256 does not match manifest.json; the shard is corrupt: {redo}")
        self.tokens = storage.RangeArray(store, key, dtype, 0, entry["tokens"])
        self.mask = None
        if "mask" in entry:  # prepare --chat: uint8 per token
            problem = store.check_size(entry["mask"], entry["tokens"])
            if problem:
                raise ConfigError(f"{store.name(entry['mask'])}: loss mask listed in manifest.json is "
                                  f"{'missing' if problem == 'missing' else 'not one byte per token'}; {redo}")
            self.mask = storage.RangeArray(store, entry["mask"], np.uint8, 0, entry["tokens"])
        self.offsets = storage.npy_array(store, entry["index"])
        if self.offsets is None:
            raise ConfigError(f"{store.name(entry['index'])}: document index listed in manifest.json is missing; "
                              f"{redo}")
        if len(self.offsets) != entry["documents"] + 1 or self.offsets[len(self.offsets) - 1] != entry["tokens"]:
            raise ConfigError(f"{store.name(entry['index'])}: does not match manifest.json ({entry['documents']} "
                              f"documents, {entry['tokens']} tokens); {redo}")


class TokenSplit:
    """One split (train / eval) of a prepared directory as one stream of tokens. `manifest`: the
    directory's, when the caller has read it already."""

    def __init__(self, directory: str, split: str, verify: str = "size", manifest: dict | None = None):
        manifest = manifest or read_manifest(directory)
        self.directory, self.manifest = directory, manifest
        if not manifest["splits"].get(split, {}).get("shards"):
            hint = "prepare it with --eval-fraction F (e.g. 0.01)" if split == "eval" else "prepare it again"
            raise EmptySplit(f"data.path={directory}: the '{split}' split is empty; {hint}")
        dtype = np.dtype(manifest["dtype"])
        store, entries = storage.open_store(directory), manifest["splits"][split]["shards"]
        # each shard's checks are a few requests from a URL: many shards open concurrently
        with ThreadPoolExecutor(storage.OPEN_THREADS if storage.is_url(directory) else 1) as pool:
            self.shards = list(pool.map(lambda e: TokenFile(store, e, dtype, verify), entries))
        self.starts = np.cumsum([0] + [len(f.tokens) for f in self.shards]).tolist()
        self.doc_base = np.cumsum([0] + [len(f.offsets) - 1 for f in self.shards]).tolist()

    def __len__(self):
        return self.starts[-1]

    def document_starts(self) -> np.ndarray:
        """Each document's first token in the stream, then the stream's length (documents + 1 entries)."""
        return np.concatenate([np.asarray(f.offsets[:len(f.offsets) - 1]) + s
                               for f, s in zip(self.shards, self.starts)] + [[len(self)]])

    def pieces(self, start: int, stop: int):
        """(shard number k, its TokenFile, [lo, hi) in that shard) for each shard that stream
        tokens [start, stop) cross, in order."""
        k = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            lo, hi = start - self.starts[k], min(stop, self.starts[k + 1]) - self.starts[k]
            yield k, self.shards[k], lo, hi
            start += hi - lo
            k += 1

    def read(self, start: int, stop: int, vocab_size: int):
        """(tokens, document ids, positions in document) of stream tokens [start, stop), int64."""
        parts = []
        for k, shard, lo, hi in self.pieces(start, stop):
            tokens = shard.tokens[lo:hi]
            if tokens.max() >= vocab_size:
                raise ConfigError(f"{shard.name}: token id {int(tokens.max())} >= model.vocab_size={vocab_size}; "
                                  "the shard is corrupt or was prepared with another tokenizer")
            d0 = bisect.bisect_right(shard.offsets, lo) - 1
            d1 = bisect.bisect_right(shard.offsets, hi - 1) - 1
            bounds = shard.offsets[d0:d1 + 1]  # start offsets of the documents the range touches
            at = np.arange(lo, hi)
            doc = np.searchsorted(bounds, at, side="right") - 1
            parts.append((tokens.astype(np.int64), self.doc_base[k] + d0 + doc, at - bounds[doc]))
        return tuple(np.concatenate(p) for p in zip(*parts))

    def read_mask(self, start: int, stop: int) -> np.ndarray:
        """The loss mask (uint8) of stream tokens [start, stop): the shards' masks, ones where none."""
        return np.concatenate([np.ones(hi - lo, np.uint8) if shard.mask is None else shard.mask[lo:hi]
                               for _, shard, lo, hi in self.pieces(start, stop)])


class PackedWindows:
    """Window i of a TokenSplit: {tokens, segment_ids, positions, loss_mask}, each int32 of seq_len + 1."""

    def __init__(self, split: TokenSplit, window: int, vocab_size: int):
        self.split, self.window, self.vocab_size = split, window, vocab_size
        self.count = len(split) // window
        if self.count == 0:
            raise ConfigError(f"data.path={split.directory}: {len(split)} tokens, fewer than one window of "
                              f"data.seq_len + 1 = {window}; add data or lower data.seq_len")

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        tokens, docs, positions = self.split.read(i * self.window, (i + 1) * self.window, self.vocab_size)
        return {"tokens": tokens.astype(np.int32), "segment_ids": (docs - docs[0]).astype(np.int32),
                "positions": positions.astype(np.int32),
                "loss_mask": self.split.read_mask(i * self.window, (i + 1) * self.window).astype(np.int32)}


def windows(cfg: RunConfig, split: str, directory: str | None = None) -> PackedWindows:
    """Packed windows of `split` of data.path (or `directory`, a mixture entry)."""
    directory = directory or cfg.data.path
    manifest = read_manifest(directory)
    check_vocab(cfg, manifest, directory)
    token_split = TokenSplit(directory, split, cfg.data.verify, manifest)
    return PackedWindows(token_split, cfg.data.seq_len + 1, cfg.model.vocab_size)


def describe(opened: list[PackedWindows]) -> str:
    """One console line: the opened dataset(s), tokenizer vocabulary and padding of model.vocab_size."""
    lines = []
    for w in opened:
        m, vocab = w.split.manifest, w.vocab_size
        pad = f", model.vocab_size {vocab} pads it by {vocab - m['vocab_size']}" if vocab > m["vocab_size"] else ""
        chat = ", loss on the assistant's tokens (chat)" if m.get("loss_mask") else ""
        lines.append(f"{w.split.directory}: {m['splits']['train']['tokens']} train tokens, tokenizer vocab "
                     f"{m['vocab_size']}{pad}{chat}")
    return "data: " + "; ".join(lines)
