"""The demo's step time on this CPU for each scale path (attention impl, scan unroll, embedding,
loss chunk), interleaved in rounds so that machine load hits all alike.

    python bench/cpu_paths.py [CONFIG] [--rounds 2] [--steps 15]

Prints the median s/step of each variant per round and overall. Figures: bench/README.md.
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
    "as before (unrolled, one-hot, xla)": ["train.scan_unroll=4", "model.embed=one_hot", "model.attention=xla"],
    "rolled scan": ["train.scan_unroll=1", "model.embed=one_hot", "model.attention=xla"],
    "gather embedding": ["train.scan_unroll=4", "model.embed=gather", "model.attention=xla"],
    "chunked attention": ["train.scan_unroll=4", "model.embed=one_hot", "model.attention=chunked"],
    "chunked loss (4 chunks)": ["train.scan_unroll=4", "model.embed=one_hot", "model.attention=xla",
                                "train.loss_chunk=32"],
}


def time_variant(path, overrides, steps):
    cfg = config.load(path, [f"train.steps={steps}", *overrides])
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    compiled = prog.lower().compile()
    batches = loop.bare_loop_batches(prog, steps)
    state = prog.init(cfg.train.seed)
    times = []
    for batch in batches:
        t = time.perf_counter()
        state, metrics = compiled(state, batch)
        float(metrics["loss"])
        times.append(time.perf_counter() - t)
    return statistics.median(times[3:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", default="meshes/demo.yaml")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=15)
    a = ap.parse_args()
    results = {name: [] for name in VARIANTS}
    for r in range(a.rounds):
        for name, overrides in VARIANTS.items():
            results[name].append(time_variant(a.config, overrides, a.steps))
            print(f"round {r}: {name}: {results[name][-1]:.3f} s/step (load {os.getloadavg()[0]:.1f})", flush=True)
    base = statistics.median(results[next(iter(VARIANTS))])
    for name, times in results.items():
        m = statistics.median(times)
        print(f"{name:40s} {m:.3f} s/step  x{m / base:.2f}  {jax.device_count()} devices")


if __name__ == "__main__":
    sys.exit(main())
