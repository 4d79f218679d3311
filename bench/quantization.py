"""Loss curves of train.quantization none / int8 / fp8 on the same steps and data, plotted together.

    .venv/bin/python bench/quantization.py --run /tmp/q      # trains meshes/demo.yaml 300 steps per mode
    .venv/bin/python bench/quantization.py /tmp/q            # only plots runs already in /tmp/q/d_<mode>

Each mode trains `meshes/demo.yaml train.steps=300 train.quantization=<mode>` (8 simulated CPU
devices, data=2 x fsdp=2 x tensor=2, seed 0: the same initial weights and batches) into
DIR/d_<mode>, one after another. Writes bench/results/quantization_loss.png (the three curves,
smoothed over 10 steps) and bench/results/quantization_loss.json (every 5th step's loss per mode, and
the mean loss over the last 20 steps against none's: the acceptance check's measure); record:
bench/results/quantization.jsonl.
"""

from __future__ import annotations

import harness  # isort: split

import argparse
import json
import statistics
from pathlib import Path

MODES = ("none", "int8", "fp8")


def summarise(out: Path) -> dict:
    curves = {mode: harness.run_losses(out / f"d_{mode}") for mode in MODES}
    last = max(curves["none"])
    final = {m: statistics.mean(v for s, v in c.items() if s > last - 20) for m, c in curves.items()}
    return {"steps": last, "final_loss_last_20": final,
            "vs_none": {m: (final[m] - final["none"]) / final["none"] for m in MODES},
            "loss_every_5": {m: {s: round(v, 4) for s, v in c.items() if s % 5 == 0} for m, c in curves.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--run", action="store_true", help="train the three modes first")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    if args.run:
        harness.train_demo(args.dir, args.steps, "train.quantization", MODES, "d")
    summary = summarise(args.dir)
    harness.RESULTS.mkdir(parents=True, exist_ok=True)
    (harness.RESULTS / "quantization_loss.json").write_text(json.dumps(summary, indent=None) + "\n")
    harness.plot_losses(summary["final_loss_last_20"], {m: harness.run_losses(args.dir / f"d_{m}") for m in MODES},
                        harness.RESULTS / "quantization_loss.png", "train.quantization")
    figures = {k: summary[k] for k in ("steps", "final_loss_last_20", "vs_none")}
    print(json.dumps(figures, indent=1))
    harness.record("quantization", figures, trained_here=args.run, runs=str(args.dir),
                   files=["quantization_loss.json", "quantization_loss.png"])


if __name__ == "__main__":
    main()
