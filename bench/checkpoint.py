"""Async checkpoint cost and restore speed on 8 simulated CPU devices.

    .venv/bin/python bench/checkpoint.py                 # GPT D=512, 8 layers: ~400 MB of train state
    .venv/bin/python bench/checkpoint.py --d-model 256   # smaller and quicker
    .venv/bin/python bench/checkpoint.py --compare       # replica-parallel saving off vs on, in the same run
    .venv/bin/python bench/checkpoint.py --niceness 0    # writer threads at the train step's CPU priority

Measures, all in one run so that the ratios share the machine's load:
  1. blocking fraction: the time `Checkpointer.save()` holds the training loop (async: until the
     arrays are copied off the devices) over the time of a whole save (save + wait for commit),
     for the saves after the first;
  2. step-time ratio: the median step time while a save is in flight over the median step time
     without one, measured alternately;
  3. restore ratio: `Checkpointer.restore` (metadata check + orbax restore into the sharded
     train state) over reading the same arrays straight from the checkpoint with tensorstore
     (all arrays opened and read concurrently into host memory).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import tensorstore as ts  # noqa: E402

from shardtrain import checkpoint, config, loop, mesh as mesh_lib, step as step_lib  # noqa: E402


def tensorstore_read(step_dir: str, names: list[str]) -> float:
    """Seconds to read every array of a checkpoint's state directly with tensorstore."""
    t0 = time.perf_counter()
    base = {"driver": "ocdbt", "base": f"file://{step_dir}/state"}
    stores = [ts.open({"driver": "zarr", "kvstore": {**base, "path": n}}, open=True) for n in names]
    reads = [s.result().read() for s in stores]
    nbytes = sum(r.result().nbytes for r in reads)
    assert nbytes > 0
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--saves", type=int, default=4, help="saves measured after the first")
    p.add_argument("--niceness", type=int, default=19,
                   help="checkpoint.writer_niceness (0: writer at the step's priority)")
    p.add_argument("--compare", action="store_true",
                   help="measure saving with replica-parallel off (the single-process default) and on, interleaved")
    args = p.parse_args()

    root = tempfile.mkdtemp(prefix="bench_ckpt_")
    cfg = config.load("meshes/demo.yaml", [
        f"model.d_model={args.d_model}", f"model.n_layers={args.layers}", f"model.d_ff={4 * args.d_model}",
        "model.n_heads=8", "model.n_kv_heads=8", "data.source=synthetic", "data.seq_len=16",
        "train.global_batch_size=8", "checkpoint.max_to_keep=2", f"checkpoint.writer_niceness={args.niceness}",
        f"run_dir={root}"])
    prog = step_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    compiled = prog.lower().compile()
    state = prog.init(0)
    state_mb = sum(x.nbytes for x in jax.tree.leaves(state)) / 1e6
    batch = loop.bare_loop_batches(prog, 1)[0]
    variants = {"replica-parallel off": False, "replica-parallel on": True} if args.compare else {"default": None}
    ckpts = {}
    for name, replica_parallel in variants.items():  # one checkpoint directory per variant
        run_dir = os.path.join(root, name.replace(" ", "_"))
        ckpts[name] = checkpoint.Checkpointer(dataclasses.replace(cfg, run_dir=run_dir), prog.abstract_state,
                                              prog.mesh.shape, replica_parallel)

    def train_step() -> float:
        nonlocal state
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics["loss"])
        return time.perf_counter() - t0

    for _ in range(3):
        train_step()
    first_save = {}
    for name, ckpt in ckpts.items():
        t0 = time.perf_counter()
        ckpt.save(1, state)  # the first save (slower: creates directories, warms orbax/tensorstore)
        ckpt.wait()
        first_save[name] = time.perf_counter() - t0

    blocking, whole, in_flight = ({name: [] for name in ckpts} for _ in range(3))
    without = []
    step = 1
    for r in range(args.saves):
        order = list(ckpts.items())[::-1 if r % 2 else 1]  # variants interleaved, first in turn
        for name, ckpt in order:
            step += 1
            t0 = time.perf_counter()  # a whole save, nothing else running
            ckpt.save(step, state)
            ckpt.wait()
            whole[name].append(time.perf_counter() - t0)

            step += 1
            t0 = time.perf_counter()  # an async save with training steps running beside it
            ckpt.save(step, state)
            blocking[name].append(time.perf_counter() - t0)
            n = 0
            while ckpt.manager.is_saving_in_progress() or n == 0:
                in_flight[name].append(train_step())
                ckpt.check()  # as the trainer does after each step
                n += 1
            ckpt.wait()
            without += [train_step() for _ in range(max(n, 3))]

    ckpt = next(iter(ckpts.values()))
    latest = ckpt.latest_step()
    names = [m.name for m in jax.tree.leaves(ckpt.manager.item_metadata(latest)["state"].tree)]
    restore, direct = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        restored, _ = ckpt.restore(latest)
        jax.block_until_ready(restored)
        restore.append(time.perf_counter() - t0)
        del restored
        direct.append(tensorstore_read(f"{ckpt.dir}/{latest}", names))
    for c in ckpts.values():
        c.close()

    med = statistics.median
    print(f"state: {state_mb:.0f} MB ({len(names)} arrays) on {jax.device_count()} devices, "
          f"mesh {dict(prog.mesh.shape)}")
    for name in ckpts:
        print(f"[{name}] first save (blocking + commit): {first_save[name]:.2f} s")
        print(f"[{name}] save() blocking: median {med(blocking[name]):.3f} s over {len(blocking[name])} saves "
              f"(min {min(blocking[name]):.3f}, max {max(blocking[name]):.3f}); whole save median "
              f"{med(whole[name]):.2f} s; blocking fraction {med(blocking[name]) / med(whole[name]):.3f} "
              "(goal <= 0.05)")
        print(f"[{name}] step time: median {med(in_flight[name]):.3f} s with a save in flight "
              f"({len(in_flight[name])} steps), {med(without):.3f} s without ({len(without)} steps, all variants); "
              f"ratio {med(in_flight[name]) / med(without):.2f} (goal <= 1.10); per save, "
              f"{len(in_flight[name]) / args.saves:.1f} steps in flight, training time lost "
              f"{(sum(in_flight[name]) - len(in_flight[name]) * med(without)) / args.saves:.2f} s")
    print(f"[{next(iter(ckpts))}] restore: median {med(restore):.2f} s; tensorstore direct read {med(direct):.2f} s; "
          f"ratio {med(restore) / med(direct):.2f}")


if __name__ == "__main__":
    main()
