"""Loss curves of train.quantization none / int8 / fp8 on the same steps and data, plotted together.

    .venv/bin/python bench/quantization.py --run /tmp/q      # trains meshes/demo.yaml 300 steps per mode
    .venv/bin/python bench/quantization.py /tmp/q            # only plots runs already in /tmp/q/d_<mode>

Each mode trains `meshes/demo.yaml train.steps=300 train.quantization=<mode>` (8 simulated CPU
devices, data=2 x fsdp=2 x tensor=2, seed 0: the same initial weights and batches) into
DIR/d_<mode>, one after another. Writes bench/quantization_loss.png (the three curves, smoothed over
10 steps) and bench/quantization_loss.json (every 5th step's loss per mode, and the mean loss over
the last 20 steps against none's: the acceptance check's measure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

MODES = ("none", "int8", "fp8")
HERE = Path(__file__).resolve().parent


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "step" in r}


def train(out: Path, steps: int, field: str = "train.quantization", values=MODES, prefix: str = "d") -> None:
    """meshes/demo.yaml for `steps` steps with each of `values` of `field`, into out/<prefix>_<value>."""
    for value in values:
        subprocess.run([sys.executable, "-m", "shardtrain.cli", "train", "meshes/demo.yaml", f"train.steps={steps}",
                        f"{field}={value}", f"run_dir={out / f'{prefix}_{value}'}", "checkpoint.every_steps=1000"],
                       cwd=HERE.parent, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def summarise(out: Path) -> dict:
    curves = {mode: losses(out / f"d_{mode}") for mode in MODES}
    last = max(curves["none"])
    final = {m: statistics.mean(v for s, v in c.items() if s > last - 20) for m, c in curves.items()}
    return {"steps": last, "final_loss_last_20": final,
            "vs_none": {m: (final[m] - final["none"]) / final["none"] for m in MODES},
            "loss_every_5": {m: {s: round(v, 4) for s, v in c.items() if s % 5 == 0} for m, c in curves.items()}}


def plot(summary: dict, curves: dict, path: Path, what: str = "train.quantization", top: float = 3.0) -> None:
    """The curves smoothed over 10 steps, each labelled with its last-20-step mean (bench/optimizers.py too)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=80)
    for mode, c in curves.items():
        steps = sorted(c)
        smooth = [statistics.mean(c[t] for t in steps[max(0, i - 9):i + 1]) for i in range(len(steps))]
        ax.plot(steps, smooth, label=f"{mode}: {summary['final_loss_last_20'][mode]:.3f}", linewidth=1)
    ax.set(xlabel="step", ylabel="loss (10-step mean)", ylim=(1.0, top),
           title=f"demo GPT, {what} (last-20-step mean in the legend)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--run", action="store_true", help="train the three modes first")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    if args.run:
        train(args.dir, args.steps)
    summary = summarise(args.dir)
    (HERE / "quantization_loss.json").write_text(json.dumps(summary, indent=None) + "\n")
    plot(summary, {m: losses(args.dir / f"d_{m}") for m in MODES}, HERE / "quantization_loss.png")
    print(json.dumps({k: summary[k] for k in ("steps", "final_loss_last_20", "vs_none")}, indent=1))


if __name__ == "__main__":
    main()
