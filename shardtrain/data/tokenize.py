"""Tokenizers: Hugging Face `tokenizers` (a tokenizer.json, or a directory holding one), the
built-in byte-level tokenizer (`bytes`: ids 0..255, the UTF-8 bytes, no EOS of its own), and two
vocabularies converted to a `tokenizers.Tokenizer` when loaded (the `convert` extra: transformers'
converters), which `prepare` then saves as the dataset's tokenizer.json:
  sentencepiece  a `tokenizer.model` protobuf (BPE or unigram; Llama 1/2, Mistral, Gemma, T5):
                 the same ids as sentencepiece's own encode, byte fallback included
  tiktoken       a BPE ranks file (lines "BASE64 RANK"; Llama 3's original/tokenizer.model,
                 *.tiktoken): split by TIKTOKEN_PATTERN (cl100k's, which Llama 3 uses). The file
                 holds no special tokens: the EOS (--eos, default <|endoftext|>) is added after the
                 last rank.
A directory is searched for tokenizer.json, then tokenizer.model, then one *.tiktoken file.

EOS: the tokenizer's first special token among EOS_NAMES, else the one given with `--eos TOKEN`.
Special tokens: `prepare` encodes without them (a document's text is its tokens; EOS is appended,
and a chat template writes BOS itself); `generate` encodes a prompt with them
(add_special_tokens=True: Llama's BOS), as transformers does.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib
import json
import re
import shutil
from pathlib import Path

import numpy as np

from shardtrain.config import ConfigError

EOS_NAMES = ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>")
ID_FILES = ("generation_config.json", "hf_config.json", "config.json", "manifest.json")
"""Where a model or prepared directory names its special token ids (eos_token_id / bos_token_id; a
prepare manifest: eos_id), most specific first (hf_config.json: import-hf's copy of config.json)."""
TIKTOKEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                    r"\s*[\r\n]+|\s+(?!\S)|\s+")
"""How a tiktoken vocabulary splits text before BPE (cl100k_base's pattern, also Llama 3's)."""


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (the demo's tokenizer); EOS is an extra id 256."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.uint32) for t in texts]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def token_to_id(self, token: str) -> None:
        return None

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0][:120] if str(e) else type(e).__name__


def _converters():
    try:  # the module (transformers' top level exports a function of the same name)
        convert_slow_tokenizer = importlib.import_module("transformers.convert_slow_tokenizer")
        convert_slow_tokenizer.import_protobuf()
    except ImportError as e:
        raise ConfigError(f"converting a sentencepiece or tiktoken vocabulary needs transformers and protobuf "
                          f"({_first_line(e)}); pip install 'shardtrain[convert]'") from None
    return convert_slow_tokenizer


def from_sentencepiece(path: Path):
    """A sentencepiece model as a `tokenizers.Tokenizer` that encodes like sentencepiece does."""
    convert = _converters()
    proto = convert.import_protobuf().ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as e:  # protobuf's DecodeError
        raise ConfigError(f"--tokenizer {path}: not a sentencepiece model ({_first_line(e)})") from None
    if proto.trainer_spec.model_type == 2:  # BPE: merges come from the piece scores
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    elif proto.trainer_spec.model_type == 1:
        vocab = [(p.piece, p.score) for p in proto.pieces]
    else:
        raise ConfigError(f"--tokenizer {path}: a sentencepiece {proto.trainer_spec.model_type} model; only BPE "
                          "and unigram models convert")
    return convert.SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)


def from_tiktoken(path: Path, eos: str | None):
    """A tiktoken BPE ranks file as a byte-level BPE `tokenizers.Tokenizer`, EOS added after the ranks."""
    ranks = {}
    for line_no, line in enumerate(path.read_bytes().splitlines(), 1):
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise ConfigError(f"{path}:{line_no}: not a tiktoken line 'BASE64 RANK'") from None

    class Converter(_converters().TikTokenConverter):
        load_tiktoken_bpe = staticmethod(lambda _: ranks)

    return Converter(str(path), pattern=TIKTOKEN_PATTERN, extra_special_tokens=[eos or EOS_NAMES[2]]).converted()


