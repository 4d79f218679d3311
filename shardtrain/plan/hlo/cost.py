"""The FLOPs and bytes that `compiled.cost_analysis()` leaves out of a step: it counts a while
loop's body once, however many times the loop runs (a pipeline's schedule, a rolled layer scan,
gradient accumulation). This module counts each computation's own instructions the way XLA's cost
analysis does and multiplies them by the loop iterations cost analysis skipped (trip count - 1 per
loop level, from `parse.multipliers`).

`program_cost` counts the whole program the same way, for compilers that give no cost analysis
(XLA:GPU compiling for GPUs that are not here).

The counting rules (`_own_cost`): the FLOPs a Pallas kernel declares; 2mnk per dot and per cuBLAS
GEMM, TPU ragged-dot or GPU grouped-matmul (models/grouped_gemm.py) custom call (XLA:GPU's dots,
grouped matmuls, every row of their buffers); per
convolution, 2 x batch x output features x input
features x the (output, kernel) position pairs inside the input (the TPU compiler writes dots as
convolutions); one FLOP per element of element-wise ops and reduce inputs (transcendentals are not
FLOPs there). Bytes are what each instruction reads and writes; a fused computation works in
registers, so its traffic is the fusion instruction's, where an operand the fusion only slices
counts as the slices and an array updated in place counts as the update.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, replace

from shardtrain.plan.hlo.parse import Instr, Module, as_module, callees, dims, fusion_callee, multipliers, root, size

_NO_MEMORY = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
              "after-all", "partition-id", "replica-id", "fusion-done"}  # an async fusion: counted at its start
_SLICES = ("slice", "dynamic-slice")
_ARRAY_TYPE = re.compile(r"\(?([a-z]+\d*(?:e\d+m\d+\w*)?)\[")
_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "compare", "select",
                "and", "or", "xor", "not", "clamp", "sign", "floor", "ceil", "remainder"}


def loop_repeats_cost(program: str | Module, branch_weights: dict[int, tuple[float, ...]] | None = None
                      ) -> tuple[float, float]:
    """(FLOPs, bytes) per device that `compiled.cost_analysis()` leaves out, from the optimized HLO
    (its text or the parsed Module): every computation's own cost times the extra runs that its
    loops' trip counts give it (`branch_weights`: see `parse.multipliers`)."""
    module = as_module(program)
    with_trips, once = multipliers(module, branch_weights=branch_weights), multipliers(module, trips=False)
    fused = _fused(module)
    flops = nbytes = 0.0
    for name, comp in module.computations.items():
        extra = with_trips[name] - once[name]  # -1 for a loop that runs zero times (parse.trip_count)
        if extra:
            f, b = _own_cost(comp, module, name in fused)
            flops, nbytes = flops + extra * f, nbytes + extra * b
    return flops, nbytes


def program_cost(program: str | Module, branch_weights: dict[int, tuple[float, ...]] | None = None
                 ) -> tuple[float, float]:
    """(FLOPs, bytes) per device of the whole program: every computation's own cost times the runs
    its callers and loops give it (`branch_weights`: see `parse.multipliers`)."""
    module = as_module(program)
    runs = multipliers(module, branch_weights=branch_weights)
    fused = _fused(module)
    flops = nbytes = 0.0
    for name, comp in module.computations.items():
        if runs[name] > 0:
            f, b = _own_cost(comp, module, name in fused)
            flops, nbytes = flops + runs[name] * f, nbytes + runs[name] * b
    return flops, nbytes


@dataclass
class LoopBody:
    """One iteration of a while loop's body, outside the loops nested in it: what its collectives
    can overlap with."""
    runs: int
    """Iterations per step (enclosing loops' trips included)."""
    flops: float
    bytes: float
    computations: set[str]
    """The body and the computations it calls, nested loops excluded."""


def loop_bodies(program: str | Module) -> dict[str, LoopBody]:
    """Every while loop body of the program (its text or the parsed Module) that runs, by name."""
    module = as_module(program)
    runs = multipliers(module)
    fused = _fused(module)
    bodies = {callee for comp in module.computations.values() for ins in comp if ins.opcode == "while"
              for key, callee in callees(ins) if key == "body"}
    out = {}
    for body in bodies:
        if not runs[body]:
            continue
        members, stack = set(), [body]
        while stack:
            name = stack.pop()
            if name in members or name not in module.computations:
                continue
            members.add(name)
            stack += [c for ins in module.computations[name] if ins.opcode != "while" for _, c in callees(ins)]
        costs = [_own_cost(module.computations[c], module, c in fused) for c in members]
        out[body] = LoopBody(runs[body], sum(f for f, _ in costs), sum(b for _, b in costs), members)
    return out


