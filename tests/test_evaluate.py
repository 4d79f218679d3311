"""Evaluation on the held-out split: during training (train.eval_every) and with `shardtrain eval`."""

import json
import types

import numpy as np
import pytest

from prepared_data import cfg_for, run_cli
from shardtrain import cli, evaluate
from shardtrain.config import ConfigError
from shardtrain.data import loader, prepare


@pytest.mark.slow
def test_train_evaluates_and_eval_command_agrees(prepared, capsys, tmp_path):
    """Training on prepared tokens logs eval rows; `shardtrain eval` of its checkpoint (the run's
    config.yaml read from its run dir) gives the last row's eval_loss again."""
    args = ["meshes/demo.yaml", "data.source=tokens", f"data.path={prepared}", "model.vocab_size=320",
            "data.seq_len=15", "train.global_batch_size=8", "model.d_model=32", "model.n_layers=1",
            "model.d_ff=64", "train.steps=4", "train.eval_every=2", "train.eval_steps=2", f"run_dir={tmp_path}"]
    code, _, err = run_cli(capsys, "train", *args)
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(np.isclose(r["eval_perplexity"], np.exp(r["eval_loss"])) for r in evals)
    code, out, _ = run_cli(capsys, "eval", str(tmp_path / "checkpoints" / "4"))  # the run's config.yaml
    row = json.loads(out.strip().splitlines()[-1]) if code == 0 else None
    assert code == 0 and row["step"] == 4 and abs(row["eval_loss"] - evals[-1]["eval_loss"]) < 1e-5


def test_eval_reads_the_runs_config_unless_given_one(tmp_path):
    step_dir = tmp_path / "run" / "checkpoints" / "4"
    step_dir.mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text("")
    run_config = str(tmp_path / "run" / "config.yaml")
    for given in (step_dir, step_dir.parent, step_dir.parent.parent):
        assert cli.eval_paths([str(given), "train.eval_steps=2"]) == (run_config, str(given), ["train.eval_steps=2"])
    assert cli.eval_paths(["c.yaml", str(step_dir), "a=1"]) == ("c.yaml", str(step_dir), ["a=1"])
    with pytest.raises(ConfigError, match="eval: no config.yaml in the run of '/nowhere'; give the run's config too"):
        cli.eval_paths(["/nowhere"])


def test_an_eval_that_wraps_around_a_small_split_says_so_once(prepared, cfg_factory, capsys):
    cfg = cfg_for(cfg_factory, prepared, "train.eval_steps=1000")
    held = len(loader.sources(cfg, "eval")[0])
    evaluate.Evaluator(types.SimpleNamespace(cfg=cfg))  # only its config is read before the evaluation
    assert capsys.readouterr().out == (
        f"eval: each evaluation reads 8000 windows (train.eval_steps=1000 x train.global_batch_size=8), but the "
        f"held-out split has {held}: it reads some twice and counts their tokens again; train.eval_steps={held // 8} "
        "reads each at most once\n")
    evaluate.Evaluator(types.SimpleNamespace(cfg=cfg_for(cfg_factory, prepared, f"train.eval_steps={held // 8}")))
    assert capsys.readouterr().out == ""


def test_an_empty_eval_split_says_what_fits_the_command(tok_path, corpus, cfg_factory, tmp_path):
    """`shardtrain eval` is not told to set train.eval_every=0; training with evaluation is."""
    prepare.prepare([str(corpus / "c*.txt")], prepare.Options(str(tok_path), str(tmp_path / "ds")), workers=1,
                    say=lambda _: None)
    cfg = cfg_for(cfg_factory, tmp_path / "ds")
    with pytest.raises(ConfigError, match="the 'eval' split is empty; prepare it with --eval-fraction F") as e:
        loader.eval_samples(cfg)
    assert "eval_every" not in str(e.value)
    with pytest.raises(ConfigError, match="--eval-fraction F .*, or train without evaluation: train.eval_every=0"):
        evaluate.Evaluator(types.SimpleNamespace(cfg=cfg))  # only its config is read before the split


def test_eval_of_a_step_without_its_array_metadata_is_one_line(capsys, tmp_path):
    import conftest
    code, _, err = run_cli(capsys, "train", "meshes/demo.yaml", *conftest.TINY, "model.name=mlp", "train.steps=2",
                           f"run_dir={tmp_path}")
    assert code == 0, err
    step = tmp_path / "checkpoints" / "2"
    (step / "state" / "_METADATA").unlink()
    for checksums in (True, False):  # found by the checksums, or (a step written without them) by reading
        if not checksums:
            (step / "checksums.json").unlink()
        code, out, err = run_cli(capsys, "eval", str(step))
        assert code == 2 and not out and len(err.strip().splitlines()) == 1, err
        assert f"checkpoint step 2 in {tmp_path / 'checkpoints'} cannot be used: " in err
        assert "state/_METADATA is missing" in err and "Traceback" not in err
