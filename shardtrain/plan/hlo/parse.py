"""Collectives read from a program's text, attributed to mesh axes, with the bytes they move.

Two programs can be read:
- `collectives`: the optimized (SPMD-partitioned) HLO, `compiled.as_text()`: every collective,
  including the ones GSPMD inserts, with per-device shapes; collectives inside while loops are
  multiplied by XLA's known trip count, those inside a conditional's branches count once (see
  `conditional_branches`). The CPU compiler upcasts bf16 collectives to f32 here.
- `lowered_collectives`: the lowered StableHLO, `lowered.as_text()`: only the collectives written by
  hand inside `jax.shard_map` (psum, all_gather, all_to_all ...), in the dtype they were written in;
  shapes are per manual shard but global over the auto axes (so compare ratios, not absolute bytes).

For each collective we find its kind, its size in bytes per device, how often it runs and the mesh
axes its device groups span. Byte conventions, per device and per execution:

  bytes          the size of the (full, unsharded) array the collective works on: the reduced
                 array of an all-reduce, the gathered result of an all-gather, the input of a
                 reduce-scatter, the buffer sent by a collective-permute, the array of an all-to-all.
  traffic_bytes  what a bandwidth-optimal ring moves in and out of each device: 2(n-1)/n x bytes
                 for an all-reduce, (n-1)/n x bytes for all-gather, reduce-scatter and all-to-all,
                 1 x bytes for a collective-permute (n = devices in the group).

The CPU compiler writes a reduce-scatter as an all-reduce whose result is only ever sliced by the
device's own partition id; such all-reduces (per tuple element) are reported as `reduce-scatter`,
which is what they do (and what a TPU/GPU compiler emits).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
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


@dataclasses.dataclass
class Collective:
    kind: str
    bytes: float
    traffic_bytes: float
    count: int
    """Executions per step (trip counts of enclosing loops included)."""
    group_size: int
    axes: tuple[str, ...]
    dtypes: tuple[str, ...] = ()
    """Element types as the program spells them (compiled: f32, s8 ...; lowered: f32, i8 ...)."""
    computation: str = ""
    """Enclosing computation (compiled HLO) or "" (lowered)."""


def arrays(shape_str: str) -> list[tuple[str, float]]:
    """(dtype, bytes) of each array in an HLO shape string (a tuple gives several)."""
    return [(dtype, DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(shape_str) if dtype in DTYPE_BYTES]


def _ring(kind: str, n: int) -> float:
    """Ring-model bytes each device moves per byte of the collective's array (see module doc)."""
    return {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(kind, (n - 1) / n)


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


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    line: str


def _root(comp: list[Instr]) -> Instr | None:
    """A computation's ROOT instruction (the last one where none is marked)."""
    return next((i for i in comp if i.line.lstrip().startswith("ROOT")), comp[-1] if comp else None)


def _tuple_index(ins: Instr) -> int:
    """The element a get-tuple-element takes."""
    return int(re.search(r"index=(\d+)", ins.line).group(1))


def parse_module(text: str) -> dict[str, list[Instr]]:
    """Computation name -> instructions, in the order of the text (callees before callers)."""
    comps: dict[str, list[Instr]] = {}
    current = None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = comps.setdefault(m.group(1), [])
                if line.startswith("ENTRY"):
                    comps["__entry__"] = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        shape, tail = _split_shape(line[m.end():])
        op = _OPCODE.match(tail)
        if op:
            current.append(Instr(m.group(1), shape, op.group(1), _operands(tail[op.end():]), line))
    return comps


def multipliers(comps: dict[str, list[Instr]], trips: bool = True) -> dict[str, int]:
    """How many times each computation runs per execution of the entry computation (with
    trips=False: loop bodies once, as `cost_analysis()` counts them)."""
    comps = dict(comps)
    entry = comps.pop("__entry__", None)
    names = list(comps)
    mult = defaultdict(int)
    entry_name = next((n for n in names if comps[n] is entry), names[-1] if names else None)
    mult[entry_name] = 1
    for name in reversed(names):  # callers are printed after their callees
        if not mult[name]:
            continue
        for ins in comps[name]:
            trip = _TRIP.search(ins.line)
            trip = int(trip.group(1)) if trip else _counted_trips(ins, comps[name], comps)
            for key, value in _CALLEES.findall(ins.line):
                for callee in re.findall(r"%([\w.\-]+)", value):
                    times = trip if (trips and trip and key == "body") else 1
                    mult[callee] += mult[name] * times
    return mult


def _counted_trips(ins: Instr, caller: list[Instr], comps: dict[str, list[Instr]]) -> int | None:
    """Trip count of a while loop without XLA's known_trip_count (the TPU compiler prints none) whose
    condition is `counter < N` and whose counter starts at a constant; None when it is not that."""
    cond = re.search(r"\bcondition=%([\w.\-]+)", ins.line) if ins.opcode == "while" else None
    body = comps.get(cond.group(1), []) if cond else []
    root = _root(body)
    if root is None or root.opcode != "compare" or "direction=LT" not in root.line:
        return None
    local, outer = {i.name: i for i in body}, {i.name: i for i in caller}
    counter, limit = (local.get(o) for o in root.operands[:2])
    init = outer.get(ins.operands[0]) if ins.operands else None
    if not (counter and limit and init and counter.opcode == "get-tuple-element" and limit.opcode == "constant"
            and init.opcode == "tuple"):
        return None
    start = outer.get(init.operands[_tuple_index(counter)])
    while start is not None and start.opcode in ("copy", "bitcast"):
        start = outer.get(start.operands[0])
    values = [re.search(r"constant\((-?\d+)\)", i.line) if i and i.opcode == "constant" else None
              for i in (start, limit)]
    return int(values[1].group(1)) - int(values[0].group(1)) if all(values) else None


_NO_MEMORY = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
              "after-all", "partition-id", "replica-id"}
