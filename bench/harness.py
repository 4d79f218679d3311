"""What every benchmark here shares: the prologue, one interleaved timer, and the results ledger.

Importing this module is the prologue: it asks for 8 simulated CPU devices (unless XLA_FLAGS already
names a device count; it must run before jax is imported) and puts the repository root on sys.path,
so a script run as `.venv/bin/python bench/NAME.py` imports shardtrain and models from the checkout.
Every script starts with `import harness  # isort: split`, before jax.

- `interleaved(variants, rounds)`: runs each variant once per round, in turn, so that the load of this
  noisy machine falls on all of them alike; compare medians (ratios), not absolute times.
- `Stepper(compiled, state, batches, steps)`: a variant for `interleaved` that runs a compiled train
  step on its own state and returns each step's wall time.
- `record(script, figures, **context)`: appends one JSON line to bench/results/<script>.jsonl with the
  machine, the package versions, the git commit and the date; bench/README.md quotes those records.
  `SHARDTRAIN_BENCH_RESULTS=DIR` sends records and result files to DIR instead (trial runs).
- `bare_loop_batches(prog, steps)`: the first global batches as device arrays, for benchmarks that
  call the compiled step in a plain loop instead of the trainer's.
- `train_demo`, `run_losses`, `plot_losses`: the demo trained once per value of one config field
  (`shardtrain train` in a subprocess), its logged losses, and their curves in one plot
  (bench/quantization.py, bench/optimizers.py).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(os.environ.get("SHARDTRAIN_BENCH_RESULTS") or ROOT / "bench" / "results")
"""Where records (<script>.jsonl) and result files (JSON, plots) go."""
DEVICES = 8
STARTED = time.time()
"""When the prologue ran: a record's `wall_s` is the script's run time up to the record."""

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = \
        f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VERSIONED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorstore", "grain", "libtpu")
"""Packages whose versions each record carries (those installed)."""


def interleaved(variants: dict[str, Callable[[], Any]], rounds: int = 3, *,
                alternate: bool = False) -> dict[str, list]:
    """{name: [what variant() returned in each round]}: every round runs each variant once, in turn.
    `alternate`: odd rounds run the variants in reverse order, so that none always goes first."""
    out = {name: [] for name in variants}
    for r in range(rounds):
        order = list(variants.items())
        for name, run in order[::-1] if alternate and r % 2 else order:
            out[name].append(run())
    return out


def flat(rounds: list[list]) -> list:
    """A variant's per-round lists (`interleaved` of a `Stepper`) as one list, in order."""
    return [x for r in rounds for x in r]


class Stepper:
    """Calls a compiled train step on its own state, cycling through `batches`: each call runs `steps`
    steps, waits for each one's metrics, and returns their wall times (a variant for `interleaved`).
    The state is donated to the step, so the stepper keeps the new one; `losses` holds every step's loss."""

    def __init__(self, compiled, state, batches: list, steps: int = 1):
        self.compiled, self.state, self.batches, self.steps = compiled, state, list(batches), steps
        self.calls, self.losses = 0, []

    def __call__(self) -> list[float]:
        import jax
        times = []
        for _ in range(self.steps):
            batch = self.batches[self.calls % len(self.batches)]
            self.calls += 1
            t0 = time.perf_counter()
            self.state, metrics = self.compiled(self.state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
            self.losses.append(float(metrics["loss"]))
        return times


def git_commit() -> str:
    """The checkout's commit, with `-dirty` when tracked files differ from it ('unknown' outside git)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short=12", "HEAD")
    if not commit:
        return "unknown"
    return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine() -> dict:
    """Where a record was measured: host, cores, memory, load, the jax backend and its devices."""
    import jax
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    return {"host": platform.node(), "cpus": os.cpu_count(), "memory_gib": round(memory / 2**30, 1) if memory else None,
            "load_avg": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
            "backend": jax.default_backend(), "devices": jax.device_count(),
            "device_kind": jax.devices()[0].device_kind}


def versions() -> dict:
    found = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def _plain(x):
    """JSON for what json does not know: numpy scalars and arrays, paths, anything else as its str."""
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


def record(script: str, figures: dict, **context) -> dict:
    """Appends {script, date, commit, machine, versions, argv, wall_s, **context, figures} to
    bench/results/<script>.jsonl and returns it. `script`: the bench script's name (its file stem);
    `figures`: the numbers it printed; `context`: what was measured (config, overrides, flags)."""
    rec = {"script": script, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "commit": git_commit(), "machine": machine(), "versions": versions(), "argv": sys.argv[1:],
           "wall_s": round(time.time() - STARTED, 1), **context, "figures": figures}
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / f"{script}.jsonl", "a") as f:
        f.write(json.dumps(rec, default=_plain) + "\n")
    print(f"recorded in {RESULTS / f'{script}.jsonl'}", file=sys.stderr)
    return rec


def bare_loop_batches(prog, steps: int) -> list:
    """The first `steps` global batches of a step.Program as device arrays."""
    from shardtrain.data import loader
    it = loader.batches(loader.samples(prog.cfg), prog.cfg.train.global_batch_size, prog.local_rows(), 0, steps)
    return [prog.device_batch(b) for _, b in it]


def train_demo(out: Path, steps: int, field: str, values: Iterable[str], prefix: str) -> None:
    """`shardtrain train meshes/demo.yaml` for `steps` steps with each of `values` of `field`, one after
    another, into out/<prefix>_<value> (seed 0 for all: the same initial weights and batches)."""
    for value in values:
        subprocess.run([sys.executable, "-m", "shardtrain.cli", "train", "meshes/demo.yaml", f"train.steps={steps}",
                        f"{field}={value}", f"run_dir={out / f'{prefix}_{value}'}", "checkpoint.every_steps=1000"],
                       cwd=ROOT, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def run_losses(run_dir: Path) -> dict[int, float]:
    """{step: loss} of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "step" in r}


def plot_losses(final: dict[str, float], curves: dict[str, dict[int, float]], path: Path, what: str,
                top: float = 3.0) -> None:
    """The curves smoothed over 10 steps, each labelled with its `final` loss (the last-20-step mean)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=80)
    for name, c in curves.items():
        steps = sorted(c)
        smooth = [statistics.mean(c[t] for t in steps[max(0, i - 9):i + 1]) for i in range(len(steps))]
        ax.plot(steps, smooth, label=f"{name}: {final[name]:.3f}", linewidth=1)
    ax.set(xlabel="step", ylabel="loss (10-step mean)", ylim=(1.0, top),
           title=f"demo GPT, {what} (last-20-step mean in the legend)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
