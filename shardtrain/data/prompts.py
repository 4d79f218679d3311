"""Prompts for train.objective=grpo, from either
  - a prepared directory (`shardtrain prepare PROMPTS.jsonl --text-field prompt --tokenizer TOK
    --out DIR`, data.source=tokens): each document without its EOS; the reward's row is
    {"prompt": its text};
  - a JSONL file as data.path, one {"prompt": TEXT, ...} per line: the prompt is tokenized with the
    model's tokenizer (checkpoint.init_from's or the resumed run's; `bytes` for a byte-level model),
    and the reward gets the whole row, so a verifiable reward can read e.g. an "answer" field.

Sample i is prompt i as {"tokens": int32 (seq_len + 1,) padded with 0, "length": its tokens,
"index": its row}; the training dataset (`Grouped`) repeats each prompt grpo.group_size times in a
row, after the shuffle, so a step's batch of train.global_batch_size rows holds global_batch_size /
group_size prompts, each group whole. A prompt longer than data.seq_len + 1 - grpo.max_new_tokens
tokens (no room for its completion) is dropped; the console's data line counts them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from shardtrain.config import ConfigError, RunConfig
from shardtrain.data import token_shards, tokenize


def is_jsonl(cfg: RunConfig) -> bool:
    return str(cfg.data.path or "").endswith(".jsonl")


class Prompts:
    """The prompts of `lengths` (tokens each) that leave room: `kept`, `dropped`; subclasses read them."""

    def __init__(self, where: str, lengths: np.ndarray, window: int, room: int):
        self.where, self.window = where, window
        self.kept = np.flatnonzero((lengths >= 1) & (lengths <= room))
        self.lengths, self.dropped = lengths, len(lengths) - len(self.kept)
        if not len(self.kept):
            raise ConfigError(f"data.path={where}: none of its {len(lengths)} prompts leaves room for "
                              f"grpo.max_new_tokens in data.seq_len + 1 = {window} tokens; raise data.seq_len")

    def __len__(self):
        return len(self.kept)

    def __getitem__(self, i):
        d = int(self.kept[i])
        tokens = np.zeros(self.window, np.int32)
        ids = self.ids(d)
        tokens[:len(ids)] = ids
        return {"tokens": tokens, "length": np.int32(len(ids)), "index": np.int32(d)}

    def describe(self) -> str:
        return (f"data: {self.where}: {len(self)} prompts; {self.dropped} without room for grpo.max_new_tokens "
                "dropped")


class PreparedPrompts(Prompts):
    def __init__(self, split: token_shards.TokenSplit, window: int, room: int, vocab_size: int):
        self.split, self.vocab_size = split, vocab_size
        starts = split.document_starts()
        super().__init__(split.directory, np.diff(starts) - 1, window, room)  # without EOS
        self.starts, m = starts[:-1], split.manifest
        self.eos_id = m["eos_id"]
        self.tokenizer = (tokenize.load("bytes") if m.get("tokenizer") == "bytes"
                          else tokenize.load(str(Path(split.directory) / "tokenizer.json")))

    def ids(self, d: int) -> np.ndarray:
        start = int(self.starts[d])
        return self.split.read(start, start + int(self.lengths[d]), self.vocab_size)[0]

    def row(self, d: int) -> dict:
        return {"prompt": self.tokenizer.decode(self.ids(d))}


class JsonlPrompts(Prompts):
    def __init__(self, path: str, tokenizer, window: int, room: int):
        self.rows = []
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise ConfigError(f"{path}:{n}: not valid JSON; each line must be one JSON object") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ConfigError(f'{path}:{n}: no string field "prompt"; each line is {{"prompt": TEXT, ...}}')
            self.rows.append(row)
        self.tokenizer, self.eos_id = tokenizer, tokenizer.eos_id
        self.encoded = tokenizer.encode_batch([r["prompt"] for r in self.rows])
        super().__init__(path, np.array([len(x) for x in self.encoded]), window, room)

    def ids(self, d: int) -> np.ndarray:
        return self.encoded[d]

    def row(self, d: int) -> dict:
        return self.rows[d]


class Grouped:
    """Sample i of `ds` is ds[i // group] (a whole group of one prompt in consecutive rows)."""

    def __init__(self, ds, group: int):
        self.ds, self.group = ds, group

    def __getitem__(self, i):
        return self.ds[i // self.group]


def prompts(cfg: RunConfig, split: str, tokenizer=None) -> Prompts:
    """The prompts of data.path: a JSONL file (tokenized by `tokenizer`, the model's) or a prepared directory."""
    window = cfg.data.seq_len + 1
    room = window - cfg.grpo.max_new_tokens
    if is_jsonl(cfg):
        if not Path(cfg.data.path).is_file():
            raise ConfigError(f"data.path={cfg.data.path}: no such file")
        return JsonlPrompts(cfg.data.path, tokenizer, window, room)
    manifest = token_shards.read_manifest(cfg.data.path)
    token_shards.check_vocab(cfg, manifest, cfg.data.path)
    return PreparedPrompts(token_shards.TokenSplit(cfg.data.path, split, cfg.data.verify, manifest), window, room,
                           cfg.model.vocab_size)