_SLICES = ("slice", "dynamic-slice")
_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "compare", "select",
                "and", "or", "xor", "not", "clamp", "sign", "floor", "ceil", "remainder"}


def _dims(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _size(shape: str) -> float:
    return sum(b for _, b in arrays(shape))


def _fusion_bytes(ins: Instr, shapes: dict[str, str], body: list[Instr]) -> float:
    """Bytes a fusion reads and writes: its operands and result, except that an operand the fusion
    only slices counts as the slices, and an array it updates in place (a dynamic-update-slice
    root) as the update."""
    shapes_in = {i.name: i.shape for i in body}
    root = _root(body)
    in_place = root.operands[0] if root.opcode == "dynamic-update-slice" else None
    users = defaultdict(list)
    for i in body:
        for o in i.operands:
            users[o].append(i)
    total = _size(shapes_in[root.operands[1]]) if in_place else _size(ins.shape)
    for p in body:
        if p.opcode != "parameter" or p.name == in_place:
            continue
        index = int(re.search(r"parameter\((\d+)\)", p.line).group(1))
        full = _size(shapes.get(ins.operands[index], "")) if index < len(ins.operands) else 0.0
        if users[p.name] and all(u.opcode in _SLICES and u.operands[0] == p.name for u in users[p.name]):
            full = min(full, sum(_size(u.shape) for u in users[p.name]))
        total += full
    return total


def _convolution_flops(ins: Instr, shapes: dict[str, str]) -> float:
    """2 x batch x output features x input features x the (output, kernel) position pairs that land
    inside the input: the TPU compiler writes dots as convolutions, batched ones with a padded window."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.line)
    lhs, rhs = (_dims(shapes.get(o, "")) for o in ins.operands[:2])
    out = _dims(ins.shape)
    if not labels or not lhs or not rhs or "dilate" in ins.line:
        return 0.0
    lhs_l, rhs_l, out_l = labels.groups()
    window = re.search(r"window=\{([^}]*)\}", ins.line)
    attrs = dict(kv.split("=") for kv in window.group(1).split()) if window else {}
    n_spatial = sum(c.isdigit() for c in out_l)
    size = [int(x) for x in attrs["size"].split("x")] if "size" in attrs else [1] * n_spatial
    pads = [tuple(map(int, p.split("_"))) for p in attrs["pad"].split("x")] if "pad" in attrs else [(0, 0)] * n_spatial
    strides = [int(x) for x in attrs["stride"].split("x")] if "stride" in attrs else [1] * n_spatial
    pairs = 1
    for d in range(n_spatial):
        n_in, n_out = lhs[lhs_l.index(str(d))], out[out_l.index(str(d))]
        pairs *= sum(1 for o in range(n_out) for k in range(size[d]) if 0 <= o * strides[d] + k - pads[d][0] < n_in)
    return 2.0 * out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")] * pairs


def _own_cost(comp: list[Instr], comps: dict[str, list[Instr]], fused: bool) -> tuple[float, float]:
    """(FLOPs, bytes read + written) of a computation's own instructions, counted as XLA's cost
    analysis does: 2mnk per dot, one per element of element-wise ops and reduce inputs
    (transcendentals are not FLOPs there). A fused computation's instructions work in registers:
    its memory traffic is the fusion instruction's (`_fusion_bytes`)."""
    shapes = {i.name: i.shape for i in comp}
    flops = nbytes = 0.0
    for ins in comp:
        if ins.opcode == "dot":
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.line).group(1)
            lhs = _dims(shapes.get(ins.operands[0], ""))
            k = math.prod(lhs[int(d)] for d in contracting.split(",") if d) if lhs else 0
            flops += 2 * math.prod(_dims(ins.shape)) * k
        elif ins.opcode == "convolution":
            flops += _convolution_flops(ins, shapes)
        elif ins.opcode in _ELEMENTWISE:
            flops += math.prod(_dims(ins.shape))
        elif ins.opcode == "reduce":
            flops += math.prod(_dims(shapes.get(ins.operands[0], "")))
        if fused or ins.opcode in _NO_MEMORY:
            continue
        callee = comps.get(_FUSION_CALLEE.search(ins.line).group(1)) if ins.opcode == "fusion" else None
        if callee is not None:
            nbytes += _fusion_bytes(ins, shapes, callee)
        elif ins.opcode in _SLICES:
            nbytes += 2 * _size(ins.shape)
        elif ins.opcode == "dynamic-update-slice":
            nbytes += 2 * _size(shapes.get(ins.operands[1], ""))
        else:
            nbytes += _size(ins.shape) + sum(_size(shapes.get(o, "")) for o in ins.operands)
    return flops, nbytes