def _fused(module: Module) -> set[str]:
    """The computations that fusion instructions call (they work in registers: no memory traffic)."""
    return {fusion_callee(ins) for comp in module.computations.values() for ins in comp
            if ins.opcode in ("fusion", "fusion-start")}


def _own_cost(comp: list[Instr], module: Module, fused: bool) -> tuple[float, float]:
    """(FLOPs, bytes read + written) of a computation's own instructions (see the module doc)."""
    shapes = {i.name: i.shape for i in comp}
    flops = nbytes = 0.0
    for ins in comp:
        if ins.opcode == "fusion-start":  # XLA:GPU's async fusion: ((operands), result, context) -> the fusion
            ins = replace(ins, opcode="fusion", shape=_tuple_elements(ins.shape)[1])
        if ins.opcode in ("dot", "convolution", "custom-call"):
            flops += _declared_flops(ins) or _matmul_flops(ins, shapes)
        elif ins.opcode in _ELEMENTWISE:
            flops += math.prod(dims(ins.shape))
        elif ins.opcode == "reduce":
            flops += math.prod(dims(shapes.get(ins.operands[0], "")))
        if fused or ins.opcode in _NO_MEMORY:
            continue
        callee = module.computations.get(fusion_callee(ins)) if ins.opcode == "fusion" else None
        if callee is not None:
            nbytes += _fusion_bytes(ins, shapes, callee)
        elif ins.opcode in _SLICES:
            nbytes += 2 * size(ins.shape)
        elif ins.opcode == "dynamic-update-slice":
            nbytes += 2 * size(shapes.get(ins.operands[1], ""))
        else:
            nbytes += size(ins.shape) + sum(size(shapes.get(o, "")) for o in ins.operands)
    return flops, nbytes


def matmul_flops_by_dtype(program: str | Module, count: bool = False, moe: bool = False) -> dict[str, float]:
    """Matmul FLOPs per device per step by operand type, loop trips counted: every dot, convolution
    (the TPU compiler's dots), cuBLAS GEMM custom call and TPU / GPU grouped-matmul kernel (`ragged-dot`,
    models/grouped_gemm.py; counted over all its rows, padding included), keyed by its operands' HLO type ("bf16",
    "s8", "f8e4m3fn"; "f8e5m2xf8e4m3fn" when the two differ). The types are the compiled program's
    own, read from the instructions that define the operands. `count`: how many matmuls run instead;
    `moe`: only the MoE experts' grouped matmuls (the kernels, and what their named scope holds where a
    compiler made dense dots of `ragged_dot`)."""
    module = as_module(program)
    mult = multipliers(module)
    out: dict[str, float] = defaultdict(float)
    for name, comp in module.computations.items():
        shapes = {i.name: i.shape for i in comp}
        for ins in comp:
            flops = _matmul_flops(ins, shapes)
            grouped = ins.name.startswith("ragged-dot") or _grouped_gemm_kind(ins)
            if flops and mult[name] and (grouped or not moe or _MOE_SCOPE.search(ins.line)):
                arrays = ins.operands[-2:] if grouped else ins.operands[:2]
                types = [_ARRAY_TYPE.match(shapes.get(o, "")) for o in arrays]
                lhs, rhs = (t.group(1) if t else "?" for t in types)
                out[lhs if lhs == rhs else f"{lhs}x{rhs}"] += (1 if count else flops) * mult[name]
    return dict(out)


_DECLARED_FLOPS = re.compile(r'"cost_estimate":\{"flops":"(\d+)"')


def _declared_flops(ins: Instr) -> float:
    """The FLOPs a Pallas kernel declares (its `cost_estimate`, which the TPU's cost analysis counts):
    the TPU's grouped matmuls (ours: `ragged_dot`'s kernel; MaxText's: megablox `gmm`/`tgmm`) count
    every row of their static buffers, an upper bound on dropless routing's work."""
    found = _DECLARED_FLOPS.search(ins.line) if ins.opcode == "custom-call" else None
    return float(found.group(1)) if found else 0.0


