"""Fault injection for tests, off unless the environment variable SHARDTRAIN_FAULT is set.

SHARDTRAIN_FAULT is a comma-separated list of KIND@STEP:
  nan@N   step N's gradients are NaN on every process (compiled into the step: only then does
          the step differ from the normal one);
  hang@N  process 0 sleeps inside step N (the others then wait in its collectives);
  kill@N  the last process kills itself (SIGKILL) inside step N, once the checkpoint writes in
          flight have landed (so that a test knows what each tier holds);
  lose@N  the same, and it first deletes its part of the local tier (a host that does not come back).
Each fault fires once per run directory: firing writes run_dir/faults/KIND@N, so a restarted
job does not meet it again.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

from shardtrain.config import ConfigError

VARIABLE = "SHARDTRAIN_FAULT"
KINDS = ("nan", "hang", "kill", "lose")


def parse(text: str | None) -> dict[str, int]:
    """{kind: step} from a SHARDTRAIN_FAULT value ('' or None: no fault)."""
    faults = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        m = re.fullmatch(r"(\w+)@(\d+)", part)
        if not m or m.group(1) not in KINDS or int(m.group(2)) < 1:
            raise ConfigError(f"{VARIABLE}={text!r}: expected KIND@STEP[,KIND@STEP...] with KIND one of "
                              f"{', '.join(KINDS)} and STEP >= 1, e.g. {VARIABLE}=nan@5")
        faults[m.group(1)] = int(m.group(2))
    return faults


class Faults:
    """The faults still to fire in this run directory."""

    def __init__(self, run_dir: str, process_index: int, process_count: int, env=os.environ):
        self.marks = Path(run_dir) / "faults"
        self.index, self.count = process_index, process_count
        self.pending = {k: s for k, s in parse(env.get(VARIABLE)).items() if not (self.marks / f"{k}@{s}").exists()}

    def nan_step(self) -> int | None:
        """The step whose gradients are to be NaN (compiled into the step; marked when it runs)."""
        return self.pending.get("nan")

    def _mark(self, kind: str, step: int) -> None:
        self.marks.mkdir(parents=True, exist_ok=True)
        (self.marks / f"{kind}@{step}").touch()

    def inside_step(self, step: int, persistent, local) -> None:
        """Called by every process before it dispatches step `step`; `persistent`: the run's
        manager.Checkpointer; `local`: this process's part of the local tier (local.LocalTier) or None."""
        if self.pending.get("nan") == step:
            self._mark("nan", step)
        if self.pending.get("hang") == step and self.index == 0:
            self._mark("hang", step)
            time.sleep(24 * 3600)
        for kind in ("kill", "lose"):
            if self.pending.get(kind) == step and self.index == self.count - 1:
                self._mark(kind, step)
                persistent.wait()
                if local is not None:
                    local.wait()
                if kind == "lose" and local is not None:
                    shutil.rmtree(local.dir, ignore_errors=True)
                os.kill(os.getpid(), signal.SIGKILL)
