"""Bytes per step by mesh axis and final loss for each communication mode, on the demo config.

    .venv/bin/python bench/communication.py                   # meshes/demo.yaml, 60 steps per mode
    .venv/bin/python bench/communication.py --steps 20 --modes fp32 int8

8 simulated CPU devices in one process, mesh data=2 x fsdp=2 x tensor=2 (the demo). For each
mode, in one run (so the step-time ratios share the machine's load):
  - bytes/step over `data` (ring model, per device) from the *lowered* program for the
    compressed and local-SGD modes (`planner.bytes_per_step`: the hand-written collectives in their
    own dtype, local SGD amortised over H) and from the compiled program for fp32 (GSPMD's
    collectives whose groups span the data axis);
  - the same read from the CPU-compiled program, where bf16 collectives appear as f32;
  - bytes/step over fsdp and tensor (compiled program), which no mode changes;
  - the mean loss of the last 5 steps, against fp32, and the median step time against fp32.
All modes are compiled first; then their steps take turns (fp32, bf16, ..., fp32, ...), so that the
machine's load falls on all alike. Record: bench/results/communication.jsonl.
"""

from __future__ import annotations

import harness  # isort: split

import argparse
import json
import statistics

import jax

from shardtrain import config, step as step_lib
from shardtrain.parallel import comm, mesh as mesh_lib
from shardtrain.plan import hlo, planner

MODES = {
    "fp32": [],
    "bf16": ["train.comm.grad_reduce_dtype=bfloat16"],
    "int8": ["train.comm.grad_reduce_dtype=int8"],
    "local_sgd_h4": ["train.comm.sync=local_sgd", "train.comm.sync_every=4"],
    "local_sgd_h8": ["train.comm.sync=local_sgd", "train.comm.sync_every=8"],
    "local_sgd_h8_bf16": ["train.comm.sync=local_sgd", "train.comm.sync_every=8",
                          "train.comm.grad_reduce_dtype=bfloat16"],
}
FIGURES = ("data_bytes", "data_bytes_cpu_compiled", "fsdp_bytes", "tensor_bytes", "loss_last5", "step_s_median")
"""A mode's figures in the record, with its ratios to fp32."""


def traffic(cols, axis: str, every: int, branches: set[str]) -> float:
    """Ring-model bytes per device per step over collectives whose groups span `axis` (fsdp and
    tensor: and not data); those in a conditional branch (the local-SGD sync) run every H steps."""
    return sum(c.traffic_bytes * c.count / (every if c.computation in branches else 1) for c in cols
               if axis in c.axes and (axis == "data" or "data" not in c.axes))


def compile_mode(name: str, overrides: list[str], args) -> tuple[dict, harness.Stepper]:
    """The mode's bytes per step by axis, and its compiled step (one step per call)."""
    cfg = config.load(args.config, [f"train.steps={args.steps}", *overrides, *args.overrides])
    mesh = mesh_lib.make_mesh(cfg.mesh)
    prog = step_lib.build(cfg, mesh)
    compiled = prog.lower().compile()
    text = compiled.as_text()
    cols, branches = hlo.collectives(text, dict(mesh.shape)), hlo.conditional_branches(text)
    every = cfg.train.comm.sync_every if cfg.train.comm.sync == "local_sgd" else 1
    compiled_data = traffic(cols, "data", every, branches)
    row = {"mode": name, "overrides": overrides,
           "data_bytes": (planner.bytes_per_step(prog).get(("data",), compiled_data) if comm.enabled(cfg)
                          else compiled_data),
           "data_bytes_cpu_compiled": compiled_data,
           "fsdp_bytes": traffic(cols, "fsdp", every, branches),
           "tensor_bytes": traffic(cols, "tensor", every, branches)}
    return row, harness.Stepper(compiled, prog.init(cfg.train.seed), harness.bare_loop_batches(prog, cfg.train.steps))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="meshes/demo.yaml")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    p.add_argument("overrides", nargs="*", help="extra KEY=VALUE overrides for every mode")
    args = p.parse_args()
    print(f"{jax.device_count()} {jax.devices()[0].platform} devices; {args.config}, {args.steps} steps", flush=True)
    modes = {m: compile_mode(m, MODES[m], args) for m in (["fp32"] + [m for m in args.modes if m != "fp32"])}
    times = harness.interleaved({m: stepper for m, (_, stepper) in modes.items()}, args.steps)
    rows = []
    for m, (row, stepper) in modes.items():
        row["loss_last5"] = statistics.mean(stepper.losses[-5:])
        row["step_s_median"] = statistics.median(harness.flat(times[m])[1:])
        print(json.dumps(row), flush=True)
        rows.append(row)
    base = rows[0]
    print("\n| mode | data bytes/step/device | (CPU-compiled program) | fsdp | tensor | last-5 loss | vs fp32 "
          "| step time vs fp32 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['data_bytes'] / 1e3:.1f} kB ({r['data_bytes'] / base['data_bytes']:.3f}x) | "
              f"{r['data_bytes_cpu_compiled'] / 1e3:.1f} kB | {r['fsdp_bytes'] / 1e3:.1f} kB | "
              f"{r['tensor_bytes'] / 1e3:.1f} kB | {r['loss_last5']:.3f} | "
              f"{r['loss_last5'] / base['loss_last5']:.3f} | "
              f"{r['step_s_median'] / base['step_s_median']:.2f} |")
    figures = {}
    for r in rows:
        figures[r["mode"]] = {k: r[k] for k in FIGURES} | {
            "data_vs_fp32": r["data_bytes"] / base["data_bytes"], "loss_vs_fp32": r["loss_last5"] / base["loss_last5"],
            "step_vs_fp32": r["step_s_median"] / base["step_s_median"]}
    harness.record("communication", figures, config=args.config, steps=args.steps, overrides=args.overrides)


if __name__ == "__main__":
    main()
