"""Deterministic, seeded grain pipelines of token windows.

Sample `i` of the (infinite, epoch-reshuffled) dataset is a function of (seed, i) only, and the
batch of step `s` is samples [s*B, (s+1)*B). Each process reads just the rows of the global
batch its devices hold, so resuming on any number of processes continues at the same sample.

Sources (data.source):
  text       byte tokens of text files; the last 1/20 of the windows are the `eval` split.
  synthetic  seeded arithmetic sequences; `eval` draws them from another seed.
  tokens     token files written by `shardtrain prepare` (token_shards.py), read by range: documents
             (each ending in EOS) concatenated and cut into windows of seq_len + 1 tokens. A
             sample is then a dict {tokens, segment_ids, positions, loss_mask} (see PackedWindows).
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import grain
import numpy as np

from shardtrain.config import ConfigError, DataConfig, RunConfig
from shardtrain.data import storage, token_shards

EVAL_TEXT_WINDOWS = 20
"""The bytes `text` source holds out its last 1/EVAL_TEXT_WINDOWS windows as the eval split."""


def load_corpus(cfg: DataConfig) -> np.ndarray:
    """The bytes of data.path's files joined by newlines (without a path: the standard library's
    *.py files, the demo's corpus)."""
    stdlib = os.path.join(sysconfig.get_paths()["stdlib"], "*.py")
    files = storage.find_files(stdlib if cfg.path is None else cfg.path)
    if not files:
        raise ConfigError(f"data.path: no files found at '{cfg.path}'; give a directory or a glob of text files")
    corpus = np.frombuffer(b"\n".join(Path(f).read_bytes() for f in files), dtype=np.uint8)
    if len(corpus) < 2 * EVAL_TEXT_WINDOWS * (cfg.seq_len + 1):
        raise ConfigError(f"data.path: only {len(corpus)} bytes of text, need at least "
                          f"{2 * EVAL_TEXT_WINDOWS * (cfg.seq_len + 1)}")
    return corpus


class TextWindows:
    """Non-overlapping windows of seq_len + 1 byte tokens (inputs and shifted targets): split
    `train` is all but the last 1/EVAL_TEXT_WINDOWS of them, `eval` those."""

    def __init__(self, corpus: np.ndarray, window: int, split: str = "train"):
        self.corpus, self.window = corpus, window
        total = len(corpus) // window
        held = max(1, total // EVAL_TEXT_WINDOWS)
        self.first, self.count = (0, total - held) if split == "train" else (total - held, held)

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        i += self.first
        return self.corpus[i * self.window:(i + 1) * self.window].astype(np.int32)


class SyntheticSequences:
    """Seeded arithmetic sequences modulo the vocabulary: learnable, no files needed."""

    def __init__(self, seed: int, window: int, vocab: int):
        self.seed, self.window, self.vocab = seed, window, vocab

    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        start, stride = np.random.default_rng([self.seed, i]).integers(0, self.vocab, size=2)
        return ((start + stride * np.arange(self.window)) % self.vocab).astype(np.int32)


def packed(cfg: RunConfig) -> bool:
    """Whether samples are dicts {tokens, segment_ids, positions, loss_mask} (packed documents)."""
    return cfg.data.source == "tokens"


def source(cfg: RunConfig, split: str = "train"):
    """The random-access source of `split` windows (train or eval)."""
    window = cfg.data.seq_len + 1
    if cfg.data.source == "text":
        return TextWindows(load_corpus(cfg.data), window, split)
    if cfg.data.source == "synthetic":
        return SyntheticSequences(cfg.train.seed + (split == "eval"), window, cfg.model.vocab_size)
    return token_shards.windows(cfg, split)


def sources(cfg: RunConfig, split: str = "train") -> list:
    """The source of `split`, or a mixture's, one per entry (each dataset opened once)."""
    if cfg.data.mixture:
        return [token_shards.windows(cfg, split, entry.path) for entry in cfg.data.mixture]
    return [source(cfg, split)]


def samples(cfg: RunConfig, opened: list | None = None) -> grain.MapDataset:
    """The infinite training dataset, sample i a function of (seed, i), from `opened` (default:
    `sources(cfg)`). A mixture: each dataset shuffled and repeated on its own, then interleaved
    by weight (grain's deterministic mix)."""
    parts = [grain.MapDataset.source(s).shuffle(seed=cfg.train.seed + k).repeat()
             for k, s in enumerate(opened or sources(cfg))]
    return grain.MapDataset.mix(parts, [e.weight for e in cfg.data.mixture]) if cfg.data.mixture else parts[0]


def eval_samples(cfg: RunConfig) -> grain.MapDataset:
    """The held-out windows in order (repeated if a pass needs more than the split holds); a
    mixture's eval splits interleaved by the same weights."""
    parts = [grain.MapDataset.source(s).repeat() for s in sources(cfg, "eval")]
    return grain.MapDataset.mix(parts, [e.weight for e in cfg.data.mixture]) if cfg.data.mixture else parts[0]


def stack(items: list):
    """Samples -> one batch: an int array, or a dict of them for packed samples."""
    if isinstance(items[0], dict):
        return {k: np.stack([x[k] for x in items]) for k in items[0]}
    return np.stack(items)


REMOTE_READ_THREADS = 16
"""Steps read at once from a gs:// (or other URL) data.path: each window is a ranged request of
tens of ms, so one thread would read a host's 32 rows in about a second."""


def read_threads(cfg: RunConfig) -> int:
    """Threads that read batches ahead: REMOTE_READ_THREADS when data comes from a URL, else 1."""
    paths = [e.path for e in cfg.data.mixture] or [cfg.data.path or ""]
    return REMOTE_READ_THREADS if cfg.data.source == "tokens" and any(map(storage.is_url, paths)) else 1


def batches(ds: grain.MapDataset, batch_size: int, rows: slice, start_step: int, end_step: int, threads: int = 1):
    """Iterator of (step, rows `rows` of that step's global batch of `batch_size` samples from
    `ds`: an int32 array, or a dict of them), prefetched in order by `threads` background threads."""
    b = batch_size
    steps = grain.MapDataset.range(start_step, end_step).map(
        lambda s: (s, stack([ds[s * b + r] for r in range(rows.start, rows.stop)])))
    return iter(steps.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=max(4, threads))))
