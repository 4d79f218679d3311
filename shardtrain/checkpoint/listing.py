"""What is on disk: the checkpoint directory's step folders (committed, half-written, set aside as
unusable), their metadata, and `shardtrain ckpt RUN_DIR`, which lists them. Reads files only:
no Orbax manager, no model."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
from pathlib import Path

import yaml
from etils import epath

from shardtrain import config as config_lib
from shardtrain.checkpoint import integrity

UNUSABLE_DIR = "unusable"
TMP_MARK = ".orbax-checkpoint-tmp"
COMMIT_FILE = "commit_success.txt"


def directory(cfg: config_lib.RunConfig) -> str:
    """The checkpoint directory as a string (a gs:// URL is passed to orbax untouched)."""
    path = cfg.checkpoint_dir()
    if path.startswith("gs://") and not any(importlib.util.find_spec(m) for m in ("gcsfs", "tensorflow")):
        raise config_lib.ConfigError(
            f"checkpoint.directory={path}: gs:// paths need the gcsfs package (pip install 'shardtrain[gcs]'), "
            "which orbax uses to list and rename checkpoint directories")
    return path


def committed_steps(cfg: config_lib.RunConfig) -> list[int]:
    """The committed step numbers in the run's checkpoint directory (no Orbax manager needed)."""
    return committed_in(directory(cfg))


def committed_in(ckpt_dir: str) -> list[int]:
    """The committed step numbers in a checkpoint directory, oldest first: those restore tries."""
    return [s.step for s in scan(ckpt_dir) if s.state == "committed"]


def newest_meta(cfg: config_lib.RunConfig) -> dict | None:
    """The metadata of the newest committed step that has readable metadata (the one a resume
    starts from); None without one."""
    committed = [s for s in scan(directory(cfg)) if s.state == "committed"]
    return next((meta for s in reversed(committed) if (meta := read_meta(s.path))), None)


@dataclasses.dataclass(frozen=True)
class StepInfo:
    path: epath.Path
    step: int
    state: str
    """committed, uncommitted (half-written) or unusable (set aside)."""
    note: str = ""


def scan(ckpt_dir: str) -> list[StepInfo]:
    """Every step directory: committed, uncommitted (half-written) or set aside as unusable."""
    root = epath.Path(ckpt_dir)
    if not root.exists():
        return []
    found = []
    for p in root.iterdir():
        name = p.name
        if name.isdigit():
            committed = (p / COMMIT_FILE).exists()
            found.append(StepInfo(p, int(name), "committed" if committed else "uncommitted"))
        elif TMP_MARK in name and name.split(".")[0].isdigit():
            found.append(StepInfo(p, int(name.split(".")[0]), "uncommitted"))
        elif name == UNUSABLE_DIR:
            for q in p.iterdir():
                reason = (q / "UNUSABLE.txt").read_text().strip() if (q / "UNUSABLE.txt").exists() else ""
                found.append(StepInfo(q, int(q.name.split("-")[0]), "unusable", reason))
    return sorted(found, key=lambda s: (s.step, s.state))


def read_meta(step_dir: epath.Path) -> dict | None:
    try:
        return json.loads((step_dir / "meta" / "metadata").read_text())
    except Exception:  # noqa: BLE001 - missing or damaged: shown as unknown
        return None


def disk_bytes(path: epath.Path) -> int:
    if config_lib.is_url(path):
        import fsspec
        fs, inner = fsspec.core.url_to_fs(str(path))
        return int(fs.du(inner))
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def checkpoint_dir_of(run_dir: str) -> str:
    """run_dir/config.yaml's checkpoint.directory, else run_dir/checkpoints, else run_dir itself."""
    saved = epath.Path(run_dir) / "config.yaml"
    if saved.exists():
        custom = ((yaml.safe_load(saved.read_text()) or {}).get("checkpoint") or {}).get("directory")
        if custom:
            return custom
    if (epath.Path(run_dir) / "checkpoints").exists():
        return str(epath.Path(run_dir) / "checkpoints")
    return run_dir


def locate(path: str, what: str = "checkpoint") -> tuple[str, int | None]:
    """Where a path's checkpoints are: a run dir, a checkpoints dir or one step's dir -> (the
    checkpoints dir, that step or None for the newest). The one resolver eval, generate and export use."""
    if config_lib.is_url(path):
        return str(path).rstrip("/"), None
    p = epath.Path(path)
    if not p.exists():
        raise config_lib.ConfigError(f"{what} '{path}' does not exist{steps_near(p)}; give a run dir, its "
                                     "checkpoints/ dir or a step dir in it")
    if p.name.isdigit() and ((p / "meta").exists() or (p / "state").exists()):
        return str(p.parent), int(p.name)
    return checkpoint_dir_of(str(p)), None


def steps_near(missing) -> str:
    """For a step directory that does not exist: '; committed steps there: 50, 100' (else '')."""
    parent = epath.Path(missing).parent
    if not epath.Path(missing).name.isdigit() or not parent.is_dir():
        return ""
    steps = [str(s.step) for s in scan(str(parent)) if s.state == "committed"]
    return f"; committed steps there: {', '.join(steps)}" if steps else f"; {parent} holds no committed step"


def describe_mesh(meta: dict | None) -> str:
    if not meta:
        return "?"
    axes = ",".join(f"{a}={n}" for a, n in meta["mesh"].items() if n > 1) or "1 device"
    return f"{axes} ({meta['devices']} devices, {meta['processes']} process{'es' * (meta['processes'] > 1)})"


def check_run_dir(run_dir: str) -> None:
    if not epath.Path(run_dir).exists():
        raise config_lib.ConfigError(f"run directory '{run_dir}' does not exist")
    if not epath.Path(run_dir).is_dir():
        raise config_lib.ConfigError(f"'{run_dir}' is a file; pass the run directory (the run_dir of a training, "
                                     f"e.g. runs/demo) or its checkpoint directory")


def list_main(run_dir: str) -> int:
    """`shardtrain ckpt RUN_DIR`: one line per checkpoint step."""
    check_run_dir(run_dir)
    ckpt_dir = checkpoint_dir_of(run_dir)
    steps = scan(ckpt_dir)
    if not steps:
        print(f"no checkpoints in {ckpt_dir}")
        return 0
    print(f"checkpoints in {ckpt_dir}")
    print(f"{'step':>8}  {'state':<11}  {'size':>10}  mesh written from")
    for s in steps:
        meta = read_meta(s.path) if s.state == "committed" else None
        mesh = describe_mesh(meta) if s.state == "committed" else \
            "half-written: the process stopped during the save" if s.state == "uncommitted" else s.note
        if s.state == "committed" and not (s.path / integrity.FILE).exists():
            mesh += "; no checksums (written before shardtrain recorded them)"
        print(f"{s.step:>8}  {s.state:<11}  {disk_bytes(s.path) / 1e6:>7.2f} MB  {mesh}")
    return 0


def verify_main(run_dir: str) -> int:
    """`shardtrain ckpt --verify RUN_DIR`: reads every committed step of both tiers (the local tier's
    directory from run_dir/config.yaml) against its checksums, one line per step; returns 0 when none
    is damaged, 1 when one is (or does not read back). A step without checksums is said, not failed."""
    check_run_dir(run_dir)
    checks = [(f"step {s.step}", functools.partial(verify_step, s.path))
              for s in scan(checkpoint_dir_of(run_dir)) if s.state == "committed"]
    checks += [(f"local step {step.name} ({step.parent.name})", functools.partial(integrity.verify_local, step))
               for step in local_steps(run_dir)]
    if not checks:
        print(f"no committed checkpoints of {run_dir}")
    damaged = 0
    for name, check in checks:
        try:
            verdict = "intact" if check() else "no checksums (written before shardtrain recorded them), not verified"
        except integrity.Damaged as e:
            verdict, damaged = f"damaged: {e}", damaged + 1
        except Exception as e:  # noqa: BLE001 - unreadable is damaged too
            verdict, damaged = f"damaged: does not read back ({type(e).__name__}: {str(e)[:200]})", damaged + 1
        print(f"{name}: {verdict}", flush=True)
    if damaged:
        print(f"{damaged} of {len(checks)} checkpoint steps are damaged; a resume skips them (moving them to "
              f"{UNUSABLE_DIR}/) and starts from the newest intact one")
    return 1 if damaged else 0


def verify_step(step_dir: epath.Path) -> bool:
    """integrity.verify; for a step without checksums, the files every step holds are checked (present,
    JSON, not empty) so that a step restore cannot read is never called intact."""
    if integrity.verify(step_dir):
        return True
    from shardtrain.checkpoint import diagnose  # imports jax: only here
    if bad := diagnose.damaged_files(step_dir):
        raise integrity.Damaged(integrity.summary(bad))
    return False


def local_steps(run_dir: str) -> list[Path]:
    """The committed local-tier step directories of the run (every process's on this host), from
    the local directory named in run_dir/config.yaml."""
    saved = Path(run_dir) / "config.yaml"
    cfg = (yaml.safe_load(saved.read_text()) or {}) if saved.exists() else {}
    local_dir = ((cfg.get("checkpoint") or {}).get("local") or {}).get("directory")
    if not local_dir or not Path(local_dir).is_dir():
        return []
    mine = {str(cfg.get("run_dir")), str(Path(run_dir).resolve())}
    found = []
    for step in sorted(Path(local_dir).glob("process-*/[0-9]*"), key=lambda p: (p.parent.name, int(p.name))):
        try:
            owner = json.loads((step / "meta.json").read_text()).get("run_dir")
        except (OSError, ValueError):
            owner = None  # unreadable meta: verify says so
        if owner is None or owner in mine or str(Path(owner).resolve()) in mine:
            found.append(step)
    return found
