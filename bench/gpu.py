"""One command on one NVIDIA GPU: train a ~1B-parameter GPT with cuDNN flash attention and report
tokens/s and MFU (model FLOPs / the chip's dense bf16 peak from shardtrain/plan/chips.py).

    python bench/gpu.py            # ~1.0B GPT, seq 2048, bf16, cuDNN attention, 30 steps (< 8 min)
    python bench/gpu.py --smoke    # tiny model on CPU (XLA attention): checks the script runs

Synthetic data (nothing downloaded), fp32 master weights + AdamW, remat `dots`, chunked loss.
Prints one JSON line: tokens/s, MFU, step time (median of the steps after the first 5), memory, and
`shardtrain plan`'s report of the same compiled step (`planned_*`: its memory and roofline step time),
so that measured and planned sit side by side (bench/README.md, GPU); and appends it to
bench/results/gpu.jsonl (a --smoke run's record says smoke: true).
"""

import harness  # isort: split

import argparse
import json
import statistics
import sys
import time

import jax
import numpy as np

from shardtrain import chips, config, step
from shardtrain.parallel import mesh as mesh_lib
from shardtrain.plan import planner

ONE_B = ["model.vocab_size=32768", "model.d_model=2048", "model.n_layers=18", "model.n_heads=16",
         "model.n_kv_heads=8", "model.d_ff=7168", "data.seq_len=2048", "train.global_batch_size=8",
         "train.remat=dots", "model.attention=cudnn", "train.compute_dtype=bfloat16"]
SMOKE = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
         "data.seq_len=128", "train.global_batch_size=2", "model.attention=xla"]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny model, runs anywhere (CPU)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides")
    a = ap.parse_args(argv)
    steps = 8 if a.smoke else a.steps
    cfg = config.load(None, ["data.source=synthetic", "mesh.data=1", f"train.steps={steps}",
                             *(SMOKE if a.smoke else ONE_B), *a.overrides])
    device = jax.devices()[0]
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices=[device]))
    t0 = time.perf_counter()
    compiled = prog.lower().compile()
    compile_s = time.perf_counter() - t0
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(prog.abstract_state["params"]))
    rng = np.random.default_rng(0)
    shape = prog.abstract_batch().shape
    batch = jax.device_put(rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32), prog.batch_sharding)
    state = prog.init(cfg.train.seed)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, m = compiled(state, batch)
        float(m["loss"])
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times[5:] if len(times) > 6 else times[1:])
    tokens_per_s = cfg.train.global_batch_size * cfg.data.seq_len / step_s
    chip = chips.for_device_kind(device.device_kind)
    flops = prog.flops_per_token * tokens_per_s
    mem = compiled.memory_analysis()
    plan = planner.report(prog, compiled, chip or chips.CHIPS["cpu"], compile_s)
    figures = {
        "device": device.device_kind, "params_b": round(n_params / 1e9, 3), "attention": cfg.model.attention,
        "quantization": cfg.train.quantization, "remat": cfg.train.remat,
        "seq_len": cfg.data.seq_len, "batch": cfg.train.global_batch_size, "compile_s": round(compile_s, 1),
        "step_s": round(step_s, 4), "tokens_per_s": round(tokens_per_s),
        "mfu": round(flops / chip.peak_flops, 3) if chip else None,
        "last_loss": round(float(m["loss"]), 3),
        "temp_gib": round(mem.temp_size_in_bytes / 2 ** 30, 2) if mem else None,
        "planned_total_gib": round(plan["memory_per_device_bytes"]["total"] / 2 ** 30, 2),
        "planned_step_s": round(plan["estimate"]["step_time_s"], 4),
        "planned_mfu": round(plan["estimate"]["mfu"], 3),
        "planned_bottleneck": plan["estimate"]["bottleneck"],
        "jax": jax.__version__}
    print(json.dumps(figures))
    harness.record("gpu", figures, smoke=a.smoke, steps=steps, overrides=a.overrides)


if __name__ == "__main__":
    sys.exit(main())
