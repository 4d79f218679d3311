"""The text of an optimized HLO module (`compiled.as_text()`) read into computations of
instructions, and its call graph: how many times each computation runs per step.

HLO text prints each computation as a header line `%name (params) -> shape {`, one instruction per
line (`%x = f32[8,128]{1,0} opcode(%a, %b), attrs`) and a closing `}`; the entry computation's
header starts with `ENTRY`. A callee is printed before its callers, so walking the computations in
reverse text order (`Module.callers_first`) meets every caller before what it calls: that is how
multipliers, partition-id taint and conditional branches propagate from the entry downwards.

A while loop's body runs its trip count times: XLA's `known_trip_count` where the compiler prints
one (CPU, GPU), else read from a condition `counter < N` whose counter starts at a constant (the
TPU compiler prints none). The MoE dispatch's overflow rounds (named scope `moe_overflow_rounds`,
models/moe.py) run zero times: the plan is for routing within the receive buffer.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Iterator

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
               # StableHLO spellings
               "i1": 1, "i8": 1, "ui8": 1, "i16": 2, "ui16": 2, "i32": 4, "ui32": 4, "i64": 8, "ui64": 8}
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = ")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+) .*\{\s*$")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_CALLEES = re.compile(r"\b(body|condition|to_apply|calls|branch_computations|called_computations|true_computation|"
                      r"false_computation)="
                      r"(\{[^}]*\}|%[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_FUSION_CALLEE = re.compile(r"calls=%([\w.\-]+)")
_OVERFLOW = "/moe_overflow_rounds/"  # models/moe.py's OVERFLOW_SCOPE: rounds that balanced routing does not run


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    line: str


@dataclasses.dataclass
class Module:
    """A parsed HLO module: computation name -> instructions, in the order of the text (callees
    before callers), and the name of the entry computation."""
    computations: dict[str, list[Instr]]
    entry: str | None

    def callers_first(self) -> Iterator[tuple[str, list[Instr]]]:
        """(name, instructions) of every computation, each caller before the computations it calls."""
        for name in reversed(self.computations):
            yield name, self.computations[name]


def parse_module(text: str) -> Module:
    """Reads the text of an HLO module (parse once, then hand the Module to cost and collectives)."""
    comps: dict[str, list[Instr]] = {}
    entry = current = None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = comps.setdefault(m.group(1), [])
                entry = m.group(1) if line.startswith("ENTRY") else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if not m:  # an instruction's attributes can hold newlines (a Pallas kernel's metadata)
            if current:
                current[-1].line += "\n" + line
            continue
        shape, tail = _split_shape(line[m.end():])
        op = _OPCODE.match(tail)
        if op:
            current.append(Instr(m.group(1), shape, op.group(1), _operands(tail[op.end():]), line))
    return Module(comps, entry if entry is not None else (list(comps)[-1] if comps else None))


def as_module(program: str | Module) -> Module:
    """The parsed module of HLO text, or the Module itself (the public readers take either)."""
    return program if isinstance(program, Module) else parse_module(program)


def _split_shape(rest: str) -> tuple[str, str]:
    """'(f32[2], f32[]) all-reduce(...' -> ('(f32[2], f32[])', 'all-reduce(...')."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[:i + 1], rest[i + 1:]
    shape, _, tail = rest.partition(" ")
    return shape, " " + tail


def _operands(call: str) -> list[str]:
    """Operand names of 'opcode(%a, %b), attrs' (the text after the opcode's parenthesis)."""
    depth, end = 1, len(call)
    for i, ch in enumerate(call):
        depth += (ch in "({") - (ch in ")}")
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", call[:end])


# ----------------------------------------------------------------------------- shapes and attributes


