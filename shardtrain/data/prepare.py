"""`shardtrain prepare`: text, JSONL or Parquet -> token shards that training reads by range.

Layout of the output directory DIR:
  manifest.json              tokenizer and its fingerprint (tokenize.fingerprint), vocab_size, eos_id,
                             dtype, per split its shards with token and document counts and sha256
                             checksums
  tokenizer.json             a copy of the tokenizer (absent for the byte-level `bytes` tokenizer), with
                             its tokenizer_config.json when it has one, and with --chat the
                             chat_template.jinja the conversations were rendered with
  train/NNNNN.bin            the split's tokens of input file NNNNN: a flat array (uint16 when the
                             vocabulary fits, else uint32), each document followed by EOS
  train/NNNNN.idx.npy        int64 document boundaries into that array (documents + 1 entries)
  train/NNNNN.mask.bin       --chat and --preference only: uint8 per token, 1 for the assistant's tokens (the ones
                             the loss counts; chat.py), 0 for the prompt's and the EOS
  eval/...                   the same for the held-out documents
  parts/NNNNN.json           completion marker of input file NNNNN (written last)

Units of work: an input file, or a part of a large one (JSONL: byte ranges of about PART_BYTES
cut at line starts; Parquet: runs of row groups), tokenized in parallel processes; part j of file
NNNNN writes NNNNN.jjjj.bin (a file of one part: NNNNN.bin). Parts depend only on the file, never
on the number of processes, so the output is the same byte for byte however many run. A rerun of
an interrupted prepare skips every unit whose marker matches its inputs and options. A document
goes to `eval` when crc32("FILE:N") / 2**32 < --eval-fraction (N its index in FILE; a part is told
how many documents the parts before it hold): the split depends on nothing but the file name,
the document's place and the fraction.
Documents: a text file is one document (never split), a JSONL line or a Parquet row (field
--text-field) one; with --chat a JSONL line's `messages` rendered through the tokenizer's chat
template (chat.py); with --preference a JSONL line's {"prompt", "chosen", "rejected"} two documents,
prompt + chosen and prompt + rejected, masked on the completions, both in the row's split (preference.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
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

from shardtrain.config import ConfigError
from shardtrain.data import chat, preference, storage, tokenize

FORMAT = "shardtrain-tokens/1"
SPLITS = ("train", "eval")
ENCODE_CHARS = 1 << 22
"""Characters of text handed to the tokenizer's batch encoder at once."""
PART_BYTES = 1 << 27
"""Input bytes per unit of work: a larger JSONL or Parquet file is split into parts of about this."""


@dataclass(frozen=True)
class Options:
    tokenizer: str
    out: str
    text_field: str = "text"
    eval_fraction: float = 0.0
    eos: str | None = None
    chat: bool = False
    """Conversations ({"messages": [...]} lines) through the chat template, with a loss mask."""
    preference: bool = False
    """{"prompt", "chosen", "rejected"} lines: two documents per row, the completions masked in
    (preference.py)."""


def input_files(inputs: list[str]) -> list[str]:
    """Files named, found under directories, or matched by globs, in a stable order."""
    files: list[str] = []
    for spec in inputs:
        found = storage.find_files(spec)
        if not found:
            raise ConfigError(f"prepare: no input files at '{spec}'; give text, .jsonl or .parquet files, "
                              "directories or globs")
        files += found
    return files


@dataclass(frozen=True)
class Part:
    """Unit of work `part` of `parts` of input file number `file`: bytes [start, stop) of a JSONL
    file (whose earlier parts hold `first_line` lines, `first_doc` documents), row groups
    [start, stop) of a Parquet file (after `first_doc` rows), or a whole text file."""
    file: int
    path: str
    part: int = 0
    parts: int = 1
    start: int = 0
    stop: int = -1
    first_line: int = 0
    first_doc: int = 0

    @property
    def name(self) -> str:
        return f"{self.file:05d}" if self.parts == 1 else f"{self.file:05d}.{self.part:04d}"


def kind(path: str) -> str:
    suffixes = Path(path).suffixes
    if ".jsonl" in suffixes or suffixes[-1:] == [".json"]:
        return "jsonl"
    return "parquet" if suffixes[-1:] == [".parquet"] else "text"


def _lines(path: str, start: int, stop: int):
    """The lines (bytes, with their newline) that start in bytes [start, stop) of a file."""
    with open(path, "rb") as f:
        f.seek(start)
        at = start
        while at < stop:
            line = f.readline()
            if not line:
                return
            at += len(line)
            yield line


def count_lines(part: Part) -> tuple[int, int]:
    """(lines, documents: lines that are not blank) of a JSONL part."""
    lines = docs = 0
    for line in _lines(part.path, part.start, part.stop):
        lines, docs = lines + 1, docs + bool(line.strip())
    return lines, docs


