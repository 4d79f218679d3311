"""Run metrics: metrics.jsonl, TensorBoard, a progress bar, MFU and a loss plot. Process 0 only.

A write that fails (a full disk, a lost mount) does not stop the step in which it happens: it sets
`Metrics.failed` (one line naming the file and the reason), later writes are skipped, and the loop
saves a checkpoint and stops at the step boundary. TensorBoard events are written in this thread
(tensorboardX's writer thread dies on such an error and then blocks the loop on its full queue).
"""

from __future__ import annotations

import json
import math
import os
import sys
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
    if len(kept) != len(lines):  # a full disk must not leave it half written
        partial = path.with_name(path.name + ".partial")
        partial.write_text("".join(kept))
        os.replace(partial, path)


class Board:
    """TensorBoard scalars in one events file, written by the caller's thread (errors raise here)."""

    def __init__(self, logdir: Path):
        from tensorboardX.event_file_writer import EventsWriter
        logdir.mkdir(parents=True, exist_ok=True)
        self.writer, self.flushed = EventsWriter(str(logdir / "events")), time.monotonic()
        self.writer.flush()

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar
        self.writer.write_event(Event(wall_time=time.time(), step=step, summary=scalar(tag, value)))

    def flush(self, every_s: float = 10.0) -> None:
        if time.monotonic() - self.flushed >= every_s:
            self.writer.flush()
            self.flushed = time.monotonic()

    def close(self) -> None:
        self.writer.close()


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
        self.failed: str | None = None
        self.skipped = 0
        if self.main:
            self._write(self.dir / "metrics.jsonl", lambda: self._open(start_step))
            self._write(self.dir / "tensorboard", lambda: setattr(self, "tb", Board(self.dir / "tensorboard")))
            self.bar = tqdm(total=cfg.train.steps, initial=start_step, unit="step", dynamic_ncols=True)

    def _open(self, start_step: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        drop_rows_after(self.dir / "metrics.jsonl", start_step)
        self.file = open(self.dir / "metrics.jsonl", "a")

    def _write(self, what: Path, write) -> None:
        """Calls `write()`; the first that fails sets `failed`, and none is called after it."""
        if self.failed is None:
            try:
                write()
            except OSError as e:
                self.failed = f"cannot write {what}: {e.strerror or e}"

    def _row(self, row: dict) -> None:
        if self.file is not None:
            line = json.dumps(row) + "\n"
            self._write(self.dir / "metrics.jsonl", lambda: (self.file.write(line), self.file.flush()))

    def _scalars(self, values: dict, step: int) -> None:
        def write():
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.tb is not None:
            self._write(self.dir / "tensorboard", write)

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
            self._row(row)
            self._scalars({k: v for k, v in row.items() if k not in ("step", "slowest_process")
                           and isinstance(v, float)}, step)
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")

    def log_eval(self, step: int, values: dict) -> None:
        """An evaluation row {step, eval_loss, eval_perplexity, eval_tokens}: file, TensorBoard, console."""
        if not self.main:
            return
        self._row({"step": step, **values})
        self._scalars(values, step)
        self.message(f"step {step}: eval_loss {values['eval_loss']:.4f}, "
                     f"eval_perplexity {values['eval_perplexity']:.2f}")

    def event(self, event: str, **fields) -> None:
        if self.main:
            self._row({"event": event, "time": time.time(), **fields})

    def skip(self, step: int) -> None:
        """Step `step` was non-finite and skipped (train.on_nonfinite=skip)."""
        self.skipped += 1
        self.event("nonfinite", step=step, action="skip", skipped_total=self.skipped)
        self.message(f"step {step}: non-finite loss or gradients; skipped it "
                     f"(parameters and optimizer state unchanged; {self.skipped} skipped so far)")

    def goodput(self, report: dict | None) -> None:
        """The run's goodput so far (goodput.report, across restarts): a metrics.jsonl event,
        TensorBoard scalars goodput/*, and a console line."""
        if not self.main or report is None:
            return
        step = self.losses[-1][0] if self.losses else 0
        self.event("goodput", step=step, goodput=report["goodput"], wall_s=report["wall_s"],
                   categories=report["categories"])
        self._scalars({"goodput/fraction": report["goodput"],
                       **{f"goodput/{name}_s": seconds for name, seconds in report["categories"].items()}}, step)
        lost = sorted(((s, n) for n, s in report["categories"].items() if n != "productive_steps"), reverse=True)[:3]
        self.message(f"goodput {report['goodput']:.3f} of {report['wall_s']:.0f} s over {report['starts']} start(s); "
                     f"most lost to {', '.join(f'{n} {s:.0f} s' for s, n in lost)} "
                     f"(shardtrain goodput {self.dir})")

    def message(self, text: str) -> None:
        """A console line from process 0 that does not break the progress bar."""
        if self.main:
            (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        """Closes the files and writes loss.png; a write that fails here is said in one line."""
        if not self.main:
            return
        self.bar.close()
        failed = self.failed
        for what, f in ((self.dir / "tensorboard", self.tb), (self.dir / "metrics.jsonl", self.file)):
            try:
                if f is not None:
                    f.close()
            except OSError as e:
                self.failed = self.failed or f"cannot write {what}: {e.strerror or e}"
        if self.losses:
            self._write(self.dir / "loss.png", self.plot)
        if self.failed is not None and failed is None:
            print(f"shardtrain: error: {self.failed}", file=sys.stderr, flush=True)

    def summary(self, ending: str = "done") -> None:
        """The closing console line of a run that ended by itself (`done`) or was `preempted`."""
        if self.main and self.losses:
            times = sorted(self.step_times)
            median = times[len(times) // 2]
            first, last = self.losses[0], self.losses[-1]
            skipped = f"; {self.skipped} non-finite steps skipped" if self.skipped else ""
            print(f"{ending}: step {last[0]}, loss {first[1]:.3f} -> {last[1]:.3f}, median step {median:.3f} s, "
                  f"{self.tokens_per_step / median:.0f} tokens/s{skipped}; run dir {self.dir}")
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
