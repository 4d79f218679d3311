"""The local checkpoint tier's cost to the step, and what a random kill costs with and without it.

    .venv/bin/python bench/local_tier.py                          # GPT D=512, 8 layers: ~400 MB of train state
    .venv/bin/python bench/local_tier.py --d-model 256 --layers 4  # smaller and quicker

On 8 simulated CPU devices, one process: steps without any save and steps with a local save every
--every steps, alternated (so that both share the machine's load); the blocking part of a local
save (the copy to host memory), the time its background write takes, and a restore. Then the
steps a kill at a uniformly random moment costs: about every/2 (plus the write in flight) with the
local tier, persistent_every/2 without it. Record: bench/results/local_tier.jsonl.
"""

from __future__ import annotations

import harness  # isort: split

import argparse
import os
import shutil
import statistics
import tempfile
import time

import jax

from shardtrain import config, step as step_lib
from shardtrain.checkpoint import local
from shardtrain.parallel import mesh as mesh_lib


def report(args, mesh: dict, state_mb: float, plain: list[float], saving: list[float], blocking: list[float],
           writes: list[float], restore_s: float) -> None:
    """Prints the figures and records them."""
    med, mean = statistics.median, statistics.mean
    step_s = med(plain)
    in_flight = med(writes) / step_s
    print(f"state: {state_mb:.0f} MB on {jax.device_count()} devices, mesh {mesh}; local tier in "
          f"{args.directory}")
    print(f"step: median {step_s:.3f} s without saves ({len(plain)} steps); mean {mean(saving):.3f} s with a local "
          f"save every {args.every} steps ({len(saving)} steps): cost {100 * (mean(saving) / mean(plain) - 1):+.1f}% "
          f"(mean without {mean(plain):.3f} s)")
    print(f"local save: blocking median {med(blocking):.3f} s, background write median {med(writes):.3f} s "
          f"({state_mb / med(writes):.0f} MB/s), restore {restore_s:.2f} s")
    kill_with, kill_without = (args.every - 1) / 2 + in_flight + 1, (args.persistent_every - 1) / 2 + 1
    print(f"a kill at a random moment costs about {kill_with:.1f} steps with the local tier "
          f"every {args.every} ((every-1)/2 + the write in flight {in_flight:.1f} + the step in flight 1), "
          f"{kill_without:.1f} without it (persistent every {args.persistent_every})")
    harness.record("local_tier", {
        "state_mb": state_mb, "step_plain_median_s": step_s, "step_plain_mean_s": mean(plain),
        "step_saving_mean_s": mean(saving), "save_cost_pct": 100 * (mean(saving) / mean(plain) - 1),
        "steps_plain": len(plain), "steps_saving": len(saving), "save_blocking_median_s": med(blocking),
        "write_median_s": med(writes), "write_mb_per_s": state_mb / med(writes), "restore_s": restore_s,
        "write_in_flight_steps": in_flight, "kill_cost_steps_local": kill_with, "kill_cost_steps_persistent_only":
        kill_without}, d_model=args.d_model, layers=args.layers, every=args.every,
        persistent_every=args.persistent_every, steps=args.steps, directory=args.directory, mesh=mesh)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--every", type=int, default=2, help="checkpoint.local.every_steps")
    p.add_argument("--persistent-every", type=int, default=50, help="checkpoint.every_steps to compare with")
    p.add_argument("--steps", type=int, default=8, help="steps per phase (4 phases)")
    p.add_argument("--directory", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    args = p.parse_args()

    root = tempfile.mkdtemp(prefix="bench_local_", dir=args.directory)
    cfg = config.load("meshes/demo.yaml", [
        f"model.d_model={args.d_model}", f"model.n_layers={args.layers}", f"model.d_ff={4 * args.d_model}",
        "model.n_heads=8", "model.n_kv_heads=8", "data.source=synthetic", "data.seq_len=16",
        "train.global_batch_size=8", f"run_dir={root}/run", f"checkpoint.local.directory={root}/local",
        f"checkpoint.local.every_steps={args.every}", f"checkpoint.every_steps={args.persistent_every}"])
    prog = step_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    compiled = prog.lower().compile()
    state = prog.init(0)
    state_mb = sum(x.nbytes for x in jax.tree.leaves(state)) / 1e6
    batch = harness.bare_loop_batches(prog, 1)[0]
    tier = local.LocalTier(cfg, prog.abstract_state)

    blocking, writes = [], []
    step = 0

    def phase(save: bool) -> list[float]:
        """--steps train steps, with a local save every --every steps if `save`; their wall times."""
        nonlocal state, step
        times = []
        for _ in range(args.steps):
            step += 1
            t0 = time.perf_counter()
            state, metrics = compiled(state, batch)
            jax.block_until_ready(metrics["loss"])
            if save and step % args.every == 0:
                t1 = time.perf_counter()
                tier.save(step, state, {"step": step})
                blocking.append(time.perf_counter() - t1)
                tier.pending.add_done_callback(lambda _, t=t1: writes.append(time.perf_counter() - t))
            times.append(time.perf_counter() - t0)
        tier.wait()
        return times

    phases = harness.interleaved({"plain": lambda: phase(False), "saving": lambda: phase(True)}, 2)
    plain, saving = harness.flat(phases["plain"]), harness.flat(phases["saving"])
    t0 = time.perf_counter()
    restored, _ = tier.restore(tier.steps()[0])
    jax.block_until_ready(restored)
    restore_s = time.perf_counter() - t0
    tier.close()
    shutil.rmtree(root, ignore_errors=True)  # the local tier's copies: in /dev/shm, memory

    report(args, dict(prog.mesh.shape), state_mb, plain, saving, blocking, writes, restore_s)


if __name__ == "__main__":
    main()
