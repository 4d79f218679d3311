"""Hangs and stragglers (train.watchdog).

Hang watchdog: a thread of every process watches the time since a step last finished. Past
max(hang_factor x the median step time, hang_min_s), or startup_s until a start has finished
its first step (or while a save or an evaluation runs), it writes every thread's Python stack to
run_dir/hang-process<i>.txt (to stderr when that file cannot be written), says so in one line and
ends the process with
EXIT_HUNG, which a supervisor (launch/local.sh --restarts) treats as a failure to restart from.
A process frozen whole (SIGSTOP, a dead host) cannot do this itself: its peers' watchdogs, or
JAX's heartbeat, stop them instead.

Stragglers: at every log step each process's host time per step (waiting for data, preparing
and dispatching the step: what a slow host lengthens) is gathered; a process above
straggler_factor x the median on straggler_logs consecutive log steps is named.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

from shardtrain.config import WatchdogConfig

EXIT_HUNG = 70
"""Exit code of a process whose watchdog found no step finishing (EX_SOFTWARE)."""
WARM_STEPS = 1


class Watchdog:
    """Call `beat` whenever a step finishes; wrap long known work (a save, an evaluation) in `slow()`."""

    def __init__(self, cfg: WatchdogConfig, run_dir: str, process_index: int, poll_s: float = 1.0):
        self.cfg, self.index = cfg, process_index
        self.path = Path(run_dir) / f"hang-process{process_index}.txt"
        self.times: deque[float] = deque(maxlen=101)
        self.last, self.slow_depth, self.step = time.monotonic(), 0, None
        self.stopped = threading.Event()
        if cfg.hang_factor > 0:
            threading.Thread(target=self._watch, args=(poll_s,), name="shardtrain-watchdog", daemon=True).start()

    def beat(self, step: int, step_time: float | None = None) -> None:
        self.last, self.step = time.monotonic(), step
        if step_time is not None:
            self.times.append(step_time)

    @contextlib.contextmanager
    def slow(self):
        self.slow_depth += 1
        try:
            yield
        finally:
            self.slow_depth -= 1
            self.last = time.monotonic()

    def limit(self) -> float:
        """Seconds without a finished step that count as a hang now."""
        if self.slow_depth or len(self.times) < WARM_STEPS:
            return self.cfg.startup_s
        return max(self.cfg.hang_factor * statistics.median(self.times), self.cfg.hang_min_s)

    def _watch(self, poll_s: float) -> None:
        while not self.stopped.wait(poll_s):
            waited, limit = time.monotonic() - self.last, self.limit()
            if waited > limit:
                self._leave(waited, limit)

    def _leave(self, waited: float, limit: float) -> None:
        """Writes the stacks report, says so and exits; a report that cannot be written (a full
        disk) goes to stderr instead, and the process exits all the same."""
        head = f"no step finished for {waited:.0f} s (limit {limit:.0f} s) after step {self.step}\n"
        try:
            with open(self.path, "w") as f:
                f.write(head)
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
            where = f"Python stacks in {self.path}"
        except OSError as e:
            where = f"cannot write {self.path} ({e.strerror or e}): Python stacks on stderr above"
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
        print(f"shardtrain[process {self.index}]: hang: no step finished for {waited:.0f} s (limit {limit:.0f} s, "
              f"last step {self.step}); {where}; exiting {EXIT_HUNG}", file=sys.stderr, flush=True)
        os._exit(EXIT_HUNG)

    def close(self) -> None:
        self.stopped.set()


def slow_processes(host_s: list[float], factor: float, step_time: float) -> list[int]:
    """The processes whose host time exceeds `factor` x the median and, so that noise of a few
    milliseconds is not named, the median by 5% of the step time."""
    median = statistics.median(host_s)
    return [i for i, t in enumerate(host_s) if t > factor * median and t - median > 0.05 * step_time]


class Stragglers:
    """Counts, per process, consecutive log steps with a slow host time; says who crosses the line."""

    def __init__(self, cfg: WatchdogConfig, n_processes: int):
        self.cfg, self.streak = cfg, [0] * n_processes
        self.on = cfg.straggler_factor > 0 and n_processes > 1

    def update(self, host_s: list[float], step_time: float) -> list[int]:
        """The processes that are slow for exactly straggler_logs log steps now (named once per streak)."""
        slow = set(slow_processes(host_s, self.cfg.straggler_factor, step_time))
        self.streak = [s + 1 if i in slow else 0 for i, s in enumerate(self.streak)]
        return [i for i, s in enumerate(self.streak) if s == self.cfg.straggler_logs]


def gather_host_times(host_s: float) -> list[float]:
    """Every process's `host_s` (a collective: all processes call it at the same log steps)."""
    import numpy as np
    from jax.experimental import multihost_utils
    return [float(x) for x in np.asarray(multihost_utils.process_allgather(np.float32(host_s))).ravel()]
