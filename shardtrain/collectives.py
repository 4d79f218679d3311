"""Collectives read from a program's text, attributed to mesh axes, with the bytes they move.

Two programs can be read:
- the compiled (optimized) HLO, `compiled.as_text()`: every collective, including the ones GSPMD
  inserts, with per-device shapes. The CPU compiler upcasts bf16 collectives to f32 here.
- the lowered StableHLO, `lowered.as_text()`: only the collectives written by hand inside
  `jax.shard_map` (psum, all_gather, all_to_all ...), in the dtype they were written in; shapes are
  per manual shard but global over the auto axes (so compare ratios, not absolute bytes).

`traffic` is the ring-model estimate of bytes each device sends for one execution: all-reduce of B
bytes 2(n-1)/n B, all-gather with result B (n-1)/n B, reduce-scatter with operand B (n-1)/n B,
all-to-all of B (n-1)/n B, collective-permute B.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
from jax.sharding import Mesh

DTYPE_BYTES = {"pred": 1, "i1": 1, "s8": 1, "u8": 1, "i8": 1, "ui8": 1, "bf16": 2, "f16": 2, "s16": 2, "i16": 2,
               "f32": 4, "s32": 4, "u32": 4, "i32": 4, "ui32": 4, "f64": 8, "s64": 8, "u64": 8, "i64": 8}


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str
    """all-reduce, all-gather, reduce-scatter, all-to-all or collective-permute."""
    dtypes: tuple[str, ...]
    nbytes: int
    """Bytes of the result (all-reduce, all-gather) or operand (reduce-scatter, all-to-all, permute)."""
    axes: tuple[str, ...]
    """Mesh axes along which the devices of one group differ."""
    group_size: int
    computation: str
    """Enclosing computation (compiled HLO) or "" (lowered)."""

    @property
    def traffic(self) -> float:
        n = self.group_size
        if n <= 1:
            return 0.0
        factor = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(self.op, (n - 1) / n)
        return factor * self.nbytes


def _axes_of_groups(groups: list[list[int]], mesh: Mesh) -> tuple[str, ...]:
    coords = {int(d): idx for idx, d in np.ndenumerate(np.vectorize(lambda d: d.id)(mesh.devices))}
    varying = set()
    for group in groups:
        first = coords[group[0]]
        for d in group[1:]:
            varying |= {mesh.axis_names[i] for i, (a, b) in enumerate(zip(first, coords[d])) if a != b}
    return tuple(a for a in mesh.axis_names if a in varying)


def _iota_groups(spec: str) -> list[list[int]]:
    """`[4,2]<=[2,2,2]T(0,2,1)` -> explicit groups."""
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(shape).tolist()


def _shape_bytes(text: str, pattern: str) -> tuple[int, tuple[str, ...]]:
    total, dtypes = 0, []
    for dtype, dims in re.findall(pattern, text):
        dims = [int(x) for x in re.split(r"[,x]", dims) if x]
        total += DTYPE_BYTES[dtype] * math.prod(dims)
        dtypes.append(dtype)
    return total, tuple(dict.fromkeys(dtypes))


HLO_OP = re.compile(r"=\s*(\(.*?\)|\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                    r"(?:-start)?\((.*)$")


def from_compiled(text: str, mesh: Mesh) -> list[Collective]:
    """Collectives of an optimized HLO module (`compiled.as_text()`), per-device shapes."""
    out, computation = [], ""
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            computation = head.group(1)
            continue
        m = HLO_OP.search(line)
        if not m:
            continue
        shape, op, rest = m.groups()
        nbytes, dtypes = _shape_bytes(shape, r"(\w+)\[([\d,]*)\]")
        groups = _groups_from_hlo(rest)
        if op == "collective-permute":
            pairs = [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", rest.split("source_target_pairs=")[1])]
            groups, size = pairs, 2
        else:
            size = len(groups[0]) if groups else 1
        if op == "reduce-scatter":
            nbytes *= size  # the printed shape is the result; count the operand
        out.append(Collective(op, dtypes, nbytes, _axes_of_groups(groups, mesh) if groups else (), size, computation))
    return out


def _mesh_groups(sizes: str, device_ids: str | None, grouped: str | None) -> list[list[int]]:
    """`mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}`: XLA's named-axes groups
    over the devices (an iota, optionally permuted); without `{...}` one group of all devices."""
    names_sizes = re.findall(r"'(\w+)'=(\d+)", sizes)
    names = [name for name, _ in names_sizes]
    shape = [int(n) for _, n in names_sizes]
    ids = np.arange(math.prod(shape))
    if device_ids:
        m = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", device_ids)
        ids = ids.reshape([int(x) for x in m.group(1).split(",")])
        if m.group(2):
            ids = ids.transpose([int(x) for x in m.group(2).split(",")])
    ids = ids.reshape(shape)
    inner = [names.index(g) for g in re.findall(r"'(\w+)'", grouped)] if grouped else list(range(len(names)))
    ids = ids.transpose([i for i in range(len(names)) if i not in inner] + inner)
    return ids.reshape(-1, math.prod(ids.shape[len(names) - len(inner):])).tolist()


def _groups_from_hlo(rest: str) -> list[list[int]]:
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^)]*\)?)\))?(?:\s*\{([^}]*)\})?", rest)
    if mesh:
        return _mesh_groups(*mesh.groups())
    m = re.search(r"replica_groups=(\{\{[\d,{} ]*\}\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", rest)
    if not m:
        return []
    spec = m.group(1)
    if spec.startswith("{"):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", spec[1:-1])]
    return _iota_groups(spec)


STABLEHLO_OP = re.compile(r'"stablehlo\.(all_reduce|all_gather|reduce_scatter|all_to_all|collective_permute)"')


def from_lowered(text: str, mesh: Mesh) -> list[Collective]:
    """Collectives written inside shard_map, from the lowered StableHLO (`lowered.as_text()`)."""
    out = []
    for m in STABLEHLO_OP.finditer(text):
        op = m.group(1).replace("_", "-")
        # The op's attributes and, after its reduction region if any, its type signature.
        tail = text[m.end():]
        sig = re.search(r"\)\s*->\s*(\(.*?\)|tensor<[^>]*>)", tail)
        operand_sig = tail[:sig.start()].rsplit(": (", 1)[1]
        attrs = tail[:sig.start()]
        shape_pat = r"tensor<((?:\d+x)*)([a-z]\w*)>"
        chosen = sig.group(1) if op in ("all-reduce", "all-gather") else operand_sig
        nbytes, dtypes = 0, []
        for dims, dtype in re.findall(shape_pat, chosen):
            nbytes += DTYPE_BYTES[dtype] * math.prod(int(x) for x in dims.split("x") if x)
            dtypes.append(dtype)
        if op == "collective-permute":
            pairs = re.search(r"source_target_pairs = dense<(.*?)>", attrs).group(1)
            groups = [[int(a), int(b)] for a, b in re.findall(r"\[(\d+), (\d+)\]", pairs)]
            size = 2
        else:
            g = re.search(r"replica_groups = dense<(.*?)>", attrs).group(1)
            groups = [[int(x) for x in grp.split(",")] for grp in re.findall(r"\[([\d, ]+)\]", g)] or \
                [[int(x) for x in re.findall(r"\d+", g)]]
            size = len(groups[0])
        out.append(Collective(op, tuple(dict.fromkeys(dtypes)), nbytes, _axes_of_groups(groups, mesh), size, ""))
    return out


def traffic_by_axes(collectives: list[Collective], min_bytes: int = 0) -> dict[tuple[str, ...], float]:
    """Ring-model bytes per device per execution, summed by the axes each collective spans."""
    total: dict[tuple[str, ...], float] = {}
    for c in collectives:
        if c.nbytes >= min_bytes and c.axes:
            total[c.axes] = total.get(c.axes, 0.0) + c.traffic
    return total


def conditional_branches(text: str) -> set[str]:
    """Names of the computations that compiled HLO `conditional`s branch to (e.g. local SGD's sync)."""
    names = re.findall(r"(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=(%?[\w.\-]+))", text)
    return {n.lstrip("%") for group in names for part in group for n in re.split(r",\s*", part) if n}
