"""The tokenizer that goes with a set of weights and its special tokens, found along the chain of
directories the weights came through (`shardtrain.weights.WeightSource.dirs`): the run directory, then
checkpoint.init_from (an HF or import-hf directory, or another run with its own chain), then the
run's prepared data (a `shardtrain prepare` output: its tokenizer.json, and the EOS its
manifest.json names). `generate` encodes with it and stops at its EOS; `export-hf` writes it with
the special tokens where transformers reads them: config.json's and generation_config.json's
eos_token_id / bos_token_id, tokenizer_config.json's eos_token / bos_token.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from shardtrain.data import storage, tokenize

SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
              "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json")
"""A model directory's files besides its weights and config.json that travel with it."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
"""What makes a directory the tokenizer's (a sentencepiece tokenizer.model is converted when loaded)."""


@dataclasses.dataclass(frozen=True)
class TokenizerFiles:
    dir: Path | None
    """The first directory of the chain holding a tokenizer.json or tokenizer.model (None: none does)."""
    byte_ids: bool
    """No tokenizer file, and the weights read UTF-8 bytes (data.source=text, or prepare --tokenizer bytes)."""
    eos_ids: tuple[int, ...] = ()
    bos_id: int | None = None
    eos_token: str | None = None
    bos_token: str | None = None

    def load(self) -> tokenize.HfTokenizer | tokenize.ByteTokenizer | None:
        """The tokenizer (None when there is none); its EOS is the one found here, not its own guess."""
        if self.dir is not None:
            return tokenize.HfTokenizer(tokenize.tokenizer_file(str(self.dir)), require_eos=False)
        return tokenize.ByteTokenizer() if self.byte_ids else None


def _ids(value) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    return tuple(v for v in value if isinstance(v, int)) if isinstance(value, list) else ()


def _named(dirs: list[Path], key: str) -> tuple[int, ...]:
    """The ids the first directory that names `key` (eos_token_id / bos_token_id) gives."""
    for d in dirs:
        for name in tokenize.ID_FILES:
            config = storage.json_object(d / name)
            found = _ids(config.get(key, config.get("eos_id") if key == "eos_token_id" else None))
            if found:
                return found
    return ()


def _token_of_config(d: Path | None, tok, key: str) -> int | None:
    """The id of tokenizer_config.json's `key` (eos_token / bos_token) in `tok`."""
    if d is None or tok is None:
        return None
    token = storage.json_object(d / "tokenizer_config.json").get(key)
    token = token.get("content") if isinstance(token, dict) else token
    return tok.token_to_id(token) if isinstance(token, str) else None


def find(dirs: list[Path], run_config: dict) -> TokenizerFiles:
    """The tokenizer and special tokens of the chain `dirs`; `run_config` (the weights' run config as
    a dict, {} for an HF directory) says whether a chain without a tokenizer read bytes."""
    tok_dir = next((d for d in dirs if any((d / n).is_file() for n in TOKENIZER_FILES)), None)
    data = run_config.get("data") or {}
    bytes_prepared = any(storage.json_object(d / "manifest.json").get("tokenizer") == "bytes" for d in dirs)
    found = TokenizerFiles(tok_dir, tok_dir is None and (data.get("source") == "text" or bytes_prepared))
    tok = found.load()
    eos = _named(dirs, "eos_token_id")
    if not eos and isinstance(tok, tokenize.HfTokenizer):  # tokenizer_config.json's, else the one prepare picks
        from_config = _token_of_config(tok_dir, tok, "eos_token")
        eos = _ids(from_config if from_config is not None else tok.eos_id)
    bos = _named(dirs, "bos_token_id") or _ids(_token_of_config(tok_dir, tok, "bos_token"))
    text = tok.id_to_token if isinstance(tok, tokenize.HfTokenizer) else (lambda _: None)
    return dataclasses.replace(found, eos_ids=eos, bos_id=bos[0] if bos else None,
                               eos_token=text(eos[0]) if eos else None, bos_token=text(bos[0]) if bos else None)


def config_ids(found: TokenizerFiles) -> dict:
    """config.json's eos_token_id / bos_token_id (an int, or a list of several EOS ids)."""
    out = {}
    if found.eos_ids:
        out["eos_token_id"] = found.eos_ids[0] if len(found.eos_ids) == 1 else list(found.eos_ids)
    if found.bos_id is not None:
        out["bos_token_id"] = found.bos_id
    return out


def copy_side_files(src: Path, dst: Path) -> None:
    """The tokenizer and generation config files of `src` that exist, into `dst`."""
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


def write(out: Path, found: TokenizerFiles) -> str | None:
    """The tokenizer files of `found` into the HF directory `out`, completed with the special
    tokens transformers reads; a line saying why there is no tokenizer, or None."""
    if found.dir is not None:
        copy_side_files(found.dir, out)
    ids = config_ids(found)
    if ids:
        generation = _filled(storage.json_object(out / "generation_config.json"), ids)
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if found.dir is None:
        if found.byte_ids:
            return ("no tokenizer written: the model reads UTF-8 bytes as ids (data.source=text or a `bytes` "
                    "prepare), which no tokenizer file describes")
        return ("no tokenizer found in the run dir, checkpoint.init_from or the run's data.path: the export has "
                "weights only; copy the tokenizer.json the data was prepared with into it")
    specials = {k: v for k, v in (("eos_token", found.eos_token), ("bos_token", found.bos_token)) if v is not None}
    config = storage.json_object(out / "tokenizer_config.json")
    if not config and (out / "tokenizer.json").is_file():
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}  # transformers loads tokenizer.json as it is
    (out / "tokenizer_config.json").write_text(json.dumps(_filled(config, specials), indent=2) + "\n")
    return None


def _filled(config: dict, defaults: dict) -> dict:
    """`config` with `defaults` where it has no value (what a copied file says wins)."""
    return {**config, **{k: v for k, v in defaults.items() if config.get(k) is None}}
