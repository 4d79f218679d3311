"""The `tokens` data source: shards written by `shardtrain prepare`, read by byte range.

A split's shards are one concatenated token stream; window i is tokens [i W, (i+1) W) with
W = seq_len + 1, crossing document and shard boundaries (packing). Each window comes with
  segment_ids  the document of each token, counted from 0 at the window's first token
  positions    each token's offset inside its document (0 at a document's first token; a
               document that began in an earlier window continues its count)
  loss_mask    1 where the token is one the loss predicts: the mask `prepare --chat` wrote (the
               assistant's tokens), all ones for other data
The training loss masks position t (input token t predicting token t+1) when the two belong to
different documents: the input is a document's EOS and the target the next document's first
token. EOS itself is predicted (from the document's last token). It also masks position t when
loss_mask[t + 1] is 0 (a prompt token of a conversation).

Reads use os.pread on the shard and its document index (a binary search over the index reads
~log2(documents) 8-byte values), never a memory map: what a host holds is its batch, not
the pages of a corpus it has walked through, so memory stays flat however large the corpus.
Only local paths (or a gcsfuse mount) are read; gs:// URLs are refused with that advice.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from shardtrain.config import ConfigError, RunConfig


class RangeFile:
    """A flat array in a file (from byte `offset`), read element ranges at a time with pread."""

    def __init__(self, path: Path, dtype, offset: int, length: int):
        self.path, self.dtype, self.offset, self.length = path, np.dtype(dtype), offset, length
        self.fd = os.open(path, os.O_RDONLY)

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, _ = index.indices(self.length)
            size = self.dtype.itemsize
            data = os.pread(self.fd, (stop - start) * size, self.offset + start * size)
            return np.frombuffer(data, dtype=self.dtype)
        return int(self[index:index + 1][0])

    def __del__(self):
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)

    def __getstate__(self):  # reopened by whoever unpickles it
        return {k: v for k, v in self.__dict__.items() if k != "fd"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.fd = os.open(self.path, os.O_RDONLY)


def npy_range(path: Path) -> RangeFile:
    """The array of a .npy file, read by range."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(f)
        return RangeFile(path, dtype, f.tell(), shape[0])


def read_manifest(directory: str) -> dict:
    if directory.startswith("gs://"):
        raise ConfigError(f"data.path={directory}: token shards are read from local disk only; copy the "
                          "directory down (gcloud storage cp -r) or mount the bucket with gcsfuse and give that path")
    path = Path(directory) / "manifest.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"data.path={directory}: no manifest.json there; write one with "
                          f"`shardtrain prepare INPUT... --tokenizer TOK --out {directory}`") from None
    except ValueError:
        raise ConfigError(f"{path}: not valid JSON; rerun `shardtrain prepare` into {directory}") from None


def check_vocab(cfg: RunConfig, manifest: dict, directory: str) -> None:
    """model.vocab_size must hold the tokenizer's ids; a larger (padded) vocabulary is allowed."""
    n = manifest["vocab_size"]
    if cfg.model.vocab_size < n:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {n} tokens "
                          f"({directory}/manifest.json); set model.vocab_size={n} or more")