def split_file(k: int, path: str, part_bytes: int = PART_BYTES) -> list[Part]:
    """File `k` as parts of about `part_bytes` (first_line / first_doc still unknown for JSONL)."""
    how = kind(path)
    if how == "jsonl" and os.path.getsize(path) > part_bytes:
        size, cuts = os.path.getsize(path), [0]
        with open(path, "rb") as f:
            for at in range(part_bytes, size, part_bytes):
                if at <= cuts[-1]:
                    continue
                f.seek(at - 1)
                f.readline()  # to the start of the next line
                if f.tell() < size:
                    cuts.append(f.tell())
        cuts.append(size)
        return [Part(k, path, j, len(cuts) - 1, a, b) for j, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    if how == "parquet":
        import pyarrow.parquet as pq
        meta = pq.ParquetFile(path).metadata
        bytes_, runs = 0, [[0, 0, 0]]  # [first row group, stop, first row]
        for g in range(meta.num_row_groups):
            if bytes_ >= part_bytes:
                runs.append([g, g, runs[-1][2] + sum(meta.row_group(i).num_rows for i in range(*runs[-1][:2]))])
                bytes_ = 0
            runs[-1][1], bytes_ = g + 1, bytes_ + meta.row_group(g).total_byte_size
        return [Part(k, path, j, len(runs), a, b, 0, first) for j, (a, b, first) in enumerate(runs)]
    return [Part(k, path)]


def jsonl_rows(part: Part):
    """(FILE:LINE, the parsed JSON) of each non-blank line of a JSONL part."""
    stop = os.path.getsize(part.path) if part.stop < 0 else part.stop
    for line_no, line in enumerate(_lines(part.path, part.start, stop), part.first_line + 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8", errors="replace"))
        except ValueError:
            raise ConfigError(f"{part.path}:{line_no}: not valid JSON; each line must be one JSON object") from None
        yield f"{part.path}:{line_no}", row


def documents(part: Part, field: str):
    """The texts of one part: a .jsonl line's `field`, a .parquet row's, or the whole text file."""
    path, how = part.path, kind(part.path)
    if how == "jsonl":
        for where, row in jsonl_rows(part):
            if not isinstance(row, dict) or not isinstance(row.get(field), str):
                have = ", ".join(row) if isinstance(row, dict) else type(row).__name__
                raise ConfigError(f"{where}: no string field '{field}' (has: {have}); pass --text-field NAME")
            yield row[field]
    elif how == "parquet":
        import pyarrow.parquet as pq
        pf = pq.ParquetFile(path)
        if field not in pf.schema_arrow.names:
            raise ConfigError(f"{path}: no column '{field}' (has: {', '.join(pf.schema_arrow.names)}); "
                              "pass --text-field NAME")
        row_no = part.first_doc
        groups = range(part.start, pf.metadata.num_row_groups if part.stop < 0 else part.stop)
        for batch in pf.iter_batches(columns=[field], batch_size=4096, row_groups=groups):
            for text in batch.column(0).to_pylist():
                if not isinstance(text, str):
                    raise ConfigError(f"{path}: row {row_no} of column '{field}' is {text!r}, not text")
                row_no += 1
                yield text
    else:
        data = Path(path).read_bytes()
        problem = storage.text_problem(data)
        if problem:
            raise ConfigError(f"{path}: not a text file ({problem}); leave it out of the inputs (a glob of the "
                              "text files, e.g. 'DIR/**/*.txt') or convert it to UTF-8")
        yield data.decode("utf-8")


def is_eval(name: str, index: int, fraction: float) -> bool:
    return fraction > 0 and zlib.crc32(f"{name}:{index}".encode()) / 2**32 < fraction


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _marker_key(part: Part, opts: Options, tokenizer_sha: str) -> dict:
    st = os.stat(part.path)
    return {"input": os.path.abspath(part.path), "part": [part.part, part.parts, part.start, part.stop],
            "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "tokenizer_sha256": tokenizer_sha, "text_field": opts.text_field,
            "eval_fraction": opts.eval_fraction, "eos": opts.eos, **({"chat": True} if opts.chat else {}),
            **({"preference": True} if opts.preference else {})}


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


def prepare_part(task: tuple[Part, Options, dict]) -> dict:
    """Tokenizes one part into train/NAME.bin and eval/NAME.bin; returns its marker."""
    part, opts, key = task
    path = part.path
    tok = tokenize.load(opts.tokenizer, opts.eos)
    out = Path(opts.out)
    dtype = token_dtype(tok.vocab_size)
    masked = opts.chat or opts.preference
    writers = {s: _SplitWriter(out / s / f"{part.name}.bin", dtype, mask=masked) for s in SPLITS}
    eos = np.asarray([tok.eos_id], dtype=np.uint32)
    pending: list = []
    template = chat.ChatTemplate(tokenize.tokenizer_file(opts.tokenizer).parent, tok) if opts.chat else None

    def flush(first_index: int):
        if template is None:
            encoded = [(ids, None) for ids in tok.encode_batch(pending)]
        else:  # (ids, assistant mask) of each rendered conversation
            encoded = chat.encode(tok, [t for t, _ in pending], [s for _, s in pending])
        for j, (ids, mask) in enumerate(encoded):
            split = "eval" if is_eval(os.path.basename(path), first_index + j, opts.eval_fraction) else "train"
            writers[split].add(np.concatenate([ids, eos]), None if mask is None else np.append(mask, 0))

    def texts():
        if template is None:
            yield from documents(part, opts.text_field)
            return
        for where, row in jsonl_rows(part):
            yield template.render(chat.check_messages(row, where), where)

    index, chars = part.first_doc, 0
    try:
        if opts.preference:  # a row's two documents (EOS included) go to one split together
            pair_template = preference.chat_template(opts.tokenizer, tok)
            for index, (where, row) in enumerate(jsonl_rows(part), part.first_doc):
                split = "eval" if is_eval(os.path.basename(path), index, opts.eval_fraction) else "train"
                for ids, mask in preference.encode_row(tok, row, where, pair_template):
                    writers[split].add(ids, mask)
        else:
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
    done = out / "parts" / f"{part.name}.json"
    done.with_suffix(".tmp").write_text(json.dumps(marker))
    os.replace(done.with_suffix(".tmp"), done)
    return marker


def _done(out: Path, part: Part, key: dict) -> dict | None:
    try:
        marker = json.loads((out / "parts" / f"{part.name}.json").read_text())
    except (OSError, ValueError):
        return None
    return marker if marker.get("key") == key else None


def _part_bytes(part: Part) -> int:
    if kind(part.path) == "jsonl" and part.parts > 1:
        return part.stop - part.start
    return os.path.getsize(part.path) // part.parts


def _count_documents(todo: list[Part], parts: list[Part], pool) -> list[Part]:
    """`todo` with each JSONL part told the lines and documents of its file's earlier parts
    (counted here, in parallel, for the files with a part to do)."""
    files = {p.file for p in todo if p.parts > 1 and kind(p.path) == "jsonl"}
    counted = [p for p in parts if p.file in files]
    counts = dict(zip([(p.file, p.part) for p in counted],
                      pool.map(count_lines, counted) if pool else map(count_lines, counted)))
    done = []
    for p in todo:
        if p.file in files:
            before = [counts[p.file, j] for j in range(p.part)]
            p = dataclasses.replace(p, first_line=sum(c[0] for c in before), first_doc=sum(c[1] for c in before))
        done.append(p)
    return done


def tokenizer_fingerprint(opts: Options, files: list[str]) -> str:
    """What a part's marker records of the tokenizer (and chat template): a changed one redoes
    every part. A bad tokenizer, --eos or --chat input fails here, before any work."""
    tok = tokenize.load(opts.tokenizer, opts.eos)
    sha = hashlib.sha256(Path(tok.path).read_bytes()).hexdigest() if tok.name != "bytes" else "bytes"
    if opts.chat and opts.preference:
        raise ConfigError("--chat and --preference do not combine: --preference reads chat message lists in its "
                          "prompt/chosen/rejected fields itself")
    if opts.preference or not opts.chat:
        for f in files if opts.preference else []:
            if kind(f) != "jsonl":
                raise ConfigError(f"{f}: --preference reads JSONL files (a {{'prompt', 'chosen', 'rejected'}} per "
                                  "line), not this")
        return sha
    if not isinstance(tok, tokenize.HfTokenizer):  # chat.encode reads the tokenizer's character offsets
        raise ConfigError(f"--chat needs a Hugging Face tokenizer directory with a chat template, not "
                          f"`{opts.tokenizer}`")
    template = chat.ChatTemplate(tokenize.tokenizer_file(opts.tokenizer).parent, tok)
    for f in files:
        if kind(f) != "jsonl":
            raise ConfigError(f"{f}: --chat reads JSONL files (a {{'messages': [...]}} per line), not this")
    variables = json.dumps(template.variables, sort_keys=True)
    return sha + hashlib.sha256((template.source + variables).encode()).hexdigest()


def write_manifest(inputs: list[str], opts: Options, parts: list[Part], markers: dict) -> dict:
    """manifest.json (and tokenizer.json) of opts.out from the parts' markers, once every part is
    done; refuses a dataset without training documents, or an eval fraction that held out none."""
    out, tok = Path(opts.out), tokenize.load(opts.tokenizer, opts.eos)
    if tok.name != "bytes":
        tok.save(out / "tokenizer.json")
        tok_dir = tokenize.tokenizer_file(opts.tokenizer).parent
        if (tok_dir / "tokenizer_config.json").is_file():  # its special tokens (and chat template) go along
            shutil.copyfile(tok_dir / "tokenizer_config.json", out / "tokenizer_config.json")
        if opts.chat:  # a run on this data knows how its conversations were written
            (out / "chat_template.jinja").write_text(chat.ChatTemplate(tok_dir, tok).source)
    manifest = {"format": FORMAT, "tokenizer": "bytes" if tok.name == "bytes" else "tokenizer.json",
                "tokenizer_fingerprint": tokenize.fingerprint(tok), "loss_mask": opts.chat or opts.preference,
                "preference": opts.preference,
                "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                "dtype": token_dtype(tok.vocab_size).name,
                "options": {k: v for k, v in asdict(opts).items() if k != "out"}, "splits": {}}
    for split in SPLITS:
        shards = [{"file": f"{split}/{p.name}.bin", "index": f"{split}/{p.name}.idx.npy",
                   **markers[p.file, p.part][split],
                   **({"mask": f"{split}/{p.name}.mask.bin"} if manifest["loss_mask"] else {})}
                  for p in parts if markers[p.file, p.part][split]["tokens"]]
        manifest["splits"][split] = {"tokens": sum(s["tokens"] for s in shards),
                                     "documents": sum(s["documents"] for s in shards), "shards": shards}
    train, held = manifest["splits"]["train"], manifest["splits"]["eval"]
    if not train["documents"]:
        raise ConfigError(f"prepare: no training documents in {', '.join(inputs)} (all empty or held out)")
    if opts.eval_fraction > 0 and not held["documents"]:
        raise ConfigError(f"--eval-fraction {opts.eval_fraction} held out none of the {train['documents']} "
                          "documents; raise it or add documents")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def prepare(inputs: list[str], opts: Options, workers: int | None = None, say=print,
            part_bytes: int = PART_BYTES) -> dict:
    """Tokenizes `inputs` into opts.out; returns the manifest. Skips units an earlier run finished."""
    from tqdm import tqdm
    if not 0 <= opts.eval_fraction < 1:
        raise ConfigError(f"--eval-fraction: must be in [0, 1), got {opts.eval_fraction}")
    if storage.is_url(opts.out):
        raise ConfigError(f"--out {opts.out}: prepare writes to local disk; prepare into a local DIR, copy it up "
                          f"(gcloud storage cp -r DIR {opts.out}) and train with data.path={opts.out}")
    files = input_files(inputs)
    tok_sha = tokenizer_fingerprint(opts, files)
    out = Path(opts.out)
    for d in (*SPLITS, "parts"):
        (out / d).mkdir(parents=True, exist_ok=True)
    parts = [p for k, f in enumerate(files) for p in split_file(k, f, part_bytes)]
    keys = {(p.file, p.part): _marker_key(p, opts, tok_sha) for p in parts}
    markers = {(p.file, p.part): _done(out, p, keys[p.file, p.part]) for p in parts}
    todo = [p for p in parts if markers[p.file, p.part] is None]
    if len(todo) < len(parts):
        say(f"prepare: {len(parts) - len(todo)} of {len(parts)} input files or parts already done in {out}; "
            "skipping them")
    t0 = time.perf_counter()
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo)))
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(workers)) if workers > 1 else None
        todo = _count_documents(todo, parts, pool)
        tasks = [(p, opts, keys[p.file, p.part]) for p in todo]
        sizes = [_part_bytes(p) for p in todo]
        # delay: a mistake found at once prints its one error line without a bar
        with tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="prepare", disable=not todo, delay=1.0) as bar:
            results = pool.imap(prepare_part, tasks) if pool else map(prepare_part, tasks)
            for part, size, marker in zip(todo, sizes, results):
                markers[part.file, part.part] = marker
                bar.update(size)
    seconds = time.perf_counter() - t0
    manifest = write_manifest(inputs, opts, parts, markers)
    train, held = manifest["splits"]["train"], manifest["splits"]["eval"]
    new_tokens = sum(markers[p.file, p.part][s]["tokens"] for p in todo for s in SPLITS)
    speed = (f"{new_tokens / max(seconds, 1e-9):.0f} tokens/s on {workers} process(es)" if todo
             else "nothing to tokenize: every part was done already")
    say(f"prepared {train['documents'] + held['documents']} documents from {len(files)} files into {out}: "
        f"{train['tokens']} train / {held['tokens']} eval tokens, vocab {manifest['vocab_size']}, "
        f"EOS id {manifest['eos_id']}; {speed}")
    return manifest
