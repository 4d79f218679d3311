"""Async checkpoint cost and restore speed on 8 simulated CPU devices.

    .venv/bin/python bench/checkpoint.py                 # GPT D=512, 8 layers: ~400 MB of train state
    .venv/bin/python bench/checkpoint.py --d-model 256   # smaller and quicker
    .venv/bin/python bench/checkpoint.py --compare       # replica-parallel saving off vs on, in the same run
    .venv/bin/python bench/checkpoint.py --niceness 0    # writer threads at the train step's CPU priority
    .venv/bin/python bench/checkpoint.py --checksums     # saves without vs with checksums, in the same run

Measures, all in one run so that the ratios share the machine's load:
  1. blocking fraction: the time `Checkpointer.save()` holds the training loop (async: until the
     arrays are copied off the devices) over the time of a whole save (save + wait for commit),
     for the saves after the first (and the blocking time of the whole saves, which no step runs beside);
  2. step-time ratio: the median step time while a save is in flight over the median step time
     without one, measured alternately;
  3. restore ratio: `Checkpointer.restore` (metadata check + orbax restore into the sharded
     train state) over reading the same arrays straight from the checkpoint with tensorstore
     (all arrays opened and read concurrently into host memory). The restore verifies the step's
     checksums first (it reads the stored values once more).
Record: bench/results/checkpoint.jsonl.
"""

from __future__ import annotations

import harness  # isort: split

import argparse
import dataclasses
import itertools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator

import jax
import tensorstore as ts

from shardtrain import config, step as step_lib
from shardtrain.checkpoint import manager
from shardtrain.parallel import mesh as mesh_lib

med = statistics.median


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--saves", type=int, default=4, help="saves measured after the first")
    p.add_argument("--niceness", type=int, default=19,
                   help="checkpoint.writer_niceness (0: writer at the step's priority)")
    p.add_argument("--compare", action="store_true",
                   help="measure saving with replica-parallel off (the single-process default) and on, interleaved")
    p.add_argument("--checksums", action="store_true",
                   help="measure saving without and with checksums (recorded before the commit), interleaved")
    return p.parse_args()


def tensorstore_read(step_dir: str, names: list[str]) -> float:
    """Seconds to read every array of a checkpoint's state directly with tensorstore."""
    t0 = time.perf_counter()
    base = {"driver": "ocdbt", "base": f"file://{step_dir}/state"}
    stores = [ts.open({"driver": "zarr", "kvstore": {**base, "path": n}}, open=True) for n in names]
    reads = [s.result().read() for s in stores]
    nbytes = sum(r.result().nbytes for r in reads)
    assert nbytes > 0
    return time.perf_counter() - t0


class Trainer:
    """The compiled train step of the benchmark's model on one batch, and its state."""

    def __init__(self, args, root: str):
        self.cfg = config.load("meshes/demo.yaml", [
            f"model.d_model={args.d_model}", f"model.n_layers={args.layers}", f"model.d_ff={4 * args.d_model}",
            "model.n_heads=8", "model.n_kv_heads=8", "data.source=synthetic", "data.seq_len=16",
            "train.global_batch_size=8", "checkpoint.max_to_keep=2", f"checkpoint.writer_niceness={args.niceness}",
            f"run_dir={root}"])
        self.prog = step_lib.build(self.cfg, mesh_lib.make_mesh(self.cfg.mesh))
        self.stepper = harness.Stepper(self.prog.lower().compile(), self.prog.init(0),
                                       harness.bare_loop_batches(self.prog, 1))

    @property
    def state(self) -> dict:
        return self.stepper.state

    def step(self) -> float:
        """Seconds of one train step, waited for."""
        return self.stepper()[0]


def checkpointers(trainer: Trainer, root: str, args) -> dict[str, manager.Checkpointer]:
    """One Checkpointer per variant, each with its own checkpoint directory."""
    variants = ({"replica-parallel off": {"replica_parallel": False}, "replica-parallel on": {"replica_parallel": True}}
                if args.compare else {"checksums off": {"checksums": False}, "checksums on": {"checksums": True}}
                if args.checksums else {"default": {}})
    return {name: manager.Checkpointer(dataclasses.replace(trainer.cfg, run_dir=os.path.join(root, name.replace(
        " ", "_"))), trainer.prog.abstract_state, trainer.prog.mesh.shape, **kw)
        for name, kw in variants.items()}


def first_saves(trainer: Trainer, ckpts: dict) -> dict[str, float]:
    """Seconds of each variant's first save (slower: creates directories, warms orbax/tensorstore)."""
    out = {}
    for name, ckpt in ckpts.items():
        t0 = time.perf_counter()
        ckpt.save(1, trainer.state)
        ckpt.wait()
        out[name] = time.perf_counter() - t0
    return out


def save_round(trainer: Trainer, ckpt, steps: Iterator[int]) -> dict:
    """One measured save of one variant: a whole save with nothing else running, then an async save
    with training steps beside it until it commits, then as many steps without a save. `steps`: the
    step numbers to save as."""
    t0 = time.perf_counter()
    ckpt.save(next(steps), trainer.state)
    idle = time.perf_counter() - t0  # blocking with no step running beside the save
    ckpt.wait()
    whole = time.perf_counter() - t0

    t0 = time.perf_counter()
    ckpt.save(next(steps), trainer.state)
    blocking = time.perf_counter() - t0
    in_flight = []
    while ckpt.manager.is_saving_in_progress() or not in_flight:
        in_flight.append(trainer.step())
        ckpt.check()  # as the trainer does after each step
    ckpt.wait()
    without = [trainer.step() for _ in range(max(len(in_flight), 3))]
    return {"whole": whole, "blocking": blocking, "blocking_idle": idle, "in_flight": in_flight, "without": without}


