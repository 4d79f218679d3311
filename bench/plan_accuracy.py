"""How well does `shardtrain plan` rank meshes? Calibrates the `cpu` chip entry on this machine
(matmul FLOP/s and copy bandwidth), then for every mesh of the demo GPT on 8 simulated devices:
the planner's estimated step time, and the measured median step time. Reports the Spearman rank
correlation and estimate / measured per mesh.

The machine is shared with other jobs, so all meshes are compiled first and then measured
round-robin (--rounds rounds of --steps steps each), keeping each mesh's fastest step: load from
others then spreads over all meshes instead of landing on one. Times are also given relative to
data=8 measured in the same run.

    .venv/bin/python bench/plan_accuracy.py [--rounds 3] [--steps 3] [overrides ...]  # writes bench/plan_accuracy.json
"""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

from shardtrain import config, loop, mesh as mesh_lib, step  # noqa: E402
from shardtrain.config import MESH_AXES  # noqa: E402
from shardtrain.plan import chips, planner, search  # noqa: E402


def step_times(prog, compiled, state, batches, steps: int):
    """(state, wall times of `steps` steps), each step waited for."""
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, m = compiled(state, batches[i % len(batches)])
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    return state, times


def main() -> None:
    warnings.simplefilter("ignore", DeprecationWarning)
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "plan_accuracy.json"))
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
        return prog, compiled, loop.bare_loop_batches(prog, 4)

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
            state, _ = step_times(prog, compiled, prog.init(cfg.train.seed), batches, 1)  # warm-up
            meshes.append({"label": label, "prog": prog, "compiled": compiled, "batches": batches,
                           "state": state, "report": r, "times": []})
            print(f"{label}: compiled, estimate {r['estimate']['step_time_s']:.3f} s", flush=True)
    for round_ in range(args.rounds):
        for m in meshes:
            m["state"], times = step_times(m["prog"], m["compiled"], m["state"], m["batches"], args.steps)
            m["times"] += times
        print(f"round {round_ + 1}: " + ", ".join(f"{m['label']} {min(m['times']):.2f}" for m in meshes), flush=True)
    base = next(min(m["times"]) for m in meshes if m["label"] == "8x1x1x1")
    rows = []
    for m in meshes:
        e = m["report"]["estimate"]
        rows.append({"mesh": m["label"], "estimate_s": e["step_time_s"], "measured_s": min(m["times"]),
                     "median_s": sorted(m["times"])[len(m["times"]) // 2], "baseline_s": base,
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


if __name__ == "__main__":
    main()
