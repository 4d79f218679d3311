"""Timetables of the explicit pipeline schedules (1F1B, interleaved 1F1B, zero-bubble ZB-H1): which
operation each stage runs in each slot of the lockstep loop that `schedules.py` compiles.

A schedule is first an order of operations per stage (`orders`): F (a micro-batch's forward through
one group of layers), B (its backward: for 1F1B the whole backward, for zero-bubble only the input
gradient) and W (zero-bubble: the weight gradient, deferred into the bubble). `timetable` then
places each stage's operations in that order, each in the first slot where its inputs exist (F after
the previous virtual stage's F of that micro-batch, B after the next one's B or after this one's F
on the last virtual stage, W after this stage's B): slot t's messages arrive at slot t + 1.

Virtual stage s = r P + p is group of layers r of stage p (interleaved: r < v repeats; else v = 1),
as in pipeline.py's circular layout. Pure Python, no JAX: the tables are constants of the program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

IDLE, F, F_FIRST, F_LAST, B, B_FIRST, W = range(7)
"""Operation kinds in the table: F_FIRST also embeds (virtual stage 0), F_LAST also applies the
head and the loss and their backward (the last virtual stage), B_FIRST also the embedding's backward."""

SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble")


class Op(NamedTuple):
    kind: str  # "F", "B" or "W"
    micro: int
    repeat: int


@dataclass(frozen=True)
class Timetable:
    """Per slot t and stage p: `kind[t, p]` (IDLE, F, ...), `micro[t, p]`, `repeat[t, p]` of the
    operation; `window`: the micro-batches a stage holds per repeat at once (buffers' slots, indexed
    micro mod window); `live`: the most micro-batches whose residuals one stage holds at once, over
    its repeats (the schedule's activation bound)."""

    kind: np.ndarray
    micro: np.ndarray
    repeat: np.ndarray
    window: int
    live: int

    @property
    def slots(self) -> int:
        return self.kind.shape[0]

    def bubble_fraction(self) -> float:
        """Idle slots / all slots, every operation counted as one slot (F, B and W alike)."""
        return float((self.kind == IDLE).mean())


def orders(name: str, stages: int, micro: int, repeats: int = 1) -> list[list[Op]]:
    """Each stage's F and B in order (zero-bubble's W are placed by `timetable`)."""
    if name == "interleaved_1f1b":
        return [_interleaved(p, stages, micro, repeats) for p in range(stages)]
    return [_one_f_one_b(p, stages, micro) for p in range(stages)]


def _one_f_one_b(p: int, stages: int, micro: int) -> list[Op]:
    """1F1B: P - 1 - p warm-up forwards, then one forward one backward, then the backwards left."""
    warm = min(stages - 1 - p, micro)
    out = [Op("F", m, 0) for m in range(warm)]
    for i in range(micro):
        if warm + i < micro:
            out.append(Op("F", warm + i, 0))
        out.append(Op("B", i, 0))
    return out


def _interleaved(p: int, stages: int, micro: int, repeats: int) -> list[Op]:
    """Megatron's interleaved 1F1B: forwards run P micro-batches through repeat 0, then those through
    repeat 1, ...; backwards the same with the repeats reversed; (P - 1 - p) 2 + (v - 1) P warm-up
    forwards (needs M a multiple of P)."""
    n = micro * repeats

    def op(kind, k, backward):
        group, r = k // (stages * repeats), (k // stages) % repeats
        return Op(kind, group * stages + k % stages, repeats - 1 - r if backward else r)
    warm = min((stages - 1 - p) * 2 + (repeats - 1) * stages, n)
    out = [op("F", k, False) for k in range(warm)]
    for i in range(n):
        if warm + i < n:
            out.append(op("F", warm + i, False))
        out.append(op("B", i, True))
    return out


def timetable(name: str, stages: int, micro: int, repeats: int = 1) -> Timetable:
    """Places `orders(name, ...)` in slots (module docstring); kinds with embedding / head marked.
    Zero-bubble (ZB-H1): a stage runs its oldest pending W whenever its next F or B cannot run yet,
    or when that F would hold more than P micro-batches (1F1B's bound), and its last W at the end."""
    plan, last, split = orders(name, stages, micro, repeats), stages * repeats - 1, name == "zero_bubble"
    done: dict[tuple[str, int, int], int] = {}
    position, pending, rows = [0] * stages, [[] for _ in range(stages)], []

    def ready(op: Op, p: int, t: int) -> bool:
        s = op.repeat * stages + p
        need = {"F": ("F", s - 1) if s else None, "B": ("B", s + 1) if s < last else ("F", s)}[op.kind]
        held = position[p] - 2 * len(done_w[p]) - len(pending[p]) if split else 0
        return (need is None or done.get((need[0], need[1], op.micro), t) < t) and not (
            split and op.kind == "F" and held >= stages)

    done_w: list[list[Op]] = [[] for _ in range(stages)]
    while any(position[p] < len(plan[p]) or pending[p] for p in range(stages)):
        t, row = len(rows), []
        for p in range(stages):
            op = plan[p][position[p]] if position[p] < len(plan[p]) else None
            if op is None or not ready(op, p, t):
                op = pending[p][0] if pending[p] else None
            row.append(op)
        if not any(row):
            raise ValueError(f"pipeline schedule {name} deadlocks (P={stages}, M={micro}, v={repeats})")
        for p, op in enumerate(row):
            if op is None:
                continue
            done[(op.kind, op.repeat * stages + p, op.micro)] = t
            if op.kind == "W":
                done_w[p].append(pending[p].pop(0))
                continue
            position[p] += 1
            if split and op.kind == "B":
                pending[p].append(Op("W", op.micro, op.repeat))
        rows.append(row)

    kind = np.zeros((len(rows), stages), np.int32)
    micro_t, repeat_t = np.zeros_like(kind), np.zeros_like(kind)
    for t, row in enumerate(rows):
        for p, op in enumerate(row):
            if op is None:
                continue
            s = op.repeat * stages + p
            kind[t, p] = {"F": F_FIRST if s == 0 else F_LAST if s == last else F,
                          "B": B_FIRST if s == 0 else B, "W": W}[op.kind]
            micro_t[t, p], repeat_t[t, p] = op.micro, op.repeat
    window, live = _window(done, stages, micro, repeats, name == "zero_bubble", len(rows))
    return Timetable(kind, micro_t, repeat_t, window, live)


def _window(done, stages, micro, repeats, split, slots) -> tuple[int, int]:
    """(window, live): a stage holds micro-batch m of repeat r from its input's arrival (the previous
    virtual stage's F, or its own F on virtual stage 0) to its last use (W, or B without a split);
    window: the most held at once per repeat, checked to be consecutive micro-batches (so micro mod
    window names distinct slots); live: the most held at once over a stage's repeats."""
    window = live = 1
    for p in range(stages):
        held = np.zeros((slots + 1, repeats, micro), bool)
        for r in range(repeats):
            s = r * stages + p
            for m in range(micro):
                start = done[("F", s - 1, m)] + 1 if s else done[("F", s, m)]
                end = done[("W" if split else "B", s, m)]
                held[start:end + 1, r, m] = True
        for t in range(slots):
            for r in range(repeats):
                ms = np.flatnonzero(held[t, r])
                if len(ms) and ms[-1] - ms[0] + 1 != len(ms):
                    raise AssertionError("pipeline timetable holds non-consecutive micro-batches")
                window = max(window, len(ms))
            live = max(live, int(held[t].sum()))
    return window, live