def measure_saves(trainer: Trainer, ckpts: dict, saves: int) -> dict[str, dict[str, list]]:
    """{variant: {whole, blocking: [s per save], in_flight: [step s]}, "without": [step s, all variants]},
    the variants interleaved save by save, the first in turn."""
    steps = itertools.count(2)  # after the first saves' step 1, shared by the variants
    rounds = harness.interleaved({name: lambda c=ckpt: save_round(trainer, c, steps) for name, ckpt in ckpts.items()},
                                 saves, alternate=True)
    out = {}
    for name, rs in rounds.items():
        out[name] = {"whole": [r["whole"] for r in rs], "blocking": [r["blocking"] for r in rs],
                     "blocking_idle": [r["blocking_idle"] for r in rs],
                     "in_flight": harness.flat([r["in_flight"] for r in rs])}
    out["without"] = harness.flat([r["without"] for rs in rounds.values() for r in rs])
    return out


def measure_restore(ckpt) -> dict:
    """Medians of 3 alternating runs: Checkpointer.restore of the latest step and a tensorstore read."""
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
    return {"arrays": len(names), "restore_s": med(restore), "tensorstore_s": med(direct),
            "ratio": med(restore) / med(direct)}


def figures(m: dict, without: list[float], first: float, saves: int) -> dict:
    """One variant's figures, as printed."""
    blocking, whole, in_flight = m["blocking"], m["whole"], m["in_flight"]
    return {"first_save_s": first, "blocking_s": med(blocking), "blocking_idle_s": med(m["blocking_idle"]),
            "blocking_min_s": min(blocking),
            "blocking_max_s": max(blocking), "whole_save_s": med(whole),
            "blocking_fraction": med(blocking) / med(whole),
            "step_in_flight_s": med(in_flight), "steps_in_flight": len(in_flight), "step_without_s": med(without),
            "steps_without": len(without), "step_ratio": med(in_flight) / med(without),
            "steps_per_save": len(in_flight) / saves,
            "lost_per_save_s": (sum(in_flight) - len(in_flight) * med(without)) / saves}


def report(f: dict, restore: dict, saves: int) -> None:
    for name, v in f.items():
        print(f"[{name}] first save (blocking + commit): {v['first_save_s']:.2f} s")
        print(f"[{name}] save() blocking: median {v['blocking_s']:.3f} s over {saves} saves "
              f"(min {v['blocking_min_s']:.3f}, max {v['blocking_max_s']:.3f}); whole save median "
              f"{v['whole_save_s']:.2f} s; blocking fraction {v['blocking_fraction']:.3f} (goal <= 0.05); "
              f"blocking with no step beside it: median {v['blocking_idle_s']:.3f} s")
        print(f"[{name}] step time: median {v['step_in_flight_s']:.3f} s with a save in flight "
              f"({v['steps_in_flight']} steps), {v['step_without_s']:.3f} s without ({v['steps_without']} steps, "
              f"all variants); ratio {v['step_ratio']:.2f} (goal <= 1.10); per save, {v['steps_per_save']:.1f} "
              f"steps in flight, training time lost {v['lost_per_save_s']:.2f} s")
    for name, r in restore.items():
        print(f"[{name}] restore: median {r['restore_s']:.2f} s; tensorstore direct read "
              f"{r['tensorstore_s']:.2f} s; ratio {r['ratio']:.2f}")


def main() -> None:
    args = parse_args()
    root = tempfile.mkdtemp(prefix="bench_ckpt_")
    trainer = Trainer(args, root)
    state_mb = sum(x.nbytes for x in jax.tree.leaves(trainer.state)) / 1e6
    ckpts = checkpointers(trainer, root, args)
    for _ in range(3):
        trainer.step()
    first = first_saves(trainer, ckpts)
    saves = measure_saves(trainer, ckpts, args.saves)
    restored = list(ckpts) if args.checksums else list(ckpts)[:1]  # verified and not, or the first variant
    restore = {name: measure_restore(ckpts[name]) for name in restored}
    for c in ckpts.values():
        c.close()
    shutil.rmtree(root, ignore_errors=True)  # the checkpoints: about 0.7 GB
    mesh = dict(trainer.prog.mesh.shape)
    arrays = restore[restored[0]]["arrays"]
    print(f"state: {state_mb:.0f} MB ({arrays} arrays) on {jax.device_count()} devices, mesh {mesh}")
    f = {name: figures(saves[name], saves["without"], first[name], args.saves) for name in ckpts}
    report(f, restore, args.saves)
    harness.record("checkpoint", {"state_mb": state_mb, "variants": f, "restore": restore[restored[0]],
                                  "restore_by_variant": restore},
                   d_model=args.d_model, layers=args.layers, saves=args.saves, niceness=args.niceness,
                   compare=args.compare, checksums=args.checksums, mesh=mesh)


if __name__ == "__main__":
    main()
