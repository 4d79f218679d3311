"""Where a run's wall time went, across restarts: run_dir/goodput.jsonl and `shardtrain goodput`.

Process 0 of every start of a run appends to run_dir/goodput.jsonl: a `start` record (the time
the process started), a `ready` record (compile and restore done, the step it starts from), one
`step` record per step with the seconds spent since the previous record by category (every second
is charged to exactly one: `Clock.charge`), and an `end` record when it exits by itself. The report
reads them back: a step whose work a later start redid (it resumed from an older checkpoint) is
`redone_steps`, not productive; the time from a start's last record to the next start is
`restart_gap` (the failure, its detection, the supervisor, the new process's imports), except
after a start that finished its run (`done`), which is not lost time. The categories add up to
wall_s, which is the sum of the starts' spans and those gaps.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

FILE = "goodput.jsonl"
CATEGORIES = ("productive_steps", "startup_compile", "checkpoint_restore", "checkpoint_save", "data_wait", "eval",
              "generation", "redone_steps", "restart_gap", "other")
"""What the report names; `productive_steps` over the wall time is the goodput."""


class Clock:
    """Charges the time since the last charge to one category; process 0 writes the records.
    Nothing is written before `ready` (the run is past its checks): a command refused before then
    (`discard`) leaves goodput.jsonl as it was. A write that fails (a full disk) sets `failed`."""

    def __init__(self, run_dir: str | Path, started: float, write: bool):
        self.path = Path(run_dir) / FILE if write else None
        self.file, self.held, self.failed = None, [], None
        self.last, self.pending = time.time(), {}
        self.record({"kind": "start", "t": started})

    def record(self, row: dict) -> None:
        if self.path is None:
            return
        if self.file is None:
            self.held.append(row)
            return
        self._write([row])

    def _write(self, rows: list[dict]) -> None:
        try:
            self.file = self.file or open(self.path, "a")
            self.file.write("".join(json.dumps(r) + "\n" for r in rows))
            self.file.flush()
        except OSError as e:
            self.failed, self.path = f"cannot write {self.path}: {e.strerror or e}", None

    def discard(self) -> None:
        """The run was refused before it started: write nothing."""
        self.path, self.held = None, []

    def charge(self, category: str) -> None:
        now = time.time()
        self.pending[category] = self.pending.get(category, 0.0) + now - self.last
        self.last = now

    def ready(self, step: int, restore_s: float) -> None:
        """Compiled and restored: the steps start at `step`; the charges start now. Writes the start."""
        self.last, self.pending = time.time(), {}
        self._commit()
        self.record({"kind": "ready", "t": self.last, "step": step, "restore_s": restore_s})

    def _commit(self) -> None:
        if self.path is not None and self.held:
            rows, self.held = self.held, []
            self._write(rows)

    def step(self, step: int) -> None:
        """Step `step` is dispatched: writes what was charged since the previous record."""
        self.charge("step_s")
        self.record({"kind": "step", "t": self.last, "step": step, **self._take()})

    def end(self, reason: str) -> None:
        self.charge("other")
        self.record({"kind": "end", "t": self.last, "reason": reason, **self._take()})

    def _take(self) -> dict:
        out, self.pending = {k: round(v, 6) for k, v in self.pending.items()}, {}
        return out

    def close(self) -> None:
        """A start that failed before `ready` (not refused) is still recorded: its time was lost."""
        self._commit()
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()


CHARGED = ("data_wait", "checkpoint_save", "eval", "generation", "other")
"""Categories `Clock.charge` records under their own names (a step's own time is `step_s`)."""


def starts(records: list[dict]) -> list[list[dict]]:
    """The records grouped by start (each group begins with its `start` record)."""
    groups = []
    for r in records:
        if r.get("kind") == "start" or not groups:
            groups.append([])
        groups[-1].append(r)
    return groups


def report(run_dir: str | Path) -> dict:
    """{"wall_s", "goodput", "starts", "categories": {name: seconds}} of run_dir/goodput.jsonl."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        from shardtrain.config import ConfigError
        raise ConfigError(f"{path} does not exist: goodput is recorded by `shardtrain train` (this version or later)")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line cut short by a kill
            pass
    cats = dict.fromkeys(CATEGORIES, 0.0)
    groups = starts(records)
    for n, group in enumerate(groups):
        later = groups[n + 1] if n + 1 < len(groups) else None
        resumed = next((r["step"] for r in later if r.get("kind") == "ready"), 0) if later else None
        _charge_start(group, resumed, cats)
        last = group[-1]
        if later is not None and not (last.get("kind") == "end" and last.get("reason") == "done"):
            cats["restart_gap"] += max(0.0, later[0]["t"] - last["t"])
    wall = sum(cats.values())
    return {"wall_s": wall, "goodput": cats["productive_steps"] / wall if wall > 0 else 0.0, "starts": len(groups),
            "categories": cats}


def _charge_start(group: list[dict], resumed: int | None, cats: dict) -> None:
    """Adds one start's seconds to `cats`; steps after `resumed` (the next start's first step) were redone."""
    start = group[0]
    ready = next((r for r in group if r.get("kind") == "ready"), None)
    if ready is None:  # died before it trained: all of it was lost to the failure
        cats["restart_gap"] += group[-1]["t"] - start["t"]
        return
    cats["checkpoint_restore"] += ready["restore_s"]
    cats["startup_compile"] += ready["t"] - start["t"] - ready["restore_s"]
    for r in group:
        if r.get("kind") in ("step", "end"):
            redone = resumed is not None and r.get("step", 0) > resumed
            cats["redone_steps" if redone else "productive_steps"] += r.get("step_s", 0.0)
            for cat in CHARGED:
                cats[cat] += r.get(cat, 0.0)


def table(rep: dict) -> str:
    """The report for people: one line per category, then the goodput."""
    wall = rep["wall_s"] or 1.0
    lines = [f"{'category':<20}{'seconds':>12}{'share':>8}"]
    lines += [f"{name:<20}{s:>12.1f}{100 * s / wall:>7.1f}%" for name, s in rep["categories"].items()]
    lines.append(f"{'wall':<20}{rep['wall_s']:>12.1f}   over {rep['starts']} start(s)")
    lines.append(f"goodput {rep['goodput']:.3f} (productive steps / wall time)")
    return "\n".join(lines)


def main(run_dir: str, as_json: bool) -> int:
    rep = report(run_dir)
    print(json.dumps(rep) if as_json else table(rep))
    return 0
