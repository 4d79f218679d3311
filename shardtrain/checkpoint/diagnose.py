"""Why a checkpoint does not fit or does not read back: shape mismatches against this config, the
config changes since it was written, and the damaged file behind a tensorstore read error."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
from etils import epath

from shardtrain import config as config_lib
from shardtrain.checkpoint import integrity
from shardtrain.parallel import sharding


def leaf_shapes(tree) -> dict[str, tuple]:
    return {sharding.path_str(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def mismatches(saved: dict[str, tuple], wanted: dict[str, tuple]) -> list[str]:
    """Lines naming every path whose shape differs or that exists on one side only."""
    lines = [f"{k}: checkpoint {saved[k]}, this config {wanted[k]}"
             for k in sorted(saved.keys() & wanted.keys()) if saved[k] != wanted[k]]
    lines += [f"{k}: only in the checkpoint" for k in sorted(saved.keys() - wanted.keys())]
    lines += [f"{k}: missing from the checkpoint" for k in sorted(wanted.keys() - saved.keys())]
    return lines


def config_changes(saved_config: dict, cfg: config_lib.RunConfig, sections=("model", "optimizer")) -> list[str]:
    """A line `model.moe.n_experts: 8 -> 4` for each field of `sections` (nested too) that differs."""
    def leaves(tree: dict, prefix: str):  # tuples as lists: the saved config went through JSON
        for k, v in tree.items():
            yield from leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [
                (f"{prefix}{k}", list(v) if isinstance(v, tuple) else v)]
    now = dict(leaves(config_lib.to_dict(cfg), ""))
    return [f"{k}: {v!r} -> {now.get(k)!r}" for s in sections
            for k, v in leaves(saved_config.get(s) or {}, f"{s}.") if now.get(k) != v]


_TS_READ = re.compile(r'Error reading "(?P<key>[^"]+)" in OCDBT database at \w+ file "(?P<db>[^"]+)": (?P<why>[^;\[]*)')
_TS_SIZE = re.compile(r"byte range \[(?P<a>\d+), (?P<b>\d+)\) is not valid for value of size (?P<size>\d+)")
STEP_FILES = ("_CHECKPOINT_METADATA", "meta/metadata", "state/_METADATA", "state/manifest.ocdbt")
"""Files every committed step holds (orbax 0.12, OCDBT format); the JSON ones are parsed to find damage."""


def read_error(e: BaseException, step_dir: epath.Path) -> str:
    """One line naming the file of a checkpoint step that failed to read, and why. tensorstore's
    own message wraps the cause in a repr of the whole TensorStore spec; the useful part (array,
    database, byte range) is the innermost exception of the chain, and the damaged file is found by
    looking at the step's files (missing, unparsable, or of the size tensorstore complains about)."""
    if isinstance(e, integrity.Damaged):  # its message names the arrays and files already
        return str(e)
    chain = [e]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and nxt not in chain:
        chain.append(nxt)
    inner = next((x for x in reversed(chain) if _TS_READ.search(str(x))), chain[-1])
    text = " ".join(str(inner).split()).split(" See full TensorStore details")[0].split(" [tensorstore_spec=")[0]
    read, size = _TS_READ.search(text), _TS_SIZE.search(text)
    damaged = damaged_files(step_dir, int(size["size"]) if size else None)
    if read:
        detail = f"array {read['key']} does not read back ({(size[0] if size else read['why']).strip()})"
        if not damaged:
            damaged = [f"a data file under {read['db'].rstrip('/')}/ocdbt.process_*/d is missing or damaged"]
    else:
        detail = f"{type(inner).__name__}: {text[:200]}"
    return f"{'; '.join(damaged)}: {detail}" if damaged else f"{detail} (in {step_dir})"


def damaged_files(step_dir: epath.Path, size: int | None = None) -> list[str]:
    """The files of a local step directory that are missing, not valid JSON, or truncated (empty,
    or of exactly `size` bytes: the size tensorstore found a value's byte range beyond)."""
    root = Path(str(step_dir))
    if config_lib.is_url(step_dir) or not root.is_dir():
        return []
    found = []
    for rel in STEP_FILES:
        f = root / rel
        if not f.is_file():
            found.append(f"{f} is missing")
        elif not rel.endswith(".ocdbt"):
            try:
                json.loads(f.read_text())
            except ValueError:
                found.append(f"{f} is not valid JSON (truncated?)")
    for f in sorted(root.glob("state/ocdbt.process_*/d/*")):
        n = f.stat().st_size
        if n == 0 or n == size:
            found.append(f"{f} is truncated ({n} bytes)")
    return found