def loop_repeats_cost(text: str) -> tuple[float, float]:
    """(FLOPs, bytes) per device that `compiled.cost_analysis()` leaves out: it counts a while
    loop's body once, however many times it runs. From the optimized HLO: the FLOPs and the bytes
    read and written by the instructions of every computation (`_own_cost`, which reproduces cost
    analysis's single-pass totals within 1% on the demo GPT's programs), times the extra runs that
    loops' known trip counts give it (a pipeline's schedule, a rolled layer scan, gradient
    accumulation)."""
    comps = parse_module(text)
    with_trips, once = multipliers(comps), multipliers(comps, trips=False)
    fused = {_FUSION_CALLEE.search(ins.line).group(1) for comp in comps.values() for ins in comp
             if ins.opcode == "fusion"}
    flops = nbytes = 0.0
    for name, comp in comps.items():
        extra = with_trips[name] - once[name] if name != "__entry__" else 0
        if extra > 0:
            f, b = _own_cost(comp, comps, name in fused)
            flops, nbytes = flops + extra * f, nbytes + extra * b
    return flops, nbytes


def device_groups(line: str, n_devices: int) -> list[list[int]]:
    """Replica groups of a collective as lists of global device ids (= partition ids)."""
    m = re.search(r"source_target_pairs=\{(.*?)\}\}?,", line + ",")
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(0))]
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
                  r"(?: \{([^}]*)\})?", line)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        dims = [int(s) for _, s in axes]
        ids = np.arange(math.prod(dims))
        if m.group(2):
            ids = ids.reshape([int(d) for d in m.group(2).split(",")])
            if m.group(3):
                ids = ids.transpose([int(p) for p in m.group(3).split(",")])
        ids = ids.reshape(dims)
        names = [a for a, _ in axes]
        group_axes = re.findall(r"'([^']+)'", m.group(4)) if m.group(4) is not None else names
        keep = [names.index(a) for a in group_axes]
        rest = [i for i in range(len(names)) if i not in keep]
        size = math.prod(dims[i] for i in keep)
        return ids.transpose(rest + keep).reshape(-1, size).tolist()
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        ids = np.arange(int(m.group(1)) * int(m.group(2))).reshape([int(d) for d in m.group(3).split(",")])
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",")])
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if m and m.group(1):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    return [list(range(n_devices))]


def group_axes(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """Mesh axes along which the members of the groups differ (partition p sits at mesh position
    np.unravel_index(p, mesh shape), the order of jit's device assignment)."""
    names, dims = list(mesh_shape), list(mesh_shape.values())
    spanned = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.array(group), dims)).T
        spanned |= {i for i in range(len(dims)) if len(set(coords[:, i])) > 1}
    return tuple(names[i] for i in sorted(spanned))


