"""One trainer per run dir: run_dir/.lock.

Process 0 of a run holds an exclusive `flock` on run_dir/.lock for the run's life and keeps a
JSON record in it (host, pid, start time, a heartbeat renewed every HEARTBEAT_S seconds); the
other processes of a job learn its outcome through a broadcast, so a job of many processes holds
one lock and refuses or starts as one. Only process 0 locks: flock between hosts is as good as the
shared filesystem makes it (NFS carries it as a byte-range lock; a Lustre mount without -o flock
or a bucket mounted through FUSE keep it on one host or refuse it), and one lock per process would
make the processes of one job refuse each other.

A second `train` finds the flock held and stops before it writes anything (ConfigError: exit 2),
naming the holder. A lock whose owner is gone is taken over with a line saying so: on this host
the kernel releases a dead process's flock (kill -9 included); a record from another host counts
as its owner's until its heartbeat is STALE_S seconds old, also where the filesystem's flock does
not reach across hosts. A run that ends empties the record.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

from shardtrain.config import ConfigError

FILE = ".lock"
HEARTBEAT_S = 10.0
STALE_S = 60.0
"""A record of another host whose heartbeat is this old belongs to a dead run."""


def holder(path: Path) -> dict | None:
    """The lock record at `path`; None when there is none (never locked, or its run ended)."""
    try:
        record = json.loads(path.read_text() or "null")
    except (OSError, ValueError):  # absent, or being rewritten this instant
        return None
    return record if isinstance(record, dict) else None


def describe(record: dict) -> str:
    return f"pid {record.get('pid')} on host {record.get('host')}, started {record.get('started')}"


def refusal(run_dir: str, path: Path, record: dict | None) -> str:
    who = describe(record) if record else "another process (its record is unreadable)"
    return (f"run_dir={run_dir} is being trained by {who} (lock {path}); wait for it to end, stop it "
            f"(SIGTERM or Ctrl-C saves and exits), or give this run another run_dir")


class Lock:
    """The run dir's lock, held by this process (process 0 of its job) until `close`."""

    def __init__(self, run_dir: str, say=print):
        self.path = Path(run_dir) / FILE
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            flocked = True
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                self.file.close()  # EWOULDBLOCK: a live process holds it
                raise ConfigError(refusal(run_dir, self.path, holder(self.path))) from None
            flocked = False  # a filesystem without flock: the record and its heartbeat alone decide
        previous = holder(self.path)
        if previous is not None:
            reason = self._stale(previous, flocked)
            if reason is None:
                self.file.close()
                raise ConfigError(refusal(run_dir, self.path, previous))
            say(f"lock: took over {self.path} from {describe(previous)}: {reason}")
        self.record = {"host": socket.gethostname(), "pid": os.getpid(),
                       "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "run_dir": str(run_dir)}
        self._write()
        self.stopped = threading.Event()
        threading.Thread(target=self._beat, name="shardtrain-lock", daemon=True).start()

    @staticmethod
    def _stale(record: dict, flocked: bool) -> str | None:
        """Why the run of `record` is over, or None while it may still be running."""
        if record.get("host") == socket.gethostname():
            if flocked:
                return "it is no longer running (its flock was released)"
            try:
                os.kill(int(record.get("pid", 0)), 0)
            except ProcessLookupError:
                return "its process is gone"
            except (OSError, ValueError):
                pass
            return None
        age = time.time() - float(record.get("heartbeat", 0))
        return f"its heartbeat is {age:.0f} s old (stale after {STALE_S:.0f} s)" if age > STALE_S else None

    def _write(self) -> None:
        self.file.seek(0)
        self.file.truncate()
        self.file.write(json.dumps({**self.record, "heartbeat": time.time()}) + "\n")
        self.file.flush()

    def _beat(self) -> None:
        while not self.stopped.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):  # a full disk: the run's own files stop it
                self._write()

    def close(self) -> None:
        """Ends the run's hold: empties the record (a clean end needs no takeover) and unlocks."""
        self.stopped.set()
        with contextlib.suppress(OSError):
            self.file.seek(0)
            self.file.truncate()
        self.file.close()  # releases the flock


@contextlib.contextmanager
def held(run_dir: str, process_index: int, process_count: int, say=print):
    """Holds run_dir's lock for the block: process 0 takes it; with several processes, every process
    learns whether it did (a broadcast), and all raise the same ConfigError when it did not."""
    lock, refused = None, None
    if process_index == 0:
        try:
            lock = Lock(run_dir, say)
        except ConfigError as e:
            refused = e
    if process_count > 1:
        import numpy as np
        from jax.experimental import multihost_utils
        ok = bool(multihost_utils.broadcast_one_to_all(np.int32(refused is None)))
        if not ok and refused is None:
            path = Path(run_dir) / FILE
            refused = ConfigError(refusal(run_dir, path, holder(path)))
    if refused is not None:
        raise refused
    try:
        yield
    finally:
        if lock is not None:
            lock.close()