class Shard:
    def __init__(self, directory: Path, entry: dict, dtype: np.dtype, verify: str):
        path = directory / entry["file"]
        self.name = str(path)
        redo = f"rerun `shardtrain prepare` into {directory} after deleting {directory}/parts/{path.stem}.json"
        if not path.is_file():
            raise ConfigError(f"{path}: shard listed in manifest.json is missing; {redo}")
        want = entry["tokens"] * dtype.itemsize
        if path.stat().st_size != want:
            raise ConfigError(f"{path}: {path.stat().st_size} bytes, manifest.json says {want}; the shard is "
                              f"truncated or corrupt: {redo}")
        if verify == "checksum":
            sha = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    sha.update(chunk)
            if sha.hexdigest() != entry["sha256"]:
                raise ConfigError(f"{path}: sha256 does not match manifest.json; the shard is corrupt: {redo}")
        index = directory / entry["index"]
        if not index.is_file():
            raise ConfigError(f"{index}: document index listed in manifest.json is missing; {redo}")
        self.tokens = RangeFile(path, dtype, 0, entry["tokens"])
        self.mask = None
        if "mask" in entry:  # prepare --chat: uint8 per token
            mask = directory / entry["mask"]
            if not mask.is_file() or mask.stat().st_size != entry["tokens"]:
                raise ConfigError(f"{mask}: loss mask listed in manifest.json is missing or not one byte per token; "
                                  f"{redo}")
            self.mask = RangeFile(mask, np.uint8, 0, entry["tokens"])
        self.offsets = npy_range(index)
        if len(self.offsets) != entry["documents"] + 1 or self.offsets[len(self.offsets) - 1] != entry["tokens"]:
            raise ConfigError(f"{index}: does not match manifest.json ({entry['documents']} documents, "
                              f"{entry['tokens']} tokens); {redo}")


class TokenSplit:
    """One split (train / eval) of a prepared directory as one stream of tokens."""

    def __init__(self, directory: str, split: str, verify: str = "size"):
        manifest = read_manifest(directory)
        self.directory, self.manifest = directory, manifest
        if not manifest["splits"].get(split, {}).get("shards"):
            hint = ("prepare it with --eval-fraction F (e.g. 0.01) or set train.eval_every=0" if split == "eval"
                    else "prepare it again")
            raise ConfigError(f"data.path={directory}: the '{split}' split is empty; {hint}")
        dtype = np.dtype(manifest["dtype"])
        self.shards = [Shard(Path(directory), e, dtype, verify) for e in manifest["splits"][split]["shards"]]
        self.starts = np.cumsum([0] + [len(s.tokens) for s in self.shards]).tolist()
        self.doc_base = np.cumsum([0] + [len(s.offsets) - 1 for s in self.shards]).tolist()

    def __len__(self):
        return self.starts[-1]

    def read(self, start: int, stop: int, vocab_size: int):
        """(tokens, document ids, positions in document) of stream tokens [start, stop), int64."""
        parts = []
        k = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            shard = self.shards[k]
            lo, hi = start - self.starts[k], min(stop, self.starts[k + 1]) - self.starts[k]
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
            start += hi - lo
            k += 1
        return tuple(np.concatenate(p) for p in zip(*parts))

    def read_mask(self, start: int, stop: int) -> np.ndarray:
        """The loss mask (uint8) of stream tokens [start, stop): the shards' masks, ones where none."""
        parts = []
        k = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            shard = self.shards[k]
            lo, hi = start - self.starts[k], min(stop, self.starts[k + 1]) - self.starts[k]
            parts.append(np.ones(hi - lo, np.uint8) if shard.mask is None else shard.mask[lo:hi])
            start += hi - lo
            k += 1
        return np.concatenate(parts)


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
    check_vocab(cfg, read_manifest(directory), directory)
    token_split = TokenSplit(directory, split, cfg.data.verify)
    return PackedWindows(token_split, cfg.data.seq_len + 1, cfg.model.vocab_size)


def describe(cfg: RunConfig) -> str:
    """One console line: the dataset(s), tokenizer vocabulary and padding of model.vocab_size."""
    dirs = [e.path for e in cfg.data.mixture] or [cfg.data.path]
    lines = []
    for d in dirs:
        m = read_manifest(d)
        pad = (f", model.vocab_size {cfg.model.vocab_size} pads it by {cfg.model.vocab_size - m['vocab_size']}"
               if cfg.model.vocab_size > m["vocab_size"] else "")
        chat = ", loss on the assistant's tokens (chat)" if m.get("loss_mask") else ""
        lines.append(f"{d}: {m['splits']['train']['tokens']} train tokens, tokenizer vocab {m['vocab_size']}"
                     f"{pad}{chat}")
    return "data: " + "; ".join(lines)