def _matmul_flops(ins: Instr, shapes: dict[str, str]) -> float:
    """FLOPs of a dot (2mnk), a convolution, a cuBLAS GEMM or a TPU / GPU grouped-matmul custom call; else 0."""
    if ins.opcode == "convolution":
        return _convolution_flops(ins, shapes)
    operands = ins.operands[:2]
    if ins.opcode == "dot":
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.line).group(1).split(",")
    elif ins.opcode == "custom-call" and "__cublas" in ins.line and len(ins.operands) >= 2:
        found = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.line)
        contracting = re.findall(r"\d+", found.group(1)) if found else []
    elif ins.opcode == "custom-call" and (ins.name.startswith("ragged-dot") or _grouped_gemm_kind(ins)) \
            and len(ins.operands) >= 2:  # the TPU's / GPU's grouped-matmul kernels, their arrays last
        if len(dims(ins.shape)) == 3:  # dw: (rows, K) x (rows, N) -> (groups, K, N), over the rows
            return 2.0 * math.prod(dims(ins.shape)[1:]) * (dims(shapes.get(ins.operands[-2], "")) or [0])[0]
        operands, contracting = ins.operands[-2:], ["1"]  # (rows, K) x (groups, K, N) -> (rows, N), every row
    else:
        return 0.0
    lhs = dims(shapes.get(operands[0], ""))
    k = math.prod(lhs[int(d)] for d in contracting if d) if lhs else 0
    return 2.0 * math.prod(dims(ins.shape)) * k


_MOE_SCOPE = re.compile(r'op_name="[^"]*[/(]moe_grouped_matmul[/)]')  # models/moe.py's GROUPED_SCOPE
_GROUPED_GEMM = re.compile(r'op_name="[^"]*grouped_gemm_(y|dx|dw)\b')


def _grouped_gemm_kind(ins: Instr) -> str | None:
    """Which product of the GPU grouped-matmul kernels (models/grouped_gemm.py: Mosaic GPU custom
    calls, named by their scope) an instruction is: y, dx, dw; None for any other."""
    found = _GROUPED_GEMM.search(ins.line) if ins.opcode == "custom-call" and "mosaic_gpu" in ins.line else None
    return found.group(1) if found and len(ins.operands) >= 2 else None


def _tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape: "((a, b), c[1,2]{1,0}, u32[])" -> ["(a, b)", "c[1,2]{1,0}", "u32[]"]."""
    out, depth, start, inner = [], 0, 0, shape.strip()[1:-1]
    for i, ch in enumerate(inner):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            out.append(inner[start:i].strip())
            start = i + 1
    return [*out, inner[start:].strip()]


def _fusion_bytes(ins: Instr, shapes: dict[str, str], body: list[Instr]) -> float:
    """Bytes a fusion reads and writes: its operands and result, except that an operand the fusion
    only slices counts as the slices, and an array it updates in place (a dynamic-update-slice
    root) as the update."""
    shapes_in = {i.name: i.shape for i in body}
    last = root(body)
    in_place = last.operands[0] if last.opcode == "dynamic-update-slice" else None
    users = defaultdict(list)
    for i in body:
        for o in i.operands:
            users[o].append(i)
    total = size(shapes_in[last.operands[1]]) if in_place else size(ins.shape)
    for p in body:
        if p.opcode != "parameter" or p.name == in_place:
            continue
        index = int(re.search(r"parameter\((\d+)\)", p.line).group(1))
        full = size(shapes.get(ins.operands[index], "")) if index < len(ins.operands) else 0.0
        if users[p.name] and all(u.opcode in _SLICES and u.operands[0] == p.name for u in users[p.name]):
            full = min(full, sum(size(u.shape) for u in users[p.name]))
        total += full
    return total


def _convolution_flops(ins: Instr, shapes: dict[str, str]) -> float:
    """2 x batch x output features x input features x the (output, kernel) position pairs that land
    inside the input: the TPU compiler writes dots as convolutions, batched ones with a padded window."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.line)
    lhs, rhs = (dims(shapes.get(o, "")) for o in ins.operands[:2])
    out = dims(ins.shape)
    if not labels or not lhs or not rhs or "dilate" in ins.line:
        return 0.0
    lhs_l, rhs_l, out_l = labels.groups()
    window = re.search(r"window=\{([^}]*)\}", ins.line)
    attrs = dict(kv.split("=") for kv in window.group(1).split()) if window else {}
    n_spatial = sum(c.isdigit() for c in out_l)
    sizes = [int(x) for x in attrs["size"].split("x")] if "size" in attrs else [1] * n_spatial
    pads = [tuple(map(int, p.split("_"))) for p in attrs["pad"].split("x")] if "pad" in attrs else [(0, 0)] * n_spatial
    strides = [int(x) for x in attrs["stride"].split("x")] if "stride" in attrs else [1] * n_spatial
    pairs = 1
    for d in range(n_spatial):
        n_in, n_out = lhs[lhs_l.index(str(d))], out[out_l.index(str(d))]
        pairs *= sum(1 for o in range(n_out) for k in range(sizes[d]) if 0 <= o * strides[d] + k - pads[d][0] < n_in)
    return 2.0 * out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")] * pairs
