"""`shardtrain prepare`: text, JSONL or Parquet -> token shards that training memory-maps.

Layout of the output directory DIR:
  manifest.json              tokenizer, vocab_size, eos_id, dtype, per split its shards with token and
                             document counts and sha256 checksums
  tokenizer.json             a copy of the tokenizer (absent for the byte-level `bytes` tokenizer)
  train/NNNNN.bin            the split's tokens of input file NNNNN: a flat array (uint16 when the
                             vocabulary fits, else uint32), each document followed by EOS
  train/NNNNN.idx.npy        int64 document boundaries into that array (documents + 1 entries)
  train/NNNNN.mask.bin       --chat only: uint8 per token, 1 for the assistant's tokens (the ones
                             the loss counts; chat.py), 0 for the prompt's and the EOS
  eval/...                   the same for the held-out documents
  parts/NNNNN.json           completion marker of input file NNNNN (written last)

One input file is one unit of work: files are tokenized in parallel processes, and a rerun of an
interrupted prepare skips every file whose marker matches its inputs and options. A document
goes to `eval` when crc32("FILE:N") / 2**32 < --eval-fraction (N its index in FILE): the split
depends on nothing but the file name, the document's place and the fraction.
Documents: a text file is one document, a JSONL line or a Parquet row (field --text-field) one;
with --chat a JSONL line's `messages` rendered through the tokenizer's chat template.
"""

from __future__ import annotations

import glob
import hashlib
import json
import multiprocessing
import os
import shutil
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from shardtrain import chat, tokenize
from shardtrain.config import ConfigError

FORMAT = "shardtrain-tokens/1"
SPLITS = ("train", "eval")
ENCODE_CHARS = 1 << 22
"""Characters of text handed to the tokenizer's batch encoder at once."""


@dataclass(frozen=True)
class Options:
    tokenizer: str
    out: str
    text_field: str = "text"
    eval_fraction: float = 0.0
    eos: str | None = None
    chat: bool = False
    """Conversations ({"messages": [...]} lines) through the chat template, with a loss mask."""


def input_files(inputs: list[str]) -> list[str]:
    """Files named, found under directories, or matched by globs, in a stable order."""
    files: list[str] = []
    for spec in inputs:
        p = Path(spec)
        if p.is_dir():
            found = sorted(str(f) for f in p.rglob("*") if f.is_file())
        elif p.is_file():
            found = [spec]
        else:
            found = sorted(f for f in glob.glob(spec, recursive=True) if Path(f).is_file())
        if not found:
            raise ConfigError(f"prepare: no input files at '{spec}'; give text, .jsonl or .parquet files, "
                              "directories or globs")
        files += found
    return files


def documents(path: str, field: str):
    """The texts of one input file: a .jsonl line's `field`, a .parquet row's, or the whole file."""
    suffixes = Path(path).suffixes
    if ".jsonl" in suffixes or suffixes[-1:] == [".json"]:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    raise ConfigError(f"{path}:{line_no}: not valid JSON; each line must be one JSON object") from None
                if not isinstance(row, dict) or not isinstance(row.get(field), str):
                    have = ", ".join(row) if isinstance(row, dict) else type(row).__name__
                    raise ConfigError(f"{path}:{line_no}: no string field '{field}' (has: {have}); "
                                      "pass --text-field NAME")
                yield row[field]
    elif suffixes[-1:] == [".parquet"]:
        import pyarrow.parquet as pq
        pf = pq.ParquetFile(path)
        if field not in pf.schema_arrow.names:
            raise ConfigError(f"{path}: no column '{field}' (has: {', '.join(pf.schema_arrow.names)}); "
                              "pass --text-field NAME")
        row_no = 0
        for batch in pf.iter_batches(columns=[field], batch_size=4096):
            for text in batch.column(0).to_pylist():
                if not isinstance(text, str):
                    raise ConfigError(f"{path}: row {row_no} of column '{field}' is {text!r}, not text")
                row_no += 1
                yield text
    else:
        yield Path(path).read_text(encoding="utf-8", errors="replace")


