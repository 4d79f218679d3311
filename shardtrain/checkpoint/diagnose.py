"""Why a checkpoint does not fit or does not read back: shape mismatches against this config, the
config changes since it was written (and which of them a resume refuses), and the damaged file
behind a tensorstore read error."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
from etils import epath

from shardtrain import config as config_lib, optim
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
    return [f"{k}: {old!r} -> {new!r}" for k, old, new in differences(saved_config, config_lib.to_dict(cfg))
            if k.split(".")[0] in sections]


def differences(saved: dict, now: dict, prefix: str = ""):
    """(dotted key, saved value, value now) of every field that differs, nested sections walked
    where both sides have one (a section set on one side only, e.g. model.rope_scaling, is one
    difference). A field only one side has (written before it existed) is no difference."""
    for k, old in saved.items():
        if k not in now:
            continue
        new = plain(now[k])
        if isinstance(old, dict) and isinstance(new, dict):
            yield from differences(old, new, f"{prefix}{k}.")
        elif old != new:
            yield f"{prefix}{k}", old, new


def plain(x):
    """A config value as it reads back from a checkpoint's JSON: tuples as lists."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    return [plain(v) for v in x] if isinstance(x, (list, tuple)) else x


SAME_FUNCTION = ("model.attention", "model.embed", "model.moe.router_aux_loss_coef", "model.moe.router_z_loss_coef",
                 "model.moe.bias_update_rate")
"""The model fields a resume may change without checkpoint.allow_changes: how attention and the
embedding are computed (the same function), and the MoE balancing losses' weights and bias step
(training signals, not the function). Every other model.* field changes what the model computes."""
DATA_STREAM = ("data.source", "data.path", "data.mixture", "data.seq_len", "train.seed", "train.global_batch_size")
"""Fields that make sample i of the data (a function of the seed, the files and the window length)
or its position (step x batch) another one."""
SAID_ELSEWHERE = (*(f"optimizer.{k}" for k in optim.SCHEDULE_FIELDS), "optimizer.name", "checkpoint.allow_changes",
                  "data.tokenizer", "data.allow_tokenizer_mismatch")  # the tokenizer: weights.check_tokenizer
"""Changes the run says (or refuses) in its own line: the schedule (`lr ... re-planned`), optimizer.name."""


def under(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def check_changes(cfg: config_lib.RunConfig, resumed: dict | None, directory: str, say=print) -> None:
    """Compares the config a resume starts from (the newest checkpoint's meta, `resumed`) with `cfg`:
    a change to the model's function (a model.* field but SAME_FUNCTION) or to the data stream
    (DATA_STREAM) is a one-line ConfigError naming each field and both values, unless
    checkpoint.allow_changes names it; every other change is said in one `changed since step N:` line."""
    if resumed is None:
        return
    step, allowed = resumed["step"], cfg.checkpoint.allow_changes
    changes = [c for c in differences(resumed["config"], config_lib.to_dict(cfg)) if not under(c[0], SAID_ELSEWHERE)]
    function = [c for c in changes if under(c[0], ("model",)) and not under(c[0], SAME_FUNCTION)]
    data = [c for c in changes if under(c[0], DATA_STREAM)]
    refused = [c for c in function + data if not under(c[0], allowed)]
    if refused:
        keys = [k for k, _, _ in refused]
        what = " and ".join(w for w, cs in (("the model's function", function), ("the data stream", data))
                            if any(k in keys for k, _, _ in cs))
        raise config_lib.ConfigError(
            f"resuming from checkpoint step {step} in {directory} would change {what}: {said(refused)}; to do it on "
            f"purpose, allow it (checkpoint.allow_changes=[{','.join(keys)}]) or start a new run from these weights "
            f"(checkpoint.init_from={directory}/{step} run_dir=NEW_DIR)")
    marked = [(f"{k} (allowed)" if (k, old, new) in function + data else k, old, new) for k, old, new in changes]
    if marked:
        say(f"changed since step {step}: {said(marked)}")


def said(changes) -> str:
    """`key old -> new, ...` with each value cut to ~100 characters."""
    def value(v):
        return config_lib.shown(v, 100) if not isinstance(v, str) else v if len(v) <= 100 else v[:97] + "..."
    return ", ".join(f"{k} {value(old)} -> {value(new)}" for k, old, new in changes)


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
