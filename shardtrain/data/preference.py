"""Preference pairs: `shardtrain prepare --preference` writes them, DPO reads them.

A row of the input JSONL is {"prompt", "chosen", "rejected"}: three strings, or chat message
lists (the prompt's messages, and each completion an assistant message list or a string) rendered
through the tokenizer's chat template as `--chat` does. Each row becomes two consecutive
documents of the token shards, prompt + chosen + EOS and prompt + rejected + EOS, with a loss mask
of 1 on exactly the completion's tokens and its EOS (the prompt's are 0). A row goes wholly to
one split, so its two documents stay together.

Training reads pair i as one sample: both sequences, each padded to data.seq_len + 1 tokens (pad
id 0, mask 0), so a row's chosen and rejected always sit in the same batch, in the same row.
Over-long rows: a row whose longer document is more than data.seq_len + 1 tokens is dropped
whole (never cut: a cut completion would be preferred for a reason the data does not say); the
console's data line counts them, and a split all of whose rows are too long is refused.
"""

from __future__ import annotations

import numpy as np

from shardtrain.config import ConfigError, RunConfig
from shardtrain.data import chat, token_shards, tokenize

FIELDS = ("prompt", "chosen", "rejected")
PAIR_FIELDS = ("chosen", "chosen_mask", "rejected", "rejected_mask")
"""A preference sample: int32 (seq_len + 1,) each."""


def _text(value) -> bool:
    return isinstance(value, str)


def _messages(value, where: str, name: str) -> list[dict]:
    """A completion as assistant messages: a string is one assistant message."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                 for m in value):
        return value
    raise ConfigError(f"{where}: '{name}' must be a string or a list of {{role, content}} messages")


def split_row(row, where: str, template) -> tuple[str, str, str]:
    """(prompt text, chosen text, rejected text) of one row; chat lists through `template` (a
    chat.ChatTemplate; None when the tokenizer has none): the prompt with the generation prompt, a
    completion as what the full conversation adds to it."""
    missing = [f for f in FIELDS if not isinstance(row, dict) or f not in row]
    if missing:
        have = ", ".join(row) if isinstance(row, dict) else type(row).__name__
        raise ConfigError(f"{where}: no {', '.join(repr(f) for f in missing)} (has: {have}); each line of "
                          'prepare --preference is {"prompt": ..., "chosen": ..., "rejected": ...}')
    if all(_text(row[f]) for f in FIELDS):
        return row["prompt"], row["chosen"], row["rejected"]
    if template is None:
        raise ConfigError(f"{where}: chat message lists need a Hugging Face tokenizer with a chat template; give "
                          "strings, or --tokenizer a directory with one")
    prompt = row["prompt"] if isinstance(row["prompt"], list) else [{"role": "user", "content": row["prompt"]}]
    chat.check_messages({"messages": prompt + [{"role": "assistant", "content": ""}]}, where)
    head = template.prompt(prompt, where)
    completions = []
    for name in ("chosen", "rejected"):
        full = template.render(prompt + _messages(row[name], where, name), where)[0]
        if not full.startswith(head):
            raise ConfigError(f"{where}: the chat template does not render the prompt as a prefix of the prompt + "
                              f"'{name}' conversation, so the completion's tokens are unknown")
        completions.append(full[len(head):])
    return head, completions[0], completions[1]


def chat_template(spec: str, tok):
    """The tokenizer's chat template (chat.ChatTemplate), None for `bytes` or a tokenizer without one."""
    if not isinstance(tok, tokenize.HfTokenizer):
        return None
    try:
        return chat.ChatTemplate(tokenize.tokenizer_file(spec).parent, tok)
    except ConfigError:
        return None


def encode_row(tok, row, where: str, template=None) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(ids, mask) of prompt + chosen + EOS, the same of rejected]: mask 1 on the completion and EOS.
    The prompt and each completion are encoded apart (the mask's boundary is a token boundary)."""
    prompt, chosen, rejected = split_row(row, where, template)
    p, c, r = tok.encode_batch([prompt, chosen, rejected])
    eos = np.asarray([tok.eos_id], np.uint32)
    return [(np.concatenate([p, x, eos]).astype(np.uint32),
             np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(x) + 1, np.uint8)])) for x in (c, r)]


class PreferencePairs:
    """Pair i of a prepared preference split: {chosen, chosen_mask, rejected, rejected_mask}, each
    int32 of seq_len + 1 (padded with 0); rows longer than that are dropped (`dropped` counts them)."""

    def __init__(self, split: token_shards.TokenSplit, window: int, vocab_size: int):
        self.split, self.window, self.vocab_size = split, window, vocab_size
        offsets = split.document_starts()
        lengths = np.diff(offsets)
        if len(lengths) % 2:
            raise ConfigError(f"data.path={split.directory}: an odd number of documents in a preference split; "
                              "rerun `shardtrain prepare --preference`")
        longer = np.maximum(lengths[0::2], lengths[1::2])
        self.starts, self.lengths = offsets[:-1], lengths
        self.rows = np.flatnonzero(longer <= window)
        self.dropped = len(longer) - len(self.rows)
        if not len(self.rows):
            raise ConfigError(f"data.path={split.directory}: every one of its {len(longer)} preference rows is longer "
                              f"than data.seq_len + 1 = {window} tokens (the longest {int(longer.max())}); raise "
                              "data.seq_len")

    def __len__(self):
        return len(self.rows)

    def _document(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        start, n = int(self.starts[d]), int(self.lengths[d])
        tokens = self.split.read(start, start + n, self.vocab_size)[0]
        ids, mask = np.zeros(self.window, np.int32), np.zeros(self.window, np.int32)
        ids[:n], mask[:n] = tokens, self.split.read_mask(start, start + n)
        return ids, mask

    def __getitem__(self, i):
        row = int(self.rows[i])
        (c, cm), (r, rm) = self._document(2 * row), self._document(2 * row + 1)
        return {"chosen": c, "chosen_mask": cm, "rejected": r, "rejected_mask": rm}


def pairs(cfg: RunConfig, split: str) -> PreferencePairs:
    """The preference pairs of `split` of data.path."""
    manifest = token_shards.read_manifest(cfg.data.path)
    if not manifest.get("preference"):
        raise ConfigError(f"train.objective=dpo reads preference pairs: data.path={cfg.data.path} was not prepared "
                          "with `shardtrain prepare ... --preference`")
    token_shards.check_vocab(cfg, manifest, cfg.data.path)
    return PreferencePairs(token_shards.TokenSplit(cfg.data.path, split, cfg.data.verify, manifest),
                           cfg.data.seq_len + 1, cfg.model.vocab_size)


def describe(opened: PreferencePairs) -> str:
    m = opened.split.manifest
    return (f"data: {opened.split.directory}: {len(opened)} preference pairs (chosen and rejected), tokenizer vocab "
            f"{m['vocab_size']}; {opened.dropped} rows longer than data.seq_len + 1 = {opened.window} tokens dropped")