def _partition_scalars(comps: dict[str, list[Instr]]) -> dict[str, set[str]]:
    """Per computation, the scalars derived from the partition id, followed into while bodies
    through loop-invariant tuple elements (a rolled scan computes its shard offsets outside the loop)."""
    tainted: dict[str, set[str]] = defaultdict(set)
    carried: dict[str, set[int]] = defaultdict(set)  # body -> tainted tuple indices of its parameter
    names = [n for n in comps if n != "__entry__"]
    for name in reversed(names):  # callers are printed after their callees
        comp, t = comps[name], tainted[name]
        params = {i.name for i in comp if i.opcode == "parameter"}
        for ins in comp:
            if ins.opcode in ("partition-id", "replica-id"):
                t.add(ins.name)
            elif ins.opcode == "get-tuple-element" and ins.operands[0] in params and \
                    _tuple_index(ins) in carried[name]:
                t.add(ins.name)
            elif ins.shape.split("{")[0].endswith("[]") and t.intersection(ins.operands):
                t.add(ins.name)
        by_name = {i.name: i for i in comp}
        for ins in comp:
            body = re.search(r"\bbody=%([\w.\-]+)", ins.line) if ins.opcode == "while" else None
            init = by_name.get(ins.operands[0]) if body else None
            if init is None or init.opcode != "tuple" or body.group(1) not in comps:
                continue
            root = _root(comps[body.group(1)])
            gte = {i.name: _tuple_index(i) for i in comps[body.group(1)] if i.opcode == "get-tuple-element"}
            carried[body.group(1)] |= {k for k, op in enumerate(init.operands) if op in t and root.opcode == "tuple"
                                       and k < len(root.operands) and gte.get(root.operands[k]) == k}
    return tainted


def _sliced_by_partition(comp: list[Instr], name: str, tainted: set[str]) -> set[int]:
    """Tuple indices (or {-1} for a plain result) of all-reduce `name` whose every consumer also
    takes a value derived from the partition id (a dynamic-slice of this device's shard)."""
    consumers = defaultdict(list)
    index_of = {name: -1}
    for ins in comp:
        if ins.opcode == "get-tuple-element" and ins.operands == [name]:
            index_of[ins.name] = _tuple_index(ins)
    for ins in comp:
        for operand in ins.operands:
            if operand in index_of and ins.opcode != "get-tuple-element":
                consumers[index_of[operand]].append(ins)
    return {idx for idx, users in consumers.items()
            if users and all(u.opcode == "dynamic-slice" or tainted.intersection(u.operands) for u in users)}


def collectives(text: str, mesh_shape: dict[str, int]) -> list[Collective]:
    """Every collective of the module (one entry per instruction and kind)."""
    comps = parse_module(text)
    mult = multipliers(comps)
    tainted = _partition_scalars(comps)
    n_devices = math.prod(mesh_shape.values())
    out = []
    for cname, comp in comps.items():
        if cname == "__entry__" or not mult[cname]:
            continue
        for ins in comp:
            kind = ins.opcode.removesuffix("-start")
            if kind not in KINDS:
                continue
            groups = device_groups(ins.line, n_devices)
            n = len(groups[0]) if groups else 1
            axes = group_axes(groups, mesh_shape)
            sizes = arrays(ins.shape)
            if ins.opcode == "all-gather-start":
                sizes = sizes[len(sizes) // 2:]
            elif ins.opcode == "collective-permute-start":
                sizes = sizes[:1]
            elif kind == "reduce-scatter":
                sizes = [(dtype, b * n) for dtype, b in sizes]  # the printed shape is the result
            parts = defaultdict(list)
            if kind == "all-reduce":
                sliced = _sliced_by_partition(comp, ins.name, tainted[cname])
                for i, part in enumerate(sizes):
                    parts["reduce-scatter" if (i in sliced or (-1 in sliced and len(sizes) == 1))
                          else "all-reduce"].append(part)
            else:
                parts[kind] = sizes
            for k, part in parts.items():
                b = sum(size for _, size in part)
                out.append(Collective(k, b, b * _ring(k, n), mult[cname], n, axes,
                                      tuple(dict.fromkeys(dtype for dtype, _ in part)), cname))
    return out


def dcn_reductions(text: str, dcn_axes: tuple[str, ...], slices: int) -> list[Collective]:
    """Reductions across TPU slices in a multi-slice program: libtpu writes them not as all-reduces
    but as host-transfer `send`s to the multi-slice (megascale) runtime, each with
    `_xla_megascale_reduce_operation`; one per reduced array (the first element of the send's
    shape), multiplied by its loops' trip counts, over the mesh axes that cross slices."""
    comps = parse_module(text)
    mult = multipliers(comps)
    out = []
    for name, instrs in comps.items():
        if name == "__entry__":
            continue
        for ins in instrs:
            if ins.opcode == "send" and "_xla_megascale_reduce_operation" in ins.line:
                size = arrays(ins.shape)[0][1]
                out.append(Collective("all-reduce", size, size * _ring("all-reduce", slices), mult[name] or 1,
                                      slices, dcn_axes))
    return out


def conditional_branches(text: str) -> set[str]:
    """Computations that run only inside a branch of a compiled HLO `conditional` (e.g. local SGD's
    sync every H steps), including what those branches call."""
    comps = parse_module(text)
    comps.pop("__entry__", None)
    inside: set[str] = set()
    for name in reversed(list(comps)):  # callers are printed after their callees
        for ins in comps[name]:
            if ins.opcode == "conditional" or name in inside:
                for key, value in _CALLEES.findall(ins.line):
                    if name in inside or key in ("branch_computations", "true_computation", "false_computation"):
                        inside.update(re.findall(r"%([\w.\-]+)", value))
    return inside


_STABLEHLO_OP = re.compile(r'"stablehlo\.(all_reduce|all_gather|reduce_scatter|all_to_all|collective_permute)"')
_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z]\w*)>")


