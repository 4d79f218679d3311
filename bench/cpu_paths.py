"""The demo's step time on this CPU for each scale path (attention impl, scan unroll, embedding,
loss chunk). All variants are compiled first, then their steps alternate (A, B, C, ..., A, B, ...)
so that the machine's load hits all alike.

    python bench/cpu_paths.py [CONFIG] [--steps 12]

Prints the median s/step of each variant (steps 3 on) and its ratio to the first. Figures:
bench/README.md; record: bench/results/cpu_paths.jsonl.
"""

import harness  # isort: split

import argparse
import os
import statistics
import sys

import jax

from shardtrain import config, step
from shardtrain.parallel import mesh as mesh_lib

VARIANTS = {
    "as before (unrolled, one-hot, xla)": ["train.scan_unroll=4", "model.embed=one_hot", "model.attention=xla",
                                           "train.loss_chunk=0"],
    "new defaults (rolled, gather, auto)": [],
    "rolled scan": ["train.scan_unroll=1", "model.embed=one_hot", "model.attention=xla"],
    "gather embedding": ["train.scan_unroll=4", "model.embed=gather", "model.attention=xla"],
    "chunked attention": ["train.scan_unroll=4", "model.embed=one_hot", "model.attention=chunked"],
    "chunked loss (4 chunks)": ["train.scan_unroll=4", "model.embed=one_hot", "model.attention=xla",
                                "train.loss_chunk=32"],
}


def prepare(path, overrides, steps) -> harness.Stepper:
    """The variant's compiled step, one step per call."""
    cfg = config.load(path, [f"train.steps={steps}", *overrides])
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    return harness.Stepper(prog.lower().compile(), prog.init(cfg.train.seed), harness.bare_loop_batches(prog, steps))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", default="meshes/demo.yaml")
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    load = os.getloadavg()[0]
    steppers = {name: prepare(a.config, overrides, a.steps) for name, overrides in VARIANTS.items()}
    times = {name: harness.flat(rounds) for name, rounds in harness.interleaved(steppers, a.steps).items()}
    medians = {name: statistics.median(ts[2:]) for name, ts in times.items()}
    base = medians[next(iter(VARIANTS))]
    print(f"{a.config} on {jax.device_count()} devices, load {load:.1f}, median of steps 3-{a.steps}:")
    for name, m in medians.items():
        print(f"  {name:40s} {m:.3f} s/step  x{m / base:.2f}")
    harness.record("cpu_paths", {"s_per_step": medians, "vs_before": {n: m / base for n, m in medians.items()}},
                   config=a.config, steps=a.steps, variants=VARIANTS)


if __name__ == "__main__":
    sys.exit(main())