def is_eval(name: str, index: int, fraction: float) -> bool:
    return fraction > 0 and zlib.crc32(f"{name}:{index}".encode()) / 2**32 < fraction


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _marker_key(path: str, opts: Options, tokenizer_sha: str) -> dict:
    st = os.stat(path)
    return {"input": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "tokenizer_sha256": tokenizer_sha, "text_field": opts.text_field,
            "eval_fraction": opts.eval_fraction, "eos": opts.eos, **({"chat": True} if opts.chat else {})}


class _SplitWriter:
    def __init__(self, path: Path, dtype: np.dtype, mask: bool = False):
        self.path, self.dtype = path, dtype
        self.tmp = path.with_suffix(".bin.tmp")
        self.file = open(self.tmp, "wb")
        self.mask_path = path.with_suffix(".mask.bin") if mask else None
        self.mask_file = open(self.mask_path.with_suffix(".tmp"), "wb") if mask else None
        self.sha, self.offsets = hashlib.sha256(), [0]

    def add(self, ids: np.ndarray, mask: np.ndarray | None = None) -> None:
        data = ids.astype(self.dtype).tobytes()
        self.file.write(data)
        self.sha.update(data)
        self.offsets.append(self.offsets[-1] + len(ids))
        if self.mask_file is not None:
            self.mask_file.write(mask.astype(np.uint8).tobytes())

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)
        if self.mask_file is not None:
            self.mask_file.close()
            Path(self.mask_file.name).unlink(missing_ok=True)

    def close(self) -> dict:
        self.file.close()
        os.replace(self.tmp, self.path)
        if self.mask_file is not None:
            self.mask_file.close()
            os.replace(self.mask_file.name, self.mask_path)
        np.save(self.path.with_suffix(".idx.npy"), np.asarray(self.offsets, dtype=np.int64))
        return {"tokens": self.offsets[-1], "documents": len(self.offsets) - 1, "sha256": self.sha.hexdigest()}


def prepare_file(task: tuple[int, str, Options, dict]) -> dict:
    """Tokenizes input file number `k` into train/k.bin and eval/k.bin; returns its marker."""
    k, path, opts, key = task
    tok = tokenize.load(opts.tokenizer, opts.eos)
    out = Path(opts.out)
    dtype = token_dtype(tok.vocab_size)
    writers = {s: _SplitWriter(out / s / f"{k:05d}.bin", dtype, mask=opts.chat) for s in SPLITS}
    eos = np.asarray([tok.eos_id], dtype=np.uint32)
    pending: list = []
    template = chat.ChatTemplate(tokenize.tokenizer_file(opts.tokenizer).parent) if opts.chat else None

    def flush(first_index: int):
        if template is None:
            encoded = [(ids, None) for ids in tok.encode_batch(pending)]
        else:
            encoded = chat.encode(tok, [t for t, _ in pending], [s for _, s in pending])
        for j, (ids, mask) in enumerate(encoded):
            split = "eval" if is_eval(os.path.basename(path), first_index + j, opts.eval_fraction) else "train"
            writers[split].add(np.concatenate([ids, eos]), None if mask is None else np.append(mask, 0))

    def texts():
        if template is None:
            yield from documents(path, opts.text_field)
            return
        for where, messages in chat.conversations(path):
            yield template.render(messages, where)

    index = chars = 0
    try:
        for text in texts():
            pending.append(text)
            chars += len(text if template is None else text[0])
            if chars >= ENCODE_CHARS:
                flush(index)
                index, chars, pending = index + len(pending), 0, []
        flush(index)
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    marker = {"key": key, **{s: w.close() for s, w in writers.items()}}
    part = out / "parts" / f"{k:05d}.json"
    part.with_suffix(".tmp").write_text(json.dumps(marker))
    os.replace(part.with_suffix(".tmp"), part)
    return marker


def _done(out: Path, k: int, key: dict) -> dict | None:
    part = out / "parts" / f"{k:05d}.json"
    try:
        marker = json.loads(part.read_text())
    except (OSError, ValueError):
        return None
    return marker if marker.get("key") == key else None


