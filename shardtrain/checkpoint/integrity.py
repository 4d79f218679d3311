"""Checksums of what a checkpoint step holds, so that bit rot is found instead of restored.

Neither Orbax 0.12.8 nor tensorstore 0.1.86 checksums the arrays it writes: Orbax's zarr3 layout
puts a crc32c codec on a shard's *index* only (none on the chunks), the default zarr2 + OCDBT
layout has none, and OCDBT's data files carry none either; ten flipped bits in a data file read
back as other numbers without an error. So each step records its own:

- persistent tier (Orbax): once a save's arrays are written and merged, and before Orbax commits
  the step (AsyncOptions.post_finalization_callback, in Orbax's background thread: the save's
  blocking part does not grow), `record` reads every stored value of the `state` item back through
  tensorstore's OCDBT key-value store and writes `checksums.json` into the step directory: a crc32
  per array (over its chunks and its zarr metadata, as stored, compressed) and per metadata file.
  The step is committed with its checksums, or not at all.
- local tier: a crc32 of each .npy's array bytes goes into the step's meta.json (local.py).

`verify` recomputes them; a mismatch raises `Damaged` naming the array (or file), and restore then
treats the step like any unreadable one. A step written before checksums existed has no
checksums.json: it is reported as such and still restores.
"""

from __future__ import annotations

import json
import zlib

import numpy as np
from etils import epath

FILE = "checksums.json"
ALGORITHM = "crc32"
METADATA_FILES = ("meta/metadata", "state/_METADATA", "state/_sharding")
"""JSON files of a step that say what its arrays are (dtype, shape, sharding) or where its data starts."""
WINDOW = 64
"""Values read at once while checksumming (bounds the memory to about this many chunks)."""


class Damaged(ValueError):
    """A checkpoint step's data no longer matches the checksums recorded when it was written."""


def crc(data) -> str:
    """crc32 of a buffer (bytes or a contiguous numpy array), as 8 hex digits."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def _kvstore(step_dir: epath.Path):
    import tensorstore as ts
    base = str(step_dir / "state")
    base = base if "://" in base else f"file://{base}"
    return ts.KvStore.open({"driver": "ocdbt", "base": base.rstrip("/") + "/"}).result()


def array_checksums(step_dir: epath.Path) -> tuple[dict[str, str], set[str]]:
    """({array path: crc32 over its stored keys and values, in key order}, {arrays with an empty
    value}) of a step's `state` item. tensorstore 0.1.86 reads a value whose OCDBT data file is gone
    as empty, without an error; no zarr chunk or metadata is ever empty."""
    kv = _kvstore(step_dir)
    keys = sorted(kv.list().result())
    sums: dict[str, int] = {}
    empty = set()
    for i in range(0, len(keys), WINDOW):
        window = keys[i:i + WINDOW]
        for key, future in [(k, kv.read(k)) for k in window]:
            name = key.decode().rsplit("/", 1)[0].replace(".", "/")  # params.blocks.wq -> params/blocks/wq
            value = future.result().value
            sums[name] = zlib.crc32(value, zlib.crc32(key, sums.get(name, 0)))
            if not value:
                empty.add(name)
    return {name: f"{s & 0xFFFFFFFF:08x}" for name, s in sums.items()}, empty


def file_checksums(step_dir: epath.Path) -> dict[str, str]:
    """{relative path: crc32} of the step's metadata files and per-process array metadata."""
    per_process = step_dir / "state" / "array_metadatas"
    files = [step_dir / rel for rel in METADATA_FILES] + (sorted(per_process.glob("*")) if per_process.exists() else [])
    return {str(f.relative_to(step_dir)): crc(f.read_bytes()) for f in files if f.exists()}


def record(step_dir: epath.Path) -> None:
    """Writes step_dir/checksums.json (atomically: a reader sees all of it or none)."""
    sums = {"algorithm": ALGORITHM, "arrays": array_checksums(step_dir)[0], "files": file_checksums(step_dir)}
    tmp = step_dir / f"{FILE}.tmp"
    tmp.write_text(json.dumps(sums, indent=0))
    tmp.rename(step_dir / FILE)


def verify(step_dir: epath.Path) -> bool:
    """True when every array and metadata file of the step matches its recorded checksum; False when
    the step has no checksums (written before they existed); raises Damaged naming the arrays and
    files that differ or are missing (an unreadable one raises what reading it raised)."""
    if not (step_dir / FILE).exists():
        return False
    try:
        recorded = json.loads((step_dir / FILE).read_text())
        want_files, want_arrays = dict(recorded["files"]), dict(recorded["arrays"])
    except (ValueError, KeyError, TypeError) as e:
        raise Damaged(f"{FILE} is damaged ({type(e).__name__})") from None
    if not (step_dir / "state" / "manifest.ocdbt").exists():  # tensorstore would read an empty database
        raise Damaged(f"{step_dir}/state/manifest.ocdbt is missing")
    got_files, (got_arrays, empty) = file_checksums(step_dir), array_checksums(step_dir)
    bad = [file_problem(step_dir / rel) for rel, want in want_files.items() if got_files.get(rel) != want]
    bad += [f"array {name} has no data (a data file under {step_dir}/state/ocdbt.process_*/d is missing)"
            for name in sorted(empty & want_arrays.keys())]
    bad += [f"array {name} is missing" if name not in got_arrays else f"checksum mismatch in array {name}"
            for name, want in want_arrays.items() if got_arrays.get(name) != want and name not in empty]
    if bad:
        raise Damaged(summary(bad))
    return True


def file_problem(path: epath.Path) -> str:
    """What is wrong with a metadata file whose checksum differs."""
    if not path.exists():
        return f"{path} is missing"
    try:
        json.loads(path.read_text())
    except ValueError:
        return f"{path} is not valid JSON (truncated?)"
    return f"checksum mismatch in {path}"


def summary(problems: list[str], shown: int = 3) -> str:
    """The first few problems and how many more, on one line."""
    more = f" and {len(problems) - shown} more" if len(problems) > shown else ""
    return "; ".join(problems[:shown]) + more


def verify_local(step_dir) -> bool:
    """`verify` for a local-tier step (meta.json's checksums of its .npy files' array data)."""
    from pathlib import Path
    step_dir = Path(step_dir)
    try:
        checksums = json.loads((step_dir / "meta.json").read_text()).get("checksums")
    except ValueError as e:
        raise Damaged(f"meta.json is damaged ({type(e).__name__})") from None
    if checksums is None:
        return False
    bad = []
    for name, want in checksums.items():
        try:
            if crc(np.load(step_dir / f"{name}.npy", allow_pickle=False)) != want:
                bad.append(f"checksum mismatch in {name}.npy")
        except (OSError, ValueError) as e:
            bad.append(f"{name}.npy does not read back ({type(e).__name__})")
    if bad:
        raise Damaged(summary(bad))
    return True
