"""Prompts for train.objective=grpo: the documents of a prepared directory (`shardtrain prepare
PROMPTS.jsonl --text-field prompt --tokenizer TOK --out DIR`), each without its EOS.

Sample i is prompt i as {"tokens": int32 (seq_len + 1,) padded with 0, "length": its tokens}; the
training dataset (`grouped`) repeats each prompt grpo.group_size times in a row, after the
shuffle, so a step's batch of train.global_batch_size rows holds global_batch_size / group_size
prompts, each group whole. A prompt longer than data.seq_len + 1 - grpo.max_new_tokens tokens (no
room for its completion) is dropped; the console's data line counts them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shardtrain.config import ConfigError, RunConfig
from shardtrain.data import token_shards, tokenize


class Prompts:
    def __init__(self, split: token_shards.TokenSplit, window: int, room: int, vocab_size: int):
        self.split, self.window, self.vocab_size = split, window, vocab_size
        starts = np.concatenate([np.asarray(f.offsets[:len(f.offsets) - 1]) + s
                                 for f, s in zip(split.shards, split.starts)] + [[len(split)]])
        lengths = np.diff(starts) - 1  # without EOS
        self.kept = np.flatnonzero((lengths >= 1) & (lengths <= room))
        self.starts, self.lengths, self.dropped = starts[:-1], lengths, len(lengths) - len(self.kept)
        if not len(self.kept):
            raise ConfigError(f"data.path={split.directory}: none of its {len(lengths)} prompts leaves room for "
                              f"grpo.max_new_tokens in data.seq_len + 1 = {window} tokens; raise data.seq_len")
        m = split.manifest
        self.eos_id = m["eos_id"]
        self.tokenizer = (tokenize.load("bytes") if m.get("tokenizer") == "bytes"
                          else tokenize.load(str(Path(split.directory) / "tokenizer.json")))

    def __len__(self):
        return len(self.kept)

    def __getitem__(self, i):
        d = int(self.kept[i])
        start, n = int(self.starts[d]), int(self.lengths[d])
        tokens = np.zeros(self.window, np.int32)
        tokens[:n] = self.split.read(start, start + n, self.vocab_size)[0]
        return {"tokens": tokens, "length": np.int32(n)}


class Grouped:
    """Sample i of `ds` is ds[i // group] (a whole group of one prompt in consecutive rows)."""

    def __init__(self, ds, group: int):
        self.ds, self.group = ds, group

    def __getitem__(self, i):
        return self.ds[i // self.group]


def prompts(cfg: RunConfig, split: str) -> Prompts:
    manifest = token_shards.read_manifest(cfg.data.path)
    token_shards.check_vocab(cfg, manifest, cfg.data.path)
    window = cfg.data.seq_len + 1
    return Prompts(token_shards.TokenSplit(cfg.data.path, split, cfg.data.verify, manifest), window,
                   window - cfg.grpo.max_new_tokens, cfg.model.vocab_size)


def describe(opened: Prompts) -> str:
    return (f"data: {opened.split.directory}: {len(opened)} prompts, tokenizer vocab "
            f"{opened.split.manifest['vocab_size']}; {opened.dropped} without room for grpo.max_new_tokens dropped")