def prepare(inputs: list[str], opts: Options, workers: int | None = None, say=print) -> dict:
    """Tokenizes `inputs` into opts.out; returns the manifest. Skips files an earlier run finished."""
    from tqdm import tqdm
    if not 0 <= opts.eval_fraction < 1:
        raise ConfigError(f"--eval-fraction: must be in [0, 1), got {opts.eval_fraction}")
    files = input_files(inputs)
    tok = tokenize.load(opts.tokenizer, opts.eos)  # a bad tokenizer or --eos fails here, before any work
    tok_sha = hashlib.sha256(Path(tok.path).read_bytes()).hexdigest() if tok.name != "bytes" else "bytes"
    if opts.chat:  # no template, or an input that is not JSONL: an error before any work
        if not isinstance(tok, tokenize.HfTokenizer):  # chat.encode reads a tokenizer.json's character offsets
            raise ConfigError(f"--chat needs a Hugging Face tokenizer directory with a chat template, not "
                              f"`{opts.tokenizer}`")
        template = chat.ChatTemplate(tokenize.tokenizer_file(opts.tokenizer).parent)
        tok_sha += hashlib.sha256(template.source.encode()).hexdigest()
        for f in files:
            if ".jsonl" not in Path(f).suffixes:
                raise ConfigError(f"{f}: --chat reads JSONL files (a {{'messages': [...]}} per line), not this")
    out = Path(opts.out)
    for d in (*SPLITS, "parts"):
        (out / d).mkdir(parents=True, exist_ok=True)
    tasks = [(k, f, opts, _marker_key(f, opts, tok_sha)) for k, f in enumerate(files)]
    markers = {k: _done(out, k, key) for k, _, _, key in tasks}
    todo = [t for t in tasks if markers[t[0]] is None]
    if len(todo) < len(tasks):
        say(f"prepare: {len(tasks) - len(todo)} of {len(tasks)} input files already done in {out}; skipping them")
    t0 = time.perf_counter()
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo)))
    total_bytes = sum(os.path.getsize(t[1]) for t in todo)
    # delay: a mistake found at once prints its one error line without a bar
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare", disable=not todo, delay=1.0) as bar:
        if workers == 1:
            for task in todo:
                markers[task[0]] = prepare_file(task)
                bar.update(os.path.getsize(task[1]))
        else:
            with multiprocessing.get_context("spawn").Pool(workers) as pool:
                for task, marker in zip(todo, pool.imap(prepare_file, todo)):
                    markers[task[0]] = marker
                    bar.update(os.path.getsize(task[1]))
    seconds = time.perf_counter() - t0

    if tok.name != "bytes":
        shutil.copyfile(tok.path, out / "tokenizer.json")
    manifest = {"format": FORMAT, "tokenizer": "bytes" if tok.name == "bytes" else "tokenizer.json",
                "loss_mask": opts.chat, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                "dtype": token_dtype(tok.vocab_size).name,
                "options": {k: v for k, v in asdict(opts).items() if k != "out"}, "splits": {}}
    for split in SPLITS:
        shards = [{"file": f"{split}/{k:05d}.bin", "index": f"{split}/{k:05d}.idx.npy", **markers[k][split],
                   **({"mask": f"{split}/{k:05d}.mask.bin"} if opts.chat else {})}
                  for k in sorted(markers) if markers[k][split]["tokens"]]
        manifest["splits"][split] = {"tokens": sum(s["tokens"] for s in shards),
                                     "documents": sum(s["documents"] for s in shards), "shards": shards}
    train, held = manifest["splits"]["train"], manifest["splits"]["eval"]
    if not train["documents"]:
        raise ConfigError(f"prepare: no training documents in {', '.join(inputs)} (all empty or held out)")
    if opts.eval_fraction > 0 and not held["documents"]:
        raise ConfigError(f"--eval-fraction {opts.eval_fraction} held out none of the {train['documents']} "
                          "documents; raise it or add documents")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    new_tokens = sum(markers[t[0]][s]["tokens"] for t in todo for s in SPLITS)
    say(f"prepared {train['documents'] + held['documents']} documents from {len(files)} files into {out}: "
        f"{train['tokens']} train / {held['tokens']} eval tokens, vocab {tok.vocab_size}, "
        f"{new_tokens / max(seconds, 1e-9):.0f} tokens/s on {workers} process(es)")
    return manifest
