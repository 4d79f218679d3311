"""What every benchmark here shares: the prologue, one interleaved timer, and the results ledger.

Importing this module is the prologue: it asks for 8 simulated CPU devices (unless XLA_FLAGS already
names a device count; it must run before jax is imported) and puts the repository root on sys.path,
so a script run as `.venv/bin/python bench/NAME.py` imports shardtrain and models from the checkout.

- `interleaved(variants, rounds)`: runs each variant once per round, in turn, so that the load of this
  noisy machine falls on all of them alike; compare medians (ratios), not absolute times.
- `record(script, figures)`: appends one JSON line to bench/results/<script>.jsonl with the machine,
  the package versions, the git commit and the date; bench/README.md quotes those records.
- `bare_loop_batches(prog, steps)`: the first global batches as device arrays, for benchmarks that
  call the compiled step in a plain loop instead of the trainer's.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DEVICES = 8

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VERSIONED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorstore", "grain", "libtpu")
"""Packages whose versions each record carries (those installed)."""


def interleaved(variants: dict[str, Callable[[], float]], rounds: int = 3) -> dict[str, list[float]]:
    """{name: [what variant() returned in each round]}: every round runs each variant once, in turn."""
    out = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            out[name].append(run())
    return out


def git_commit() -> str:
    """The checkout's commit, with `-dirty` when tracked files differ from it ('unknown' outside git)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short=12", "HEAD")
    if not commit:
        return "unknown"
    return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine() -> dict:
    """Where a record was measured: host, cores, memory, the jax backend and its devices."""
    import jax
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    return {"host": platform.node(), "cpus": os.cpu_count(), "memory_gib": round(memory / 2**30, 1) if memory else None,
            "python": platform.python_version(), "backend": jax.default_backend(),
            "devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind}


def versions() -> dict:
    found = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def record(script: str, figures: dict, **context) -> dict:
    """Appends {script, date, commit, machine, versions, **context, figures} to
    bench/results/<script>.jsonl and returns it. `script`: the bench script's name (its file stem);
    `context`: what was measured (config, overrides, flags)."""
    rec = {"script": script, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "commit": git_commit(), "machine": machine(), "versions": versions(), **context, "figures": figures}
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / f"{script}.jsonl", "a") as f:
        f.write(json.dumps(rec, sort_keys=False) + "\n")
    return rec


def bare_loop_batches(prog, steps: int) -> list:
    """The first `steps` global batches of a step.Program as device arrays."""
    from shardtrain.data import loader
    it = loader.batches(loader.samples(prog.cfg), prog.cfg.train.global_batch_size, prog.local_rows(), 0, steps)
    return [prog.device_batch(b) for _, b in it]
