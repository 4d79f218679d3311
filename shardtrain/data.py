"""Deterministic, seeded grain pipelines of token windows.

Sample `i` of the (infinite, epoch-reshuffled) dataset is a function of (seed, i) only, and the
batch of step `s` is samples [s*B, (s+1)*B). Each process reads just the rows of the global
batch its devices hold, so resuming on any number of processes continues at the same sample.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path

import grain
import numpy as np

from shardtrain.config import ConfigError, DataConfig, RunConfig


def text_files(path: str | None) -> list[str]:
    if path is None:
        return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    if Path(path).is_dir():
        return sorted(str(p) for p in Path(path).rglob("*") if p.is_file())
    return sorted(glob.glob(path, recursive=True))


def load_corpus(cfg: DataConfig) -> np.ndarray:
    files = text_files(cfg.path)
    if not files:
        raise ConfigError(f"data.path: no files found at '{cfg.path}'; give a directory or a glob of text files")
    corpus = np.frombuffer(b"\n".join(Path(f).read_bytes() for f in files), dtype=np.uint8)
    if len(corpus) < 2 * (cfg.seq_len + 1):
        raise ConfigError(f"data.path: only {len(corpus)} bytes of text, need at least {2 * (cfg.seq_len + 1)}")
    return corpus


class TextWindows:
    """Non-overlapping windows of seq_len + 1 byte tokens (inputs and shifted targets)."""

    def __init__(self, corpus: np.ndarray, window: int):
        self.corpus, self.window = corpus, window

    def __len__(self):
        return len(self.corpus) // self.window

    def __getitem__(self, i):
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


def samples(cfg: RunConfig) -> grain.MapDataset:
    """The infinite dataset of samples, sample i a function of (seed, i)."""
    window = cfg.data.seq_len + 1
    if cfg.data.source == "text":
        source = TextWindows(load_corpus(cfg.data), window)
    else:
        source = SyntheticSequences(cfg.train.seed, window, cfg.model.vocab_size)
    return grain.MapDataset.source(source).shuffle(seed=cfg.train.seed).repeat()


def batches(ds: grain.MapDataset, batch_size: int, rows: slice, start_step: int, end_step: int):
    """Iterator of (step, int32 array of rows `rows` of that step's global batch of `batch_size`
    samples from `ds`), prefetched in a background thread."""
    b = batch_size
    steps = grain.MapDataset.range(start_step, end_step).map(
        lambda s: (s, np.stack([ds[s * b + r] for r in range(rows.start, rows.stop)])))
    return iter(steps.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)))
