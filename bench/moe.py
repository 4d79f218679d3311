"""MoE grouped matmul: `jax.lax.ragged_dot` against a masked dense matmul per expert, on the CPU
(step time) and on the TPU compiler (a topology compile: memory, FLOPs, the compiler's own
`optimal_seconds`), for the real train step (`step.build`) of an expert-parallel mesh.

    python bench/moe.py [--topology v5e:2x4] [--steps 4] [--skip-cpu] [KEY=VALUE ...]

`masked` runs every row through every local expert and keeps its own group's result
(n_experts / expert times the FLOPs); `ragged` is what models/moe.py uses. The CPU steps of the two
take turns (after both are compiled). Results: bench/README.md; record: bench/results/moe.jsonl.
"""

from __future__ import annotations

import harness  # isort: split

import argparse
import statistics
import time

import jax.numpy as jnp

from models import moe as moe_lib
from shardtrain import chips, config, step as step_lib
from shardtrain.parallel import mesh as mesh_lib
from shardtrain.plan import hlo, topology as topology_lib

BASE = ["model.moe.n_experts=8", "model.moe.experts_per_token=2", "data.source=synthetic", "mesh.data=2", "mesh.fsdp=1",
        "mesh.tensor=1", "mesh.expert=4"]


def masked(x_rd, w_edf, group_e, quantization="none"):
    """Every row through every expert, each keeping its own group's rows (moe_lib.grouped's signature)."""
    assert quantization == "none", "masked: train.quantization=none only"
    ends = jnp.cumsum(group_e)
    rows = jnp.arange(x_rd.shape[0])[:, None]
    out = jnp.zeros((x_rd.shape[0], w_edf.shape[2]), jnp.float32)
    for e in range(w_edf.shape[0]):
        mine = (rows >= ends[e] - group_e[e]) & (rows < ends[e])
        out = out + jnp.where(mine, x_rd @ w_edf[e], 0)
    return out.astype(x_rd.dtype)


IMPLS = {"ragged": moe_lib.grouped, "masked": masked}


def cpu_stepper(cfg, steps: int) -> harness.Stepper:
    """The step compiled for this CPU (with the grouped matmul moe_lib.grouped is now), one step per call."""
    prog = step_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    batches = harness.bare_loop_batches(prog, steps + 1)
    return harness.Stepper(prog.lower().compile(), prog.init(cfg.train.seed), batches)


def tpu_compile(cfg, topology: str) -> dict:
    chip, dims = topology.split(":")
    devices = topology_lib.devices(chips.CHIPS[chip], dims)  # the slice with its wraparound links, as plan sees it
    prog = step_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices))
    t0 = time.perf_counter()
    compiled = prog.lower().compile()
    seconds = time.perf_counter() - t0
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    colls = hlo.summarize(hlo.collectives(compiled.as_text(), dict(prog.mesh.shape)))
    return {"compile_s": round(seconds, 1), "flops": cost.get("flops"), "optimal_s": cost.get("optimal_seconds"),
            "args_mib": mem.argument_size_in_bytes / 2**20, "temp_mib": mem.temp_size_in_bytes / 2**20,
            "all_to_all": {k: v["count"] for k, v in colls.items() if "all-to-all" in k}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5e:2x4")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = config.load("meshes/demo.yaml", [*BASE, *args.overrides, "run_dir=/tmp/bench-moe"])
    rows, steppers = {}, {}
    for name, fn in IMPLS.items():
        moe_lib.grouped = fn  # traced into both programs below
        rows[name] = {"impl": name, **tpu_compile(cfg, args.topology)}
        if not args.skip_cpu:
            steppers[name] = cpu_stepper(cfg, args.steps)
    times = harness.interleaved(steppers, args.steps + 1)
    for name, row in rows.items():
        if name in times:
            row["cpu_step_s"] = round(statistics.median(harness.flat(times[name])[1:]), 3)
        print(row, flush=True)
    harness.record("moe", rows, topology=args.topology, steps=args.steps, skip_cpu=args.skip_cpu,
                   overrides=[*BASE, *args.overrides])


if __name__ == "__main__":
    main()
