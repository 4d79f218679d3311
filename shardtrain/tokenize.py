"""Tokenizers: Hugging Face `tokenizers` (a tokenizer.json, or a directory holding one) and the
built-in byte-level tokenizer (`bytes`: ids 0..255, the UTF-8 bytes, no EOS of its own).

EOS: the tokenizer's first special token among EOS_NAMES, else the one given with `--eos TOKEN`.
Special tokens: `prepare` encodes without them (a document's text is its tokens; EOS is appended,
and a chat template writes BOS itself); `generate` encodes a prompt with them
(add_special_tokens=True: Llama's BOS), as transformers does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shardtrain.config import ConfigError

EOS_NAMES = ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>")


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (the demo's tokenizer); EOS is an extra id 256."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.uint32) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


class HfTokenizer:
    """A `tokenizers.Tokenizer` loaded from a tokenizer.json. Without an EOS (and require_eos
    false, as generate reads a model's EOS from its config) eos_id is None."""

    def __init__(self, path: Path, eos: str | None = None, require_eos: bool = True):
        from tokenizers import Tokenizer
        self.path = path
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exceptions for bad JSON
            first = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
            raise ConfigError(f"--tokenizer {path}: not a tokenizers JSON file ({first})") from None
        self.name = str(path)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._eos_id(eos, require_eos)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def _eos_id(self, eos: str | None, required: bool = True) -> int | None:
        names = (eos,) if eos else EOS_NAMES
        for name in names:
            token_id = self.tok.token_to_id(name)
            if token_id is not None:
                return token_id
        if not required:
            return None
        if eos:
            raise ConfigError(f"--eos {eos}: no such token in {self.path}; give a token of its vocabulary")
        raise ConfigError(f"{self.path}: no EOS token ({', '.join(EOS_NAMES)}); name one with --eos TOKEN")

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[np.ndarray]:
        encodings = self.tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """One text's ids; add_special_tokens=True applies the tokenizer's post-processor (BOS)."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def tokenizer_file(spec: str) -> Path:
    """The tokenizer.json of `spec` (a file, or a directory that holds one)."""
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"--tokenizer {spec}: no tokenizer file there; give a tokenizer.json or a directory "
                          "holding one (or `bytes`)")
    return path


def load(spec: str, eos: str | None = None) -> ByteTokenizer | HfTokenizer:
    """`bytes`, a tokenizer.json path, or a directory holding one."""
    if spec == "bytes":
        return ByteTokenizer()
    return HfTokenizer(tokenizer_file(spec), eos)