def lowered_collectives(text: str, mesh_shape: dict[str, int]) -> list[Collective]:
    """Collectives written inside shard_map, from the lowered StableHLO (`lowered.as_text()`); each
    counts once."""
    out = []
    for m in _STABLEHLO_OP.finditer(text):
        kind = m.group(1).replace("_", "-")
        tail = text[m.end():]  # the op's attributes, its reduction region if any, its type signature
        sig = re.search(r"\)\s*->\s*(\(.*?\)|tensor<[^>]*>)", tail)
        attrs = tail[:sig.start()]
        types = sig.group(1) if kind in ("all-reduce", "all-gather") else attrs.rsplit(": (", 1)[1]
        sizes = [(dtype, DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split("x") if d))
                 for dims, dtype in _TENSOR.findall(types)]
        if kind == "collective-permute":
            pairs = re.search(r"source_target_pairs = dense<(.*?)>", attrs).group(1)
            groups = [[int(a), int(b)] for a, b in re.findall(r"\[(\d+), (\d+)\]", pairs)]
        else:
            spec = re.search(r"replica_groups = dense<(.*?)>", attrs).group(1)
            groups = [[int(x) for x in g.split(",")] for g in re.findall(r"\[([\d, ]+)\]", spec)] or \
                [[int(x) for x in re.findall(r"\d+", spec)]]
        n = len(groups[0])
        b = sum(size for _, size in sizes)
        out.append(Collective(kind, b, b * _ring(kind, n), 1, n, group_axes(groups, mesh_shape),
                              tuple(dict.fromkeys(dtype for dtype, _ in sizes))))
    return out


def traffic_by_axes(items: list[Collective]) -> dict[tuple[str, ...], float]:
    """Ring-model bytes per device per step, summed by the mesh axes each collective's groups span."""
    total: dict[tuple[str, ...], float] = defaultdict(float)
    for c in items:
        if c.axes:
            total[c.axes] += c.traffic_bytes * c.count
    return dict(total)


def summarize(items: list[Collective]) -> dict[str, dict]:
    """kind -> {count, bytes, traffic_bytes, axes}: totals per device per step."""
    table: dict[str, dict] = {}
    for c in items:
        row = table.setdefault(c.kind, {"count": 0, "bytes": 0, "traffic_bytes": 0, "axes": []})
        row["count"] += c.count
        row["bytes"] += c.bytes * c.count
        row["traffic_bytes"] += c.traffic_bytes * c.count
        axes = "+".join(c.axes) or "none"
        if axes not in row["axes"]:
            row["axes"].append(axes)
    for row in table.values():
        row["bytes"], row["traffic_bytes"] = int(row["bytes"]), int(row["traffic_bytes"])
    return dict(sorted(table.items()))
