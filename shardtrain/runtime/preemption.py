"""Stopping a run on request: SIGTERM (a scheduler's preemption notice, launch/local.sh) and Ctrl-C.

The first SIGTERM or SIGINT asks for a save at the next step boundary and exit 75 (EXIT_PREEMPTED:
Ctrl-C is a preemption too, so supervisors treat both alike and a rerun resumes). A second SIGINT
exits at once (130). Before the first step of this start has finished (building, compiling,
restoring, a first step that never ends) there is nothing to save: either signal exits at once
(75) with a line saying nothing was trained. A step boundary that does not come within
max(GRACE_S, 3x the longest recent step interval) of the signal (a step or a write that never
returns) ends the process too, without a save.

Python runs signal handlers only between bytecodes of the main thread, which may sit in the
compiler or wait on a device for minutes; so the signals also wake a thread (signal.set_wakeup_fd)
that decides, whatever the main thread is doing.

With several processes JAX's preemption sync point turns a SIGTERM to any process into the same
step boundary on all (JAX's own handler receives it); SIGINT is passed on to it as a SIGTERM, and
the exits before the first step and after the grace apply to a lone process only. A process
started with SIGINT ignored (`cmd &` in a script, as launch/local.sh starts its processes) keeps
ignoring it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import deque

EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130
GRACE_S = 30.0


class Preemption:
    """Install at the start of a run (main thread); `reached(step)` at every step boundary; `close`."""

    def __init__(self, process_index: int, process_count: int):
        self.requested = False
        self.multiprocess = process_count > 1
        self.main = process_index == 0
        self.signals, self.last = 0, None
        self.intervals: deque[float] = deque(maxlen=100)
        self.answered = threading.Event()
        self.previous, self.previous_fd, self.pipe = {}, None, None
        if threading.current_thread() is not threading.main_thread():
            return  # an embedding thread: signals stay the application's
        caught = [signal.SIGINT] if self.multiprocess else [signal.SIGINT, signal.SIGTERM]
        if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # started to ignore it (`cmd &` in a script,
            caught.remove(signal.SIGINT)                         # launch/local.sh): it stays ignored
        self.pipe = os.pipe()
        os.set_blocking(self.pipe[1], False)
        self.previous = {s: signal.signal(s, lambda *_: None) for s in caught}  # the thread below acts
        self.previous_fd = signal.set_wakeup_fd(self.pipe[1], warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(self.pipe[0],), name="shardtrain-signals", daemon=True).start()

    def close(self) -> None:
        if self.pipe is None:
            return
        signal.set_wakeup_fd(self.previous_fd)
        for s, handler in self.previous.items():
            if handler is not None:  # None: a handler not installed from Python, which cannot be put back
                signal.signal(s, handler)
        os.close(self.pipe[1])  # the thread reads EOF and ends
        self.pipe = None

    def reached(self, step: int) -> bool:
        """Whether the run stops after `step` (every process gets the same answer)."""
        now = time.monotonic()
        if self.last is not None:
            self.intervals.append(now - self.last)
        self.last = now
        if self.multiprocess:
            from jax.experimental import multihost_utils
            stop = multihost_utils.reached_preemption_sync_point(step)
        else:
            stop = self.requested
        if stop:
            self.answered.set()
        return stop

    def request(self) -> None:
        """Stops the run at the next step boundary as a signal would (the run's own files failed)."""
        if self.multiprocess:
            os.kill(os.getpid(), signal.SIGTERM)  # JAX's handler: every process stops at the same step
        self.requested = True

    @property
    def trained(self) -> bool:
        """A step of this start has finished: `reached` ran twice, and the loop reads a step's
        values back before it dispatches the next."""
        return len(self.intervals) > 0

    def _watch(self, fd: int) -> None:
        while data := os.read(fd, 64):
            for number in data:
                if number in (signal.SIGINT, signal.SIGTERM):
                    self._received(signal.Signals(number))
        os.close(fd)

    def _received(self, sig: signal.Signals) -> None:
        self.signals += 1
        name = "Ctrl-C (SIGINT)" if sig == signal.SIGINT else sig.name
        if sig == signal.SIGINT and self.signals > 1:
            self._leave(f"{name} again: stopping now, without waiting for the save in flight", EXIT_INTERRUPTED)
        if self.multiprocess:
            os.kill(os.getpid(), signal.SIGTERM)  # to JAX's handler and the sync point
            return
        if not self.trained:
            self._leave(f"{name} before the first step of this start finished: nothing was trained; stopping "
                        f"now (exit {EXIT_PREEMPTED}); rerun the same command to start or resume", EXIT_PREEMPTED)
        self.requested = True
        if self.signals == 1:
            self._say(f"{name}: saving a checkpoint at the end of the current step, then stopping "
                      f"(Ctrl-C again to stop at once)")
            grace = max(GRACE_S, 3 * max(self.intervals, default=0.0))
            threading.Thread(target=self._deadline, args=(name, grace), daemon=True).start()

    def _deadline(self, name: str, grace: float) -> None:
        if not self.answered.wait(grace):
            self._leave(f"{name}: no step boundary within {grace:.0f} s (a step or a write that does not return); "
                        f"stopping without a save; rerun to resume from the newest checkpoint", EXIT_PREEMPTED)

    def _say(self, text: str) -> None:
        if self.main:
            print(f"\nshardtrain: {text}", file=sys.stderr, flush=True)

    def _leave(self, text: str, code: int) -> None:
        self._say(text)
        os._exit(code)
