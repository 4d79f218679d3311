"""Loss curves and step times of optimizer.name adamw / adafactor / muon / lion on the same steps and data.

    .venv/bin/python bench/optimizers.py --run /tmp/opt      # trains meshes/demo.yaml 150 steps per optimizer
    .venv/bin/python bench/optimizers.py /tmp/opt            # only summarises runs already in /tmp/opt/o_<name>
    .venv/bin/python bench/optimizers.py --time /tmp/opt     # and times the four compiled steps, interleaved

Each optimizer trains `meshes/demo.yaml train.steps=150 optimizer.name=<name>` (8 simulated CPU
devices, data=2 x fsdp=2 x tensor=2, seed 0: the same initial weights and batches; the demo's
learning rate 3e-3, warmup 20, cosine, for all four) into DIR/o_<name>, one after another. Writes
bench/results/optimizers_loss.png (the curves, smoothed over 10 steps) and
bench/results/optimizers_loss.json (the mean loss over the last 20 steps, the median step time against
adamw's, and every 5th step's loss per optimizer); record: bench/results/optimizers.jsonl. Step times:
with --time, the four compiled demo steps in one process, round-robin (5 rounds of 6 steps each), so
that the load of the machine falls on all four alike; without it, each run's logged median after
step 10 (runs one after another: other jobs' load drifts between them).
"""

from __future__ import annotations

import harness  # isort: split

import argparse
import json
import statistics
from pathlib import Path

NAMES = ("adamw", "adafactor", "muon", "lion")


def step_time(run_dir: Path) -> float:
    """Median step_time_s of the logged steps after step 10 (compilation and warm-up excluded)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return statistics.median(r["step_time_s"] for r in rows if "step_time_s" in r and r.get("step", 0) > 10)


def interleaved_step_times(rounds: int = 5, steps: int = 6) -> dict[str, float]:
    """Median seconds per step of each optimizer's compiled demo step, the four taking turns."""
    from shardtrain import config, step
    from shardtrain.parallel import mesh as mesh_lib

    steppers = {}
    for name in NAMES:
        cfg = config.load(str(harness.ROOT / "meshes/demo.yaml"), [f"optimizer.name={name}"])
        prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
        steppers[name] = harness.Stepper(prog.lower().compile(), prog.init(0),
                                         harness.bare_loop_batches(prog, steps), steps)
    times = harness.interleaved(steppers, rounds)
    return {name: statistics.median(harness.flat(t)) for name, t in times.items()}


def summarise(out: Path, times: dict[str, float] | None) -> dict:
    curves = {name: harness.run_losses(out / f"o_{name}") for name in NAMES}
    last = max(curves["adamw"])
    times = times or {name: step_time(out / f"o_{name}") for name in NAMES}
    final = {n: statistics.mean(v for s, v in c.items() if s > last - 20) for n, c in curves.items()}
    return {"steps": last, "final_loss_last_20": final,
            "step_time_s": times, "step_time_vs_adamw": {n: times[n] / times["adamw"] for n in NAMES},
            "loss_every_5": {n: {s: round(v, 4) for s, v in c.items() if s % 5 == 0} for n, c in curves.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--run", action="store_true", help="train the four optimizers first")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--time", action="store_true", help="time the compiled steps interleaved in this process")
    args = parser.parse_args()
    if args.run:
        harness.train_demo(args.dir, args.steps, "optimizer.name", NAMES, "o")
    summary = summarise(args.dir, interleaved_step_times() if args.time else None)
    harness.RESULTS.mkdir(parents=True, exist_ok=True)
    (harness.RESULTS / "optimizers_loss.json").write_text(json.dumps(summary, indent=None) + "\n")
    harness.plot_losses(summary["final_loss_last_20"], {n: harness.run_losses(args.dir / f"o_{n}") for n in NAMES},
                        harness.RESULTS / "optimizers_loss.png", "optimizer.name", top=3.5)
    figures = {k: summary[k] for k in ("steps", "final_loss_last_20", "step_time_s", "step_time_vs_adamw")}
    print(json.dumps(figures, indent=1))
    harness.record("optimizers", figures, trained_here=args.run, runs=str(args.dir), interleaved_times=args.time,
                   files=["optimizers_loss.json", "optimizers_loss.png"])


if __name__ == "__main__":
    main()
