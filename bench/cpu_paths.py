"""The demo's step time on this CPU for each scale path (attention impl, scan unroll, embedding,
loss chunk). All variants are compiled first, then their steps alternate (A, B, C, ..., A, B, ...)
so that the machine's load hits all alike.

    python bench/cpu_paths.py [CONFIG] [--steps 12]

Prints the median s/step of each variant and its ratio to the first. Figures: bench/README.md.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from shardtrain import config, loop, mesh as mesh_lib, step  # noqa: E402

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


def prepare(path, overrides, steps):
    cfg = config.load(path, [f"train.steps={steps}", *overrides])
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    return prog.lower().compile(), prog.init(cfg.train.seed), loop.bare_loop_batches(prog, steps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", default="meshes/demo.yaml")
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    runs = {name: prepare(a.config, overrides, a.steps) for name, overrides in VARIANTS.items()}
    states = {name: run[1] for name, run in runs.items()}
    times = {name: [] for name in VARIANTS}
    for i in range(a.steps):
        for name, (compiled, _, batches) in runs.items():
            t = time.perf_counter()
            states[name], metrics = compiled(states[name], batches[i])
            float(metrics["loss"])
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times[next(iter(VARIANTS))][2:])
    print(f"{a.config} on {jax.device_count()} devices, load {os.getloadavg()[0]:.1f}, median of steps 3-{a.steps}:")
    for name, ts in times.items():
        m = statistics.median(ts[2:])
        print(f"  {name:40s} {m:.3f} s/step  x{m / base:.2f}")


if __name__ == "__main__":
    sys.exit(main())
