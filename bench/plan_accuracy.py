"""How well does `shardtrain plan` rank meshes? Calibrates the `cpu` chip entry on this machine
(matmul FLOP/s and copy bandwidth), then for every mesh of the demo GPT on 8 simulated devices:
the planner's estimated step time, and the measured median step time. Reports the Spearman rank
correlation and estimate / measured per mesh.

The machine is shared, so each mesh's measurement is followed by one of a fixed baseline mesh
(data=8) in the same run; the table also gives both times relative to that baseline.

    python bench/plan_accuracy.py [--steps 5] [overrides ...]   # writes bench/plan_accuracy.json
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

from shardtrain import chips, config, loop, mesh as mesh_lib, plan, search, step  # noqa: E402
from shardtrain.config import MESH_AXES  # noqa: E402


def measure(prog, compiled, batches, steps: int) -> float:
    """Median wall time of `steps` steps after one warm-up step."""
    state = prog.init(prog.cfg.train.seed)
    state, m = compiled(state, batches[0])
    jax.block_until_ready(m)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, m = compiled(state, batches[(i + 1) % len(batches)])
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    warnings.simplefilter("ignore", DeprecationWarning)
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
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

    base = build({"data": 8, "pipeline": 1, "fsdp": 1, "tensor": 1}, None)
    rows = []
    for sizes in search.factorisations(len(devices)):
        for m in search.microbatch_counts(cfg, sizes):
            label = plan.mesh_label(sizes) + (f" M={m}" if m else "")
            try:
                prog, compiled, batches = build(sizes, m)
            except (config.ConfigError, ImportError) as e:
                print(f"skip {label}: {str(e)[:100]}", flush=True)
                continue
            r = plan.report(prog, compiled, cpu)
            measured = measure(prog, compiled, batches, args.steps)
            baseline = measure(base[0], base[1], base[2], args.steps)
            rows.append({"mesh": label, "estimate_s": r["estimate"]["step_time_s"], "measured_s": measured,
                         "baseline_s": baseline, "bottleneck": r["estimate"]["bottleneck"],
                         "compute_s": r["estimate"]["compute_s"], "memory_s": r["estimate"]["memory_s"],
                         "comm_s": r["estimate"]["comm_s"]})
            print(f"{label}: estimate {rows[-1]['estimate_s']:.3f} s, measured {measured:.3f} s "
                  f"(baseline {baseline:.3f} s)", flush=True)
    est = [r["estimate_s"] for r in rows]
    rho_abs = spearmanr(est, [r["measured_s"] for r in rows]).statistic
    rho_rel = spearmanr(est, [r["measured_s"] / r["baseline_s"] for r in rows]).statistic
    result = {"cpu": {"peak_flops": cpu.peak_flops, "bandwidth": cpu.hbm_bandwidth}, "rows": rows,
              "spearman_measured": rho_abs, "spearman_vs_baseline": rho_rel, "steps": args.steps,
              "mesh_axes": MESH_AXES}
    json.dump(result, open(args.out, "w"), indent=1)
    print(f"\n| mesh | estimate ms | measured ms | estimate / measured | measured / baseline | bound by |")
    print("|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: r["measured_s"]):
        print(f"| {r['mesh']} | {r['estimate_s'] * 1e3:.0f} | {r['measured_s'] * 1e3:.0f} | "
              f"{r['estimate_s'] / r['measured_s']:.2f} | {r['measured_s'] / r['baseline_s']:.2f} | {r['bottleneck']} |")
    print(f"\nSpearman rank correlation, estimate vs measured: {rho_abs:.2f}; "
          f"vs measured / baseline: {rho_rel:.2f} ({len(rows)} meshes)")


if __name__ == "__main__":
    main()
