"""Reading a compiled program's HLO text: what `memory_analysis()` and `cost_analysis()` do not say.

- `parse`: the text -> a `Module` of computations and instructions, and its call graph (how many
  times each computation runs: loop trip counts, known or read from the loop condition).
- `cost`: the FLOPs and bytes of the loop iterations that `cost_analysis()` counts once, or of the
  whole program where the compiler gives no cost analysis.
- `collectives`: every collective with its kind, bytes, ring traffic and the mesh axes it spans.

Parse once and hand the Module to each reader (`shardtrain plan` does); each reader also takes the
text and parses it itself:

    module = hlo.parse_module(compiled.as_text())
    flops, nbytes = hlo.loop_repeats_cost(module)
    table = hlo.summarize(hlo.collectives(module, dict(mesh.shape)))

Here `hlo.collectives` is the function; its module is `shardtrain.plan.hlo.collectives`.
"""

from shardtrain.plan.hlo.collectives import (
           KINDS,
           Collective,
           collectives,
           conditional_branches,
           dcn_reductions,
           device_groups,
           group_axes,
           lowered_collectives,
           ring_factor,
           summarize,
           traffic_by_axes,
)
from shardtrain.plan.hlo.cost import LoopBody, loop_bodies, loop_repeats_cost, matmul_flops_by_dtype, program_cost
from shardtrain.plan.hlo.parse import DTYPE_BYTES, Instr, Module, arrays, loop_trip_counts, multipliers, parse_module

__all__ = ["DTYPE_BYTES", "KINDS", "Collective", "Instr", "LoopBody", "Module", "arrays", "collectives",
           "conditional_branches", "dcn_reductions", "device_groups", "group_axes", "loop_bodies", "loop_repeats_cost",
           "loop_trip_counts", "lowered_collectives", "matmul_flops_by_dtype", "multipliers", "parse_module",
           "program_cost", "ring_factor", "summarize", "traffic_by_axes"]
