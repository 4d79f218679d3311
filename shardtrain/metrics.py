"""Run metrics: metrics.jsonl, TensorBoard, a progress bar, MFU and a loss plot. Process 0 only."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import jax
from tqdm import tqdm

from shardtrain import chips
from shardtrain.config import RunConfig


def drop_rows_after(path: Path, step: int) -> None:
    """Removes the step rows past `step` (logged after the checkpoint a run resumes from, e.g.
    before a kill -9), so a resumed metrics.jsonl has each step once. Event lines stay."""
    if not path.exists():
        return
    lines, kept = path.read_text().splitlines(), []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if ("loss" not in row and "eval_loss" not in row) or row.get("step", 0) <= step:
            kept.append(line + "\n")
    if len(kept) != len(lines):
        path.write_text("".join(kept))


class Metrics:
    """Logs one row per logged step; writes only on process 0 (others keep the bookkeeping)."""

    def __init__(self, cfg: RunConfig, flops_per_token: float, start_step: int):
        """flops_per_token: the model's (for MFU); start_step: the step the run starts or resumes at."""
        self.cfg, self.dir = cfg, Path(cfg.run_dir)
        self.main = jax.process_index() == 0
        self.tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
        self.flops_per_step = flops_per_token * self.tokens_per_step
        chip = chips.for_device_kind(jax.devices()[0].device_kind)
        self.peak_flops = chip.per_device().peak_flops * jax.device_count() if chip else None
        self.step_times: list[float] = []
        self.losses: list[tuple[int, float]] = []
        self.file = self.tb = self.bar = None
        if self.main:
            self.dir.mkdir(parents=True, exist_ok=True)
            drop_rows_after(self.dir / "metrics.jsonl", start_step)
            self.file = open(self.dir / "metrics.jsonl", "a")
            from tensorboardX import SummaryWriter
            self.tb = SummaryWriter(str(self.dir / "tensorboard"))
            self.bar = tqdm(total=cfg.train.steps, initial=start_step, unit="step", dynamic_ncols=True)

    def log(self, step: int, values: dict, step_time: float, extra: dict | None = None) -> None:
        """`values` are host floats for completed step `step` (1-based count of updates); `extra`:
        more fields for the row (the processes' host times)."""
        self.step_times.append(step_time)
        loss = values["loss"]
        self.losses.append((step, loss))
        row = {"step": step, **values, "step_time_s": step_time,
               "tokens_per_s": self.tokens_per_step / step_time, **(extra or {})}
        if self.peak_flops:
            row["mfu"] = self.flops_per_step / step_time / self.peak_flops
        if not math.isfinite(loss):
            row["event"] = "non-finite loss"
        if not self.main:
            return
        if step % self.cfg.train.log_every == 0 or step == self.cfg.train.steps:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
            for k, v in row.items():
                if k not in ("step", "slowest_process") and isinstance(v, float):
                    self.tb.add_scalar(k, v, step)
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")

    def log_eval(self, step: int, values: dict) -> None:
        """An evaluation row {step, eval_loss, eval_perplexity, eval_tokens}: file, TensorBoard, console."""
        if not self.main:
            return
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        for k, v in values.items():
            self.tb.add_scalar(k, v, step)
        self.message(f"step {step}: eval_loss {values['eval_loss']:.4f}, "
                     f"eval_perplexity {values['eval_perplexity']:.2f}")

    def event(self, event: str, **fields) -> None:
        if self.main:
            self.file.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
            self.file.flush()

    def goodput(self, report: dict | None) -> None:
        """The run's goodput so far (goodput.report, across restarts): a metrics.jsonl event,
        TensorBoard scalars goodput/*, and a console line."""
        if not self.main or report is None:
            return
        step = self.losses[-1][0] if self.losses else 0
        self.event("goodput", step=step, goodput=report["goodput"], wall_s=report["wall_s"],
                   categories=report["categories"])
        self.tb.add_scalar("goodput/fraction", report["goodput"], step)
        for name, seconds in report["categories"].items():
            self.tb.add_scalar(f"goodput/{name}_s", seconds, step)
        lost = sorted(((s, n) for n, s in report["categories"].items() if n != "productive_steps"), reverse=True)[:3]
        self.message(f"goodput {report['goodput']:.3f} of {report['wall_s']:.0f} s over {report['starts']} start(s); "
                     f"most lost to {', '.join(f'{n} {s:.0f} s' for s, n in lost)} "
                     f"(shardtrain goodput {self.dir})")

    def message(self, text: str) -> None:
        """A console line from process 0 that does not break the progress bar."""
        if self.main:
            (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if not self.main:
            return
        self.bar.close()
        self.tb.close()
        self.file.close()
        if self.losses:
            self.plot()

    def summary(self) -> None:
        """The closing console line of a finished run."""
        if self.main and self.losses:
            times = sorted(self.step_times)
            median = times[len(times) // 2]
            first, last = self.losses[0], self.losses[-1]
            print(f"done: step {last[0]}, loss {first[1]:.3f} -> {last[1]:.3f}, median step {median:.3f} s, "
                  f"{self.tokens_per_step / median:.0f} tokens/s; run dir {self.dir}")
            profile = self.dir / "profile"
            traced = self.cfg.train.profile_steps is not None and profile.is_dir()
            print(f"loss plot: {self.dir / 'loss.png'}" +
                  (f"; profile: {profile} (tensorboard --logdir {profile}, or XProf)" if traced else ""))

    def plot(self) -> None:
        """loss.png from the whole metrics.jsonl (so a resumed run plots all of it)."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        rows = [json.loads(line) for line in (self.dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        points = sorted({r["step"]: r["loss"] for r in rows if "loss" in r}.items())
        evals = sorted({r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}.items())
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([p[0] for p in points], [p[1] for p in points], label="train")
        if evals:
            ax.plot([p[0] for p in evals], [p[1] for p in evals], "o-", label="eval")
            ax.legend()
        ax.set(xlabel="step", ylabel="loss", title=self.cfg.name)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.dir / "loss.png", dpi=100)
        plt.close(fig)
