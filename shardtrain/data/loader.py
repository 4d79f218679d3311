"""Deterministic, seeded grain pipelines of token windows.

Sample `i` of the (infinite, epoch-reshuffled) dataset is a function of (seed, i) only, and the
batch of step `s` is samples [s*B, (s+1)*B). Each process reads just the rows of the global
batch its devices hold, so resuming on any number of processes continues at the same sample.

Sources (data.source):
  text       byte tokens of text files; the last 1/20 of the windows are the `eval` split. A file
             that is not text, or a `prepare` output, is refused (it would train on its bytes).
  synthetic  seeded arithmetic sequences; `eval` draws them from another seed.
  tokens     token files written by `shardtrain prepare` (token_shards.py), read by range: documents
             (each ending in EOS) concatenated and cut into windows of seq_len + 1 tokens. A
             sample is then a dict {tokens, segment_ids, positions, loss_mask} (see PackedWindows);
             with train.objective=dpo, a preference pair (preference.py).
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import grain
import numpy as np

from shardtrain.config import ConfigError, DataConfig, RunConfig
from shardtrain.data import preference, prompts, storage, token_shards, tokenize

DATA_PATH_TO_FILL_IN = "PREPARED_DATA_DIR"
"""data.path of the config import-hf writes: a placeholder the user replaces with a prepared directory."""
EVAL_TEXT_WINDOWS = 20
"""The bytes `text` source holds out its last 1/EVAL_TEXT_WINDOWS windows as the eval split."""


def load_corpus(cfg: DataConfig) -> tuple[np.ndarray, int]:
    """(the bytes of data.path's files joined by newlines, the number of files); without a path the
    standard library's *.py files, the demo's corpus. A `prepare` output or a file that is not text
    is refused (ConfigError naming it)."""
    stdlib = os.path.join(sysconfig.get_paths()["stdlib"], "*.py")
    files = storage.find_files(stdlib if cfg.path is None else cfg.path)
    if not files:
        raise ConfigError(f"data.path: no files found at '{cfg.path}'; give a directory or a glob of text files")
    refuse_prepared(cfg.path, files)
    texts = [Path(f).read_bytes() for f in files]
    for f, data in zip(files, texts):
        problem = storage.text_problem(data)
        if problem:
            raise ConfigError(f"data.path={cfg.path}: {f} is not text ({problem}); data.source=text reads text "
                              "files only: give a glob of them (e.g. 'DIR/**/*.txt')")
    corpus = np.frombuffer(b"\n".join(texts), dtype=np.uint8)
    if len(corpus) < 2 * EVAL_TEXT_WINDOWS * (cfg.seq_len + 1):
        raise ConfigError(f"data.path: only {len(corpus)} bytes of text, need at least "
                          f"{2 * EVAL_TEXT_WINDOWS * (cfg.seq_len + 1)}")
    return corpus, len(files)


def refuse_prepared(path: str | None, files: list[str]) -> None:
    """ConfigError when the text source's files hold a `shardtrain prepare` output (its manifest.json)."""
    for f in files:
        if Path(f).name != "manifest.json":
            continue
        try:
            prepared = str(json.loads(Path(f).read_text()).get("format", "")).startswith("shardtrain-tokens")
        except (ValueError, AttributeError, UnicodeDecodeError):
            prepared = False
        if prepared:
            where = Path(f).parent
            what = "is a `shardtrain prepare` output" if Path(path or "") == where else \
                f"holds a `shardtrain prepare` output, {where}"
            raise ConfigError(f"data.path={path} {what} (token files, not text); train on it with "
                              f"data.source=tokens data.path={where}")


class TextWindows:
    """Non-overlapping windows of seq_len + 1 byte tokens (inputs and shifted targets): split
    `train` is all but the last 1/EVAL_TEXT_WINDOWS of them, `eval` those."""

    def __init__(self, corpus: np.ndarray, window: int, split: str = "train", files: int = 0):
        self.corpus, self.window, self.files = corpus, window, files
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
        corpus, files = load_corpus(cfg.data)
        return TextWindows(corpus, window, split, files)
    if cfg.data.source == "synthetic":
        return SyntheticSequences(cfg.train.seed + (split == "eval"), window, cfg.model.vocab_size)
    return token_shards.windows(cfg, split)


def sources(cfg: RunConfig, split: str = "train") -> list:
    """The source of `split`, or a mixture's, one per entry (each dataset opened once)."""
    if cfg.data.source == "tokens" and Path(cfg.data.path or "").name == DATA_PATH_TO_FILL_IN \
            and not Path(cfg.data.path).exists():
        tokenizer = cfg.checkpoint.init_from or "TOKENIZER"
        raise ConfigError(f"data.path: {DATA_PATH_TO_FILL_IN} is a placeholder to fill in: tokenize your data with "
                          f"`shardtrain prepare INPUT... --tokenizer {tokenizer} --out DIR` (add --chat for "
                          "conversations), then set data.path: DIR in the config or pass data.path=DIR")
    if cfg.data.mixture:
        return [token_shards.windows(cfg, split, entry.path) for entry in cfg.data.mixture]
    if cfg.train.objective == "dpo":
        return [preference.pairs(cfg, split)]
    if cfg.train.objective == "grpo":  # a JSONL's prompts need the model's tokenizer: loop.py opens them
        return [] if prompts.is_jsonl(cfg) else [prompts.prompts(cfg, split)]
    return [source(cfg, split)]


def tokenizers(cfg: RunConfig, opened: list) -> list[tuple[str, str]]:
    """(which data, the fingerprint of its tokenizer) of each opened source: the text source's bytes,
    each prepared directory's own (where known); synthetic data has none."""
    if cfg.train.objective == "grpo" and prompts.is_jsonl(cfg):
        return []  # tokenized with the model's own tokenizer
    if cfg.data.source == "text":
        return [("data.source=text", tokenize.BYTES)]
    if not packed(cfg):
        return []
    found = [(f"data.path={w.split.directory}", token_shards.tokenizer_fingerprint(w.split.manifest, w.split.directory))
             for w in opened]
    return [(where, fp) for where, fp in found if fp]


def samples(cfg: RunConfig, opened: list | None = None) -> grain.MapDataset:
    """The infinite training dataset, sample i a function of (seed, i), from `opened` (default:
    `sources(cfg)`). A mixture: each dataset shuffled and repeated on its own, then interleaved
    by weight (grain's deterministic mix)."""
    parts = [grain.MapDataset.source(s).shuffle(seed=cfg.train.seed + k).repeat()
             for k, s in enumerate(opened or sources(cfg))]
    if cfg.train.objective == "grpo":  # each prompt group_size times in a row
        return prompts.Grouped(parts[0], cfg.grpo.group_size)
    return grain.MapDataset.mix(parts, [e.weight for e in cfg.data.mixture]) if cfg.data.mixture else parts[0]


def eval_samples(cfg: RunConfig, opened: list | None = None) -> grain.MapDataset:
    """The held-out windows in order (repeated if a pass needs more than the split holds); a
    mixture's eval splits interleaved by the same weights. `opened`: `sources(cfg, "eval")`."""
    parts = [grain.MapDataset.source(s).repeat() for s in opened or sources(cfg, "eval")]
    return grain.MapDataset.mix(parts, [e.weight for e in cfg.data.mixture]) if cfg.data.mixture else parts[0]


def describe(cfg: RunConfig, opened: list) -> str:
    """The console line saying what a run trains on (every source has one)."""
    if cfg.train.objective == "dpo":
        return preference.describe(opened[0])
    if cfg.train.objective == "grpo":
        return opened[0].describe()
    if packed(cfg):
        return token_shards.describe(opened)
    if cfg.data.source == "synthetic":
        return (f"data: synthetic arithmetic sequences modulo model.vocab_size={cfg.model.vocab_size} "
                f"(seed {cfg.train.seed}), no files")
    text = opened[0]
    where = f"in {cfg.data.path}" if cfg.data.path else "(the Python standard library's *.py)"
    return (f"data: text bytes (ids 0..255) of {text.files} file{'s' * (text.files != 1)} {where}: "
            f"{len(text.corpus)} bytes, "
            f"{len(text)} train windows, the last 1/{EVAL_TEXT_WINDOWS} held out for eval")


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
