"""How well does `shardtrain plan` rank meshes? Calibrates the `cpu` chip entry on this machine
(matmul FLOP/s and copy bandwidth), then for every mesh of the demo GPT on 8 simulated devices:
the planner's estimated step time, and the measured median step time. Reports the Spearman rank
correlation and estimate / measured per mesh.

The machine is shared with other jobs, so all meshes are compiled first and then measured
round-robin (--rounds rounds of --steps steps each), keeping each mesh's fastest step: load from
others then spreads over all meshes instead of landing on one. Times are also given relative to
data=8 measured in the same run.

    .venv/bin/python bench/plan_accuracy.py [--rounds 3] [--steps 3] [overrides ...]

Writes bench/results/plan_accuracy.json (every mesh's estimate and measurements) and appends a record to
bench/results/plan_accuracy.jsonl.
"""

import harness  # isort: split

import argparse
import json
import statistics
import time
import warnings

import jax
from scipy.stats import spearmanr

from shardtrain import chips, config, step
from shardtrain.config import MESH_AXES
from shardtrain.parallel import mesh as mesh_lib
from shardtrain.plan import planner, search


def main() -> None:
    warnings.simplefilter("ignore", DeprecationWarning)
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(harness.RESULTS / "plan_accuracy.json"))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = config.load("meshes/demo.yaml", ["train.compile_cache=false", *args.overrides])
    devices = jax.devices()
    t0 = time.perf_counter()
    cpu = chips.calibrate_cpu()
    print(f"calibrated cpu in {time.perf_counter() - t0:.1f} s: {cpu.peak_flops / 1e9:.1f} GFLOP/s, "
          f"{cpu.hbm_bandwidth / 1e9:.2f} GB/s (whole host)", flush=True)

    def build(sizes, m):
        c = search.candidate(cfg, sizes, m)
        prog = step.build(c, mesh_lib.make_mesh(c.mesh, devices))
        compiled = prog.lower().compile()
        return prog, compiled, harness.bare_loop_batches(prog, 4)

    meshes = []
    for sizes in search.factorisations(len(devices)):
        for m in search.microbatch_counts(cfg, sizes):
            label = planner.mesh_label(sizes) + (f" M={m}" if m else "")
            try:
                prog, compiled, batches = build(sizes, m)
            except Exception as e:  # rejected by the model dimensions, or a schedule that fails to build
                print(f"skip {label}: {str(e)[:100]}", flush=True)
                continue
            r = planner.report(prog, compiled, cpu)
            stepper = harness.Stepper(compiled, prog.init(cfg.train.seed), batches)
            stepper()  # warm-up: one step
            stepper.steps = args.steps  # then --steps per round
            meshes.append({"label": label, "stepper": stepper, "report": r})
            print(f"{label}: compiled, estimate {r['estimate']['step_time_s']:.3f} s", flush=True)
    rounds = harness.interleaved({m["label"]: m["stepper"] for m in meshes}, args.rounds)
    for m in meshes:
        m["times"] = harness.flat(rounds[m["label"]])
        del m["stepper"]  # its state and compiled program
    base = next(min(m["times"]) for m in meshes if m["label"] == "8x1x1x1")
    rows = []
    for m in meshes:
        e = m["report"]["estimate"]
        rows.append({"mesh": m["label"], "estimate_s": e["step_time_s"], "measured_s": min(m["times"]),
                     "median_s": statistics.median(m["times"]), "baseline_s": base,
                     "bottleneck": e["bottleneck"], "compute_s": e["compute_s"], "memory_s": e["memory_s"],
                     "comm_s": e["comm_s"], "flops_per_device": m["report"]["flops_per_device"],
                     "bytes_per_device": m["report"]["bytes_accessed_per_device"],
                     "collectives": sum(c["count"] for c in m["report"]["collectives"].values()),
                     "comm_traffic_bytes_per_device": m["report"]["comm_traffic_bytes_per_device"]})
    est = [r["estimate_s"] for r in rows]
    rho_abs = spearmanr(est, [r["measured_s"] for r in rows]).statistic
    rho_rel = spearmanr(est, [r["median_s"] for r in rows]).statistic
    result = {"cpu": {"peak_flops": cpu.peak_flops, "bandwidth": cpu.hbm_bandwidth}, "rows": rows,
              "spearman_fastest": rho_abs, "spearman_median": rho_rel, "steps": args.steps, "rounds": args.rounds,
              "mesh_axes": MESH_AXES}
    json.dump(result, open(args.out, "w"), indent=1)
    print("\n| mesh | estimate ms | fastest step ms | median step ms | estimate / fastest | fastest / data=8 "
          "| bound by |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: r["measured_s"]):
        print(f"| {r['mesh']} | {r['estimate_s'] * 1e3:.0f} | {r['measured_s'] * 1e3:.0f} | "
              f"{r['median_s'] * 1e3:.0f} | {r['estimate_s'] / r['measured_s']:.2f} | "
              f"{r['measured_s'] / r['baseline_s']:.2f} | {r['bottleneck']} |")
    print(f"\nSpearman rank correlation of the estimate with the fastest step: {rho_abs:.2f}; "
          f"with the median step: {rho_rel:.2f} ({len(rows)} meshes)")
    harness.record("plan_accuracy", {
        "spearman_fastest": rho_abs, "spearman_median": rho_rel, "meshes": len(rows),
        "cpu_gflops": cpu.peak_flops / 1e9, "cpu_gb_per_s": cpu.hbm_bandwidth / 1e9,
        "rows": {r["mesh"]: {"estimate_ms": r["estimate_s"] * 1e3, "fastest_ms": r["measured_s"] * 1e3,
                             "median_ms": r["median_s"] * 1e3} for r in rows}},
        steps=args.steps, rounds=args.rounds, overrides=args.overrides, out=args.out)


if __name__ == "__main__":
    main()