def is_tiktoken(path: Path) -> bool:
    with open(path, "rb") as f:
        return re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+\r?\n?", f.readline(200)) is not None


class HfTokenizer:
    """A `tokenizers.Tokenizer` from a tokenizer.json, or converted from sentencepiece / tiktoken.
    Without an EOS (and require_eos false, as generate reads a model's EOS from its config) eos_id
    is None."""

    def __init__(self, path: Path, eos: str | None = None, require_eos: bool = True):
        from tokenizers import Tokenizer
        self.path = path
        self.converted = path.suffix != ".json"
        if not self.converted:
            try:
                self.tok = Tokenizer.from_file(str(path))
            except Exception as e:  # tokenizers raises plain Exceptions for bad JSON
                raise ConfigError(f"--tokenizer {path}: not a tokenizers JSON file ({_first_line(e)})") from None
        elif is_tiktoken(path):
            self.tok = from_tiktoken(path, eos)
        else:
            self.tok = from_sentencepiece(path)
        self.name = str(path)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._eos_id(eos, require_eos)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)

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

    def save(self, path: Path) -> None:
        """As a tokenizer.json (a converted vocabulary is written out, a tokenizer.json copied)."""
        if self.converted:
            self.tok.save(str(path))
        else:
            shutil.copyfile(self.path, path)


BYTES = "bytes"
"""The fingerprint of the byte-level tokenizer (and of data.source=text)."""


def fingerprint(tok: ByteTokenizer | HfTokenizer) -> str:
    """What identifies a tokenizer, whatever file it came in: `bytes`, or its size and the sha256 of
    its vocabulary (token -> id, added tokens included) and which ids are special, e.g. `320 tokens,
    sha256 1f0c2a9e5d3b7a61` (what a prepare manifest, a run's data.tokenizer and import-hf record)."""
    if isinstance(tok, ByteTokenizer):
        return BYTES
    vocab = sorted((i, t) for t, i in tok.tok.get_vocab(with_added_tokens=True).items())
    special = sorted(i for i, t in tok.tok.get_added_tokens_decoder().items() if t.special)
    sha = hashlib.sha256(json.dumps([vocab, special], ensure_ascii=False).encode()).hexdigest()
    return f"{tok.vocab_size} tokens, sha256 {sha[:16]}"


def fingerprint_of(directory: Path) -> str | None:
    """The fingerprint of the tokenizer a directory holds (None: none, or one that does not load here)."""
    try:
        return fingerprint(HfTokenizer(tokenizer_file(str(directory)), require_eos=False))
    except ConfigError:
        return None


def tokenizer_file(spec: str) -> Path:
    """The tokenizer file of `spec`: a file, or a directory's tokenizer.json, tokenizer.model or *.tiktoken."""
    path = Path(spec)
    if path.is_dir():
        found = [path / "tokenizer.json", path / "tokenizer.model", *sorted(path.glob("*.tiktoken"))]
        path = next((p for p in found if p.is_file()), path / "tokenizer.json")
    if not path.is_file():
        raise ConfigError(f"--tokenizer {spec}: no tokenizer file there; give a tokenizer.json, a sentencepiece "
                          "tokenizer.model, a tiktoken file or a directory holding one (or `bytes`)")
    return path


@functools.lru_cache(maxsize=4)  # a prepare worker converts a vocabulary once, not once per part
def load(spec: str, eos: str | None = None) -> ByteTokenizer | HfTokenizer:
    """`bytes`, a tokenizer.json / sentencepiece / tiktoken path, or a directory holding one."""
    if spec == "bytes":
        return ByteTokenizer()
    return HfTokenizer(tokenizer_file(spec), eos)
