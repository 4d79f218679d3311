"""The shardtrain loop's step time against calling the same compiled step in a bare Python loop.

    .venv/bin/python bench/overhead.py [CONFIG] [KEY=VALUE ...] [--rounds 3]  (default meshes/demo.yaml, 40 steps)

Runs bare, loop --rounds times, interleaved (same mesh, data and compiled program), and reports the
median seconds per step of each and their ratio (goal <= 1.03). Ratios, not absolute times, are
comparable on this noisy machine. Record: bench/results/overhead.jsonl.
"""

import harness  # isort: split

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

import jax

from shardtrain import config, loop, step
from shardtrain.parallel import mesh as mesh_lib


def bare(cfg) -> float:
    """Median seconds per step: the compiled step in a plain loop, dispatch pipelined like the loop's."""
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    compiled = prog.lower().compile()
    batches = harness.bare_loop_batches(prog, cfg.train.steps)
    state = prog.init(cfg.train.seed)
    times, last, t = [], None, time.perf_counter()
    for batch in batches:
        state, metrics = compiled(state, batch)
        if last is not None:
            float(last["loss"])  # the loop also reads each step's loss, one step behind
            times.append(time.perf_counter() - t)
        t, last = time.perf_counter(), metrics
    return statistics.median(times[3:])


def shardtrain_loop(cfg) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        loop.train(dataclasses.replace(cfg, run_dir=run_dir))
        rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
        return statistics.median([r["step_time_s"] for r in rows if "step_time_s" in r][3:])


def main():
    p = argparse.ArgumentParser(description="The shardtrain loop's step time against a bare loop of the same "
                                "compiled step (interleaved rounds).")
    p.add_argument("config", nargs="?", default="meshes/demo.yaml", help="YAML config (default meshes/demo.yaml)")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE overrides (default train.steps=40)")
    p.add_argument("--rounds", type=int, default=3, help="bare / loop rounds (default 3)")
    args = p.parse_args()
    if "=" in args.config:  # only overrides were given
        args.overrides, args.config = [args.config, *args.overrides], "meshes/demo.yaml"
    try:
        cfg = config.load(args.config, ["train.steps=40", "checkpoint.every_steps=1000", *args.overrides])
    except config.ConfigError as e:
        p.error(str(e))
    results = harness.interleaved({"bare": lambda: bare(cfg), "loop": lambda: shardtrain_loop(cfg)}, args.rounds)
    bare_s, loop_s = statistics.median(results["bare"]), statistics.median(results["loop"])
    mesh = dict(mesh_lib.make_mesh(cfg.mesh).shape)
    print(f"{cfg.name} mesh {mesh} on {jax.device_count()} devices: "
          f"bare {bare_s:.3f} s/step, shardtrain loop {loop_s:.3f} s/step, ratio {loop_s / bare_s:.3f} "
          f"(runs: {results})")
    harness.record("overhead", {"bare_s_per_step": bare_s, "loop_s_per_step": loop_s, "ratio": loop_s / bare_s,
                                "runs": results},
                   config=args.config, overrides=args.overrides, steps=cfg.train.steps, rounds=args.rounds, mesh=mesh)


if __name__ == "__main__":
    main()
