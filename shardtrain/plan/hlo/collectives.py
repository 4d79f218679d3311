"""Collectives read from a program's text, attributed to mesh axes, with the bytes they move.

Two programs can be read:
- `collectives`: the optimized (SPMD-partitioned) HLO, `compiled.as_text()`: every collective,
  including the ones GSPMD inserts, with per-device shapes; collectives inside while loops are
  multiplied by their loops' trip counts, those inside a conditional's branches count once (see
  `conditional_branches`). The CPU compiler upcasts bf16 collectives to f32 here.
- `lowered_collectives`: the lowered StableHLO, `lowered.as_text()`: only the collectives written by
  hand inside `jax.shard_map` (psum, all_gather, all_to_all ...), in the dtype they were written in;
  shapes are per manual shard but global over the auto axes (so compare ratios, not absolute bytes).

For each collective we find its kind, its size in bytes per device, how often it runs and the mesh
axes its device groups span. Byte conventions, per device and per execution:

  bytes          the size of the (full, unsharded) array the collective works on: the reduced
                 array of an all-reduce, the gathered result of an all-gather, the input of a
                 reduce-scatter, the buffer sent by a collective-permute, the array of an all-to-all;
                 for a ragged all-to-all (whose sizes are known only at run time) its output buffer,
                 an upper bound on what it moves.
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

from shardtrain.plan.hlo.parse import (
    DTYPE_BYTES,
    Instr,
    Module,
    arrays,
    as_module,
    callees,
    multipliers,
    root,
    tuple_index,
)

_CHANNEL = re.compile(r"channel_id=(\d+)")
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all", "ragged-all-to-all")


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


def ring_factor(kind: str, n: int) -> float:
    """Ring-model bytes each device moves per byte of the collective's array (see module doc)."""
    return {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(kind, (n - 1) / n)


def collectives(program: str | Module, mesh_shape: dict[str, int],
                branch_weights: dict[int, tuple[float, ...]] | None = None) -> list[Collective]:
    """Every collective of the optimized HLO (its text or the parsed Module), one entry per
    instruction and kind; one in a conditional's branch counts that branch's runs
    (`branch_weights`: see `parse.multipliers`)."""
    module = as_module(program)
    mult = multipliers(module, branch_weights=branch_weights)
    tainted = _partition_scalars(module)
    n_devices = math.prod(mesh_shape.values())
    fused_in = {callee: name for name, comp in module.computations.items() for ins in comp if ins.opcode == "fusion"
                for _, callee in callees(ins)}
    seen = set()
    out = []
    for cname, comp in module.computations.items():
        if not mult[cname]:
            continue
        for ins in comp:
            kind = ins.opcode.removesuffix("-start")
            if kind not in KINDS:
                continue
            # the TPU compiler splits an async collective into start / compute / done fusions of one
            # computation that each hold a copy of it (one channel): one collective
            channel = _CHANNEL.search(ins.line)
            if channel and cname in fused_in:
                key = (channel.group(1), fused_in[cname])
                if key in seen:
                    continue
                seen.add(key)
            groups = device_groups(ins.line, n_devices)
            n = len(groups[0]) if groups else 1
            axes = group_axes(groups, mesh_shape)
            for k, part in _parts(ins, kind, n, comp, tainted[cname]).items():
                b = sum(size for _, size in part)
                out.append(Collective(k, b, b * ring_factor(k, n), mult[cname], n, axes,
                                      tuple(dict.fromkeys(dtype for dtype, _ in part)), cname))
    return out


def _parts(ins: Instr, kind: str, n: int, comp: list[Instr], tainted: set[str]) -> dict[str, list]:
    """kind -> the (dtype, bytes) arrays of one collective instruction that do that kind's work: an
    all-reduce's tuple elements that only this device's slice is taken of are a reduce-scatter."""
    sizes = arrays(ins.shape)
    if ins.opcode in ("all-gather-start", "all-to-all-start"):  # (operands, results): the results
        sizes = sizes[len(sizes) // 2:]
    elif ins.opcode == "reduce-scatter-start":  # (operands, results) on GPUs: the operands
        sizes = sizes[:len(sizes) // 2]
    elif ins.opcode == "collective-permute-start":
        sizes = sizes[:1]
    elif ins.opcode == "all-reduce-start" and ins.shape.startswith("(("):  # ((operands), results): XLA:GPU
        sizes = sizes[len(sizes) // 2:]  # of jax 0.12 aliases the operands into the start op's result
    elif kind == "reduce-scatter":
        sizes = [(dtype, b * n) for dtype, b in sizes]  # the printed shape is the result
    if kind != "all-reduce":
        return {kind: sizes}
    parts = defaultdict(list)
    sliced = _sliced_by_partition(comp, ins.name, tainted)
    for i, part in enumerate(sizes):
        parts["reduce-scatter" if (i in sliced or (-1 in sliced and len(sizes) == 1)) else "all-reduce"].append(part)
    return parts


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


def _partition_scalars(module: Module) -> dict[str, set[str]]:
    """Per computation, the scalars derived from the partition id, followed into while bodies
    through loop-invariant tuple elements (a rolled scan computes its shard offsets outside the loop)."""
    tainted: dict[str, set[str]] = defaultdict(set)
    carried: dict[str, set[int]] = defaultdict(set)  # body -> tainted tuple indices of its parameter
    for name, comp in module.callers_first():
        t = tainted[name]
        params = {i.name for i in comp if i.opcode == "parameter"}
        for ins in comp:
            if ins.opcode in ("partition-id", "replica-id"):
                t.add(ins.name)
            elif ins.opcode == "get-tuple-element" and ins.operands[0] in params and \
                    tuple_index(ins) in carried[name]:
                t.add(ins.name)
            elif ins.shape.split("{")[0].endswith("[]") and t.intersection(ins.operands):
                t.add(ins.name)
        by_name = {i.name: i for i in comp}
        for ins in comp:
            body = re.search(r"\bbody=%([\w.\-]+)", ins.line) if ins.opcode == "while" else None
            init = by_name.get(ins.operands[0]) if body else None
            if init is None or init.opcode != "tuple" or body.group(1) not in module.computations:
                continue
            body_comp = module.computations[body.group(1)]
            last = root(body_comp)
            gte = {i.name: tuple_index(i) for i in body_comp if i.opcode == "get-tuple-element"}
            carried[body.group(1)] |= {k for k, op in enumerate(init.operands) if op in t and last.opcode == "tuple"
                                       and k < len(last.operands) and gte.get(last.operands[k]) == k}
    return tainted


def _sliced_by_partition(comp: list[Instr], name: str, tainted: set[str]) -> set[int]:
    """Tuple indices (or {-1} for a plain result) of all-reduce `name` whose every consumer also
    takes a value derived from the partition id (a dynamic-slice of this device's shard)."""
    consumers = defaultdict(list)
    index_of = {name: -1}
    for ins in comp:
        if ins.opcode == "get-tuple-element" and ins.operands == [name]:
            index_of[ins.name] = tuple_index(ins)
    for ins in comp:
        for operand in ins.operands:
            if operand in index_of and ins.opcode != "get-tuple-element":
                consumers[index_of[operand]].append(ins)
    return {idx for idx, users in consumers.items()
            if users and all(u.opcode == "dynamic-slice" or tainted.intersection(u.operands) for u in users)}


def dcn_reductions(program: str | Module, dcn_axes: tuple[str, ...], slices: int) -> list[Collective]:
    """Reductions across TPU slices in a multi-slice program: libtpu writes them not as all-reduces
    but as host-transfer `send`s to the multi-slice (megascale) runtime, each with
    `_xla_megascale_reduce_operation`; one per reduced array (the first element of the send's
    shape), multiplied by its loops' trip counts, over the mesh axes that cross slices."""
    module = as_module(program)
    mult = multipliers(module)
    out = []
    for name, instrs in module.computations.items():
        for ins in instrs:
            if ins.opcode == "send" and "_xla_megascale_reduce_operation" in ins.line:
                size = arrays(ins.shape)[0][1]
                out.append(Collective("all-reduce", size, size * ring_factor("all-reduce", slices), mult[name] or 1,
                                      slices, dcn_axes))
    return out


def conditional_branches(program: str | Module) -> set[str]:
    """Computations that run only inside a branch of a compiled HLO `conditional` (e.g. local SGD's
    sync every H steps), including what those branches call."""
    inside: set[str] = set()
    for name, comp in as_module(program).callers_first():
        for ins in comp:
            if ins.opcode == "conditional" or name in inside:
                inside.update(callee for key, callee in callees(ins)
                              if name in inside or key in ("branch_computations", "true_computation",
                                                           "false_computation"))
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
        named = re.search(r"replica_group_mesh_axes<.*?axes = \[(.*?)\]>", attrs)
        if named:  # jax >= 0.12 names the mesh axes: `replica_group_mesh_axes<mesh = @m, axes = [...]>`
            names = set(re.findall(r'name = "(\w+)"', named.group(1)))
            n = math.prod(mesh_shape[a] for a in names)
            axes = tuple(a for a in mesh_shape if a in names and mesh_shape[a] > 1)
        else:
            if kind == "collective-permute":
                pairs = re.search(r"source_target_pairs = dense<(.*?)>", attrs).group(1)
                groups = [[int(a), int(b)] for a, b in re.findall(r"\[(\d+), (\d+)\]", pairs)]
            else:
                spec = re.search(r"replica_groups = dense<(.*?)>", attrs).group(1)
                groups = [[int(x) for x in g.split(",")] for g in re.findall(r"\[([\d, ]+)\]", spec)] or \
                    [[int(x) for x in re.findall(r"\d+", spec)]]
            n, axes = len(groups[0]), group_axes(groups, mesh_shape)
        b = sum(size for _, size in sizes)
        out.append(Collective(kind, b, b * ring_factor(kind, n), 1, n, axes,
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
    for row in table.values():  # a branch's weighted runs are whole runs of a schedule's slots
        row["count"] = round(row["count"])
        row["bytes"], row["traffic_bytes"] = int(row["bytes"]), int(row["traffic_bytes"])
    return dict(sorted(table.items()))
