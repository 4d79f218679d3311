"""Compile a config's train step for a TPU topology with the real TPU compiler (libtpu, no TPU
needed) and print per-chip memory and compile time, one JSON line per variant.

    python bench/scale.py CONFIG [KEY=VALUE ...] [--topology v5p:4x4x8] [--vary KEY=V1,V2,...]

The topology defaults to the config's `hardware:` section (chip:topology). `--vary` compiles once
per value (e.g. `--vary model.n_layers=8,32,80` or `--vary data.seq_len=2048,8192`). Results and
MaxText's figures for the same shapes are in bench/README.md; every run appends its rows to
bench/results/scale.jsonl.
"""

import harness  # isort: split

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import yaml

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax is imported
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may compile for TPU too

from shardtrain import chips, config, step  # noqa: E402
from shardtrain.parallel import mesh as mesh_lib  # noqa: E402
from shardtrain.plan import topology as topology_lib  # noqa: E402

GIB = 2 ** 30


def load(path, overrides):
    """The config, with a `hardware:` section this checkout may not know yet split off."""
    tree = yaml.safe_load(open(path))
    hardware = tree.get("hardware") or {}
    if "hardware" not in {f.name for f in dataclasses.fields(config.RunConfig)}:
        tree.pop("hardware", None)
        overrides = [o for o in overrides if not o.startswith("hardware.")]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix=os.path.basename(path)[:-5] + "-") as f:
        yaml.safe_dump(tree, f)
        f.flush()
        return config.load(f.name, overrides), hardware


def compile_one(cfg, topology: str) -> dict:
    chip, dims = topology.split(":")
    devices = topology_lib.devices(chips.CHIPS[chip], dims)  # the slice with its wraparound links, as plan sees it
    mesh = mesh_lib.make_mesh(cfg.mesh, devices=devices)
    t0 = time.perf_counter()
    compiled = step.build(cfg, mesh).lower().compile()
    seconds = time.perf_counter() - t0
    m = compiled.memory_analysis()
    args, temps = m.argument_size_in_bytes, m.temp_size_in_bytes
    return {"topology": topology, "devices": len(devices), "compile_s": round(seconds, 1),
            "args_gib": round(args / GIB, 2), "temps_gib": round(temps / GIB, 2),
            "total_gib": round((args + temps) / GIB, 2), "output_gib": round(m.output_size_in_bytes / GIB, 2),
            "alias_gib": round(m.alias_size_in_bytes / GIB, 2), "load1": os.getloadavg()[0]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--topology", default=None, help="e.g. v5p:4x4x8 (default: the config's hardware)")
    ap.add_argument("--vary", default=None, help="KEY=V1,V2,...: one compile per value")
    a = ap.parse_args()
    variants, rows = [[]], []
    if a.vary:
        key, values = a.vary.split("=", 1)
        variants = [[f"{key}={v}"] for v in values.split(",")]
    for extra in variants:
        cfg, hw = load(a.config, [*a.overrides, *extra])
        topology = a.topology or f"{hw['chip']}:{hw['topology']}"
        row = {"config": a.config, "overrides": [*a.overrides, *extra]}
        try:
            row.update(compile_one(cfg, topology))
        except Exception as e:  # noqa: BLE001 -- a bench reports what failed and goes on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    harness.record("scale", {"rows": rows}, config=a.config, overrides=a.overrides, topology=a.topology, vary=a.vary)


if __name__ == "__main__":
    sys.exit(main())