def arrays(shape_str: str) -> list[tuple[str, float]]:
    """(dtype, bytes) of each array in an HLO shape string (a tuple gives several)."""
    return [(dtype, DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(shape_str) if dtype in DTYPE_BYTES]


def dims(shape: str) -> list[int]:
    """Dimensions of the first array of a shape string ([] for a scalar or none)."""
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def size(shape: str) -> float:
    """Bytes of all arrays of a shape string."""
    return sum(b for _, b in arrays(shape))


def root(comp: list[Instr]) -> Instr | None:
    """A computation's ROOT instruction (the last one where none is marked)."""
    return next((i for i in comp if i.line.lstrip().startswith("ROOT")), comp[-1] if comp else None)


def tuple_index(ins: Instr) -> int:
    """The element a get-tuple-element takes."""
    return int(re.search(r"index=(\d+)", ins.line).group(1))


def callees(ins: Instr) -> list[tuple[str, str]]:
    """(attribute, computation) for every computation an instruction calls: ('body', 'while_body.3')."""
    return [(key, name) for key, value in _CALLEES.findall(ins.line) for name in re.findall(r"%([\w.\-]+)", value)]


def fusion_callee(ins: Instr) -> str:
    """The fused computation of a `fusion` instruction."""
    return _FUSION_CALLEE.search(ins.line).group(1)


# ----------------------------------------------------------------------------- call graph


def multipliers(module: Module, trips: bool = True, branch_weights: dict[int, tuple[float, ...]] | None = None
                ) -> dict[str, float]:
    """How many times each computation runs per execution of the entry computation (with
    trips=False: loop bodies once, as `cost_analysis()` counts them). A conditional's branches
    count as running each time it does, unless `branch_weights[n]` gives the fraction of its runs
    each of a conditional's n branches takes (an explicit pipeline schedule's timetable)."""
    mult = defaultdict(int)
    mult[module.entry] = 1
    for name, comp in module.callers_first():
        if not mult[name]:
            continue
        for ins in comp:
            trip = trip_count(ins, comp, module)
            called = callees(ins)
            branches = [c for key, c in called if key == "branch_computations"]
            weights = (branch_weights or {}).get(len(branches)) if ins.opcode == "conditional" else None
            for key, callee in called:
                share = weights[branches.index(callee)] if weights and key == "branch_computations" else 1
                mult[callee] += mult[name] * (trip if (trips and trip is not None and key == "body") else 1) * share
    return mult


def trip_count(ins: Instr, caller: list[Instr], module: Module) -> int | None:
    """Iterations of a while loop: XLA's known_trip_count, else counted from its condition; None
    for any other instruction and for loops whose count the text does not give."""
    if ins.opcode == "while" and _OVERFLOW in ins.line:
        return 0
    known = _TRIP.search(ins.line)
    return int(known.group(1)) if known else _counted_trips(ins, caller, module)


def loop_trip_counts(program: str | Module) -> list[int]:
    """The trip count of every while loop of the module whose count is known, in text order."""
    module = as_module(program)
    counts = (trip_count(ins, comp, module) for comp in module.computations.values() for ins in comp
              if ins.opcode == "while")
    return [n for n in counts if n is not None]


def _counted_trips(ins: Instr, caller: list[Instr], module: Module) -> int | None:
    """Trip count of a while loop without XLA's known_trip_count (the TPU compiler prints none) whose
    condition is `counter < N` and whose counter starts at a constant; None when it is not that."""
    cond = re.search(r"\bcondition=%([\w.\-]+)", ins.line) if ins.opcode == "while" else None
    body = module.computations.get(cond.group(1), []) if cond else []
    last = root(body)
    if last is None or last.opcode != "compare" or "direction=LT" not in last.line:
        return None
    local, outer = {i.name: i for i in body}, {i.name: i for i in caller}
    counter, limit = (local.get(o) for o in last.operands[:2])
    init = outer.get(ins.operands[0]) if ins.operands else None
    if not (counter and limit and init and counter.opcode == "get-tuple-element" and limit.opcode == "constant"
            and init.opcode == "tuple"):
        return None
    start = outer.get(init.operands[tuple_index(counter)])
    while start is not None and start.opcode in ("copy", "bitcast"):
        start = outer.get(start.operands[0])
    values = [re.search(r"constant\((-?\d+)\)", i.line) if i and i.opcode == "constant" else None
              for i in (start, limit)]
    return int(values[1].group(1)) - int(values[0].group(1)) if all(values) else None
