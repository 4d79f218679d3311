"""Pipeline schedules against micro-batch count: flops, step time, bubble and memory per device.

    .venv/bin/python bench/pipeline.py [--stages 4] [--steps 6] [KEY=VALUE ...]

For each schedule (GPipe; circular with 2 repeats) and M in {P, 2P, 4P} it compiles the real
train step (`step.build`) and reports, per device: flops per step (`compiled.cost_analysis()`,
deterministic), argument and temporary bytes (`compiled.memory_analysis()`), the number of
collective-permutes / all-to-alls in the optimized HLO, and the median step time relative to the
same model without pipelining (mesh data = all devices) measured in the same run.

XLA's cost analysis counts a while loop's body once, not once per trip. The pipeline's loop body
costs c / M (one micro-batch through one group of layers) and the rest of the step a, so from the
raw counts F(M) = a + c / M at M = P and 2P the bench solves a and c (M = 4P checks the fit) and
reports the flops the schedule executes, a + (v M + P - 1) c / M, against the plain step's.

Every stage computes in every iteration of the schedule, bubble included, and simulated CPU
devices share the host's cores, so time measures total work: the measured bubble is
1 - t_plain / t_pipelined, shown next to the ideal (P - 1) / (v M + P - 1). All variants are
compiled first; then their steps take turns, so that the machine's load falls on all alike.
Record: bench/results/pipeline.jsonl.
"""

from __future__ import annotations

import harness  # isort: split

import argparse
import re
import statistics
import sys

import jax

from shardtrain import config, step as step_lib
from shardtrain.parallel import mesh as mesh_lib, pipeline

BASE = ["model.name=gpt", "model.d_model=64", "model.n_layers=8", "model.d_ff=256", "model.n_heads=4",
        "model.n_kv_heads=4", "data.seq_len=64", "data.source=synthetic", "train.global_batch_size=32",
        "train.scan_unroll=8"]
"""The layers unrolled (`train.scan_unroll` = n_layers): a rolled layer scan (the default since the
scan paths landed) is a loop whose body the cost analysis would also count once, one layer of eight."""


def compile_variant(overrides: list[str], steps: int) -> tuple[dict, harness.Stepper]:
    """The variant's compiled figures, and its step (one per call, steps + 1 batches)."""
    cfg = config.load(None, overrides)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    prog = step_lib.build(cfg, mesh)
    compiled = prog.lower().compile()
    hlo, mem = compiled.as_text(), compiled.memory_analysis()
    return {
        "flops": compiled.cost_analysis()["flops"],
        "args_mb": mem.argument_size_in_bytes / 2**20,
        "temp_mb": mem.temp_size_in_bytes / 2**20,
        "permutes": len(re.findall(r" collective-permute(?:-start)?\(", hlo)),
        "all_to_all": len(re.findall(r" all-to-all(?:-start)?\(", hlo)),
        "bubble": pipeline.bubble_fraction(cfg, mesh) if mesh.shape["pipeline"] > 1 else 0.0,
    }, harness.Stepper(compiled, prog.init(cfg.train.seed), harness.bare_loop_batches(prog, steps + 1))


def measure(variants: dict[str, list[str]], steps: int) -> dict[str, dict]:
    """Every variant compiled, then steps + 1 rounds of one step each; "time": the median step after
    the first (which includes transfers / warm-up)."""
    compiled = {}
    for name, overrides in variants.items():
        compiled[name] = compile_variant(overrides, steps)
        print(f"compiled {name}", file=sys.stderr, flush=True)
    times = harness.interleaved({name: stepper for name, (_, stepper) in compiled.items()}, steps + 1)
    return {name: row | {"time": statistics.median(harness.flat(times[name])[1:])}
            for name, (row, _) in compiled.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    p = args.stages
    base = BASE + args.overrides
    variants = {("none (data only)", "-"): base + [f"mesh.data={jax.device_count()}"]}
    for schedule, repeats in (("gpipe", 1), ("circular", 2)):
        for m in (p, 2 * p, 4 * p):
            variants[(f"{schedule} v={repeats}", m)] = base + [
                f"mesh.pipeline={p}", f"mesh.data={jax.device_count() // p}", f"train.pipeline.schedule={schedule}",
                f"train.pipeline.repeats={repeats}", f"train.pipeline.microbatches={m}"]
    rows = [(name, m, r) for (name, m), r in measure(variants, args.steps).items()]
    figures = report(rows, p)
    print(f"\nplain step {rows[0][2]['time'] * 1e3:.0f} ms; {jax.device_count()} simulated devices, "
          f"overrides {' '.join(base)}")
    harness.record("pipeline", {"plain_step_ms": rows[0][2]["time"] * 1e3, "rows": figures}, stages=p,
                   steps=args.steps, overrides=base)


def report(rows: list[tuple], p: int) -> dict:
    """Prints the table of (schedule, M, measured) rows, the first unpipelined; returns its figures."""
    plain = rows[0][2]
    figures = {}
    print("| schedule | M | GFLOP/step/device raw | executed GFLOP (fit) | executed / plain | time / plain "
          "| ideal bubble | measured bubble | measured / ideal | args MiB | temp MiB | permutes | all-to-alls |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    fits = {}
    for name, m, r in rows[1:]:
        fits.setdefault(name, []).append((m, r["flops"]))
    for name, m, r in rows:
        executed = r["flops"]
        if name in fits:
            (m1, f1), (m2, f2) = fits[name][:2]
            c = (f1 - f2) / (1 / m1 - 1 / m2)
            a = f1 - c / m1
            assert abs(a + c / m - r["flops"]) <= 0.01 * r["flops"], f"flops fit fails for {name} M={m}"
            repeats = int(name.split("v=")[1])
            executed = a + (repeats * m + p - 1) * c / m
        ratio = r["time"] / plain["time"]
        measured = 1 - 1 / ratio
        vs_ideal = f"{measured / r['bubble']:.2f}" if r["bubble"] else "-"
        figures[f"{name} M={m}"] = {"gflop_raw": r["flops"] / 1e9, "gflop_executed": executed / 1e9,
                                    "executed_vs_plain": executed / plain["flops"], "time_vs_plain": ratio,
                                    "ideal_bubble": r["bubble"], "measured_bubble": measured, "args_mib": r["args_mb"],
                                    "temp_mib": r["temp_mb"], "permutes": r["permutes"], "all_to_alls": r["all_to_all"]}
        print(f"| {name} | {m} | {r['flops'] / 1e9:.3f} | {executed / 1e9:.3f} | {executed / plain['flops']:.2f} "
              f"| {ratio:.2f} | {r['bubble']:.3f} | {measured:.3f} | {vs_ideal} | {r['args_mb']:.2f} "
              f"| {r['temp_mb']:.2f} | {r['permutes']} | {r['all_to_all']} |")
    return figures


if __name__ == "__main__":
    main()
