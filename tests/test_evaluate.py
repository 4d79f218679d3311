"""Evaluation on the held-out split: during training (train.eval_every) and with `shardtrain eval`."""

import json

import numpy as np
import pytest

from prepared_data import run_cli


@pytest.mark.slow
def test_train_evaluates_and_eval_command_agrees(prepared, capsys, tmp_path):
    """Training on prepared tokens logs eval rows; `shardtrain eval` of its checkpoint gives the
    last row's eval_loss again."""
    args = ["meshes/demo.yaml", "data.source=tokens", f"data.path={prepared}", "model.vocab_size=320",
            "data.seq_len=15", "train.global_batch_size=8", "model.d_model=32", "model.n_layers=1",
            "model.d_ff=64", "train.steps=4", "train.eval_every=2", "train.eval_steps=2", f"run_dir={tmp_path}"]
    code, _, err = run_cli(capsys, "train", *args)
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(np.isclose(r["eval_perplexity"], np.exp(r["eval_loss"])) for r in evals)
    code, out, _ = run_cli(capsys, "eval", args[0], str(tmp_path / "checkpoints" / "4"), *args[1:])
    row = json.loads(out.strip().splitlines()[-1]) if code == 0 else None
    assert code == 0 and row["step"] == 4 and abs(row["eval_loss"] - evals[-1]["eval_loss"]) < 1e-5
