"""Checksums of both checkpoint tiers: flipped bits are found by resume (which falls back and sets
the step aside) and by `shardtrain ckpt --verify`; an untouched run, and one written without
checksums, resume exactly; a local-tier directory belongs to one run; a failing local tier warns once."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conftest
from prepared_data import run_cli
from shardtrain import config
from shardtrain.checkpoint import integrity, listing, local

TRAIN = ["train", "meshes/demo.yaml", *conftest.TINY, "model.name=mlp", "optimizer.warmup_steps=1",
         "checkpoint.every_steps=2"]


def flip_bits(path: Path, skip: int = 0) -> None:
    """Flips 10 bits spread over the file, past its first `skip` bytes."""
    b = bytearray(path.read_bytes())
    n = len(b) - skip
    for i in range(10):
        b[skip + (2 * i + 1) * n // 20] ^= 1 << (i % 8)
    path.write_bytes(bytes(b))


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_flipped_bits_in_a_committed_step_are_found_set_aside_and_skipped(capsys, tmp_path):
    run, clean = tmp_path / "run", tmp_path / "clean"
    assert run_cli(capsys, *TRAIN, "train.steps=6", f"run_dir={run}")[0] == 0
    shutil.copytree(run, clean)
    victim = max((run / "checkpoints/6/state").rglob("d/*"), key=lambda p: p.stat().st_size)
    flip_bits(victim)

    code, out, _ = run_cli(capsys, "ckpt", "--verify", str(clean))
    assert code == 0 and "step 6: intact" in out and "step 4: intact" in out, out
    code, out, _ = run_cli(capsys, "ckpt", "--verify", str(run))
    assert code == 1 and "step 4: intact" in out, out
    assert "step 6: damaged: checksum mismatch in array " in out, out

    code, out, err = run_cli(capsys, *TRAIN, "train.steps=8", f"run_dir={run}")
    said = out + err
    assert code == 0, said
    assert "checkpoint step 6 is unusable (checksum mismatch in array " in said
    assert "resuming from checkpoint step 4" in said
    assert "checksum mismatch in array" in (run / "checkpoints/unusable/6/UNUSABLE.txt").read_text()
    assert [s.step for s in listing.scan(str(run / "checkpoints")) if s.state == "committed"] == [4, 6, 8]
    before = losses(clean)
    assert {s: losses(run)[s] for s in (5, 6)} == {s: before[s] for s in (5, 6)}  # redone exactly

    (clean / "checkpoints/6" / integrity.FILE).unlink()  # as a step written before checksums existed
    code, out, _ = run_cli(capsys, "ckpt", "--verify", str(clean))
    assert code == 0 and "step 6: no checksums" in out, out
    code, out, err = run_cli(capsys, *TRAIN, "train.steps=8", f"run_dir={clean}")
    assert code == 0 and "resuming from checkpoint step 6" in out + err and "has no checksums" in out + err
    assert {s: losses(clean)[s] for s in (7, 8)} == {s: losses(run)[s] for s in (7, 8)}  # exact resume


def test_an_edited_dtype_in_the_array_metadata_is_caught(cfg_factory, tmp_path):
    """A step whose stored zarr metadata says float16 (its bytes are float32) never restores as numbers."""
    import tensorstore as ts
    from test_manager import checkpointer, program, save_steps
    prog = program(cfg_factory)
    save_steps(prog, [1, 2])
    step_dir = Path(prog.cfg.checkpoint_dir()) / "2"
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{step_dir}/state/"}).result()
    key = b"params.embedding_vd/.zarray"
    zarray = json.loads(kv.read(key).result().value)
    kv.write(key, json.dumps({**zarray, "dtype": "<f2"}).encode()).result()
    with pytest.raises(integrity.Damaged, match="checksum mismatch in array params/embedding_vd$"):
        integrity.verify(step_dir)
    said = []
    ckpt = checkpointer(prog)
    _, meta = ckpt.restore_latest(say=said.append)
    ckpt.close()
    assert meta["step"] == 1 and "checkpoint step 2 is unusable (checksum mismatch in array params/embedding_vd)" in \
        said[0], said


class Persistent:
    """Stands in for manager.Checkpointer: its newest step is 2."""

    def latest_step(self):
        return 2

    def restore_latest(self, say):
        return "persistent state", {"step": 2}


def local_tier(cfg):
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    shardings = {"w": jax.NamedSharding(mesh, jax.P("a", None)), "v": jax.NamedSharding(mesh, jax.P(None, "b"))}
    state = jax.device_put({"w": jnp.arange(2400.0).reshape(80, 30), "v": jnp.ones((3, 4), jnp.bfloat16)}, shardings)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
    return local.LocalTier(cfg, abstract), state


def test_flipped_bits_in_a_local_step_are_found_set_aside_and_skipped(cfg_factory, tmp_path):
    cfg = cfg_factory(f"checkpoint.local.directory={tmp_path / 'local'}", "checkpoint.local.every_steps=2")
    Path(cfg.run_dir).mkdir()
    (Path(cfg.run_dir) / "config.yaml").write_text(config.dump(cfg))
    tier, state = local_tier(cfg)
    tier.save(4, state, {"step": 4})
    tier.wait()
    assert listing.verify_main(cfg.run_dir) == 0
    largest = max((tier.dir / "4").glob("*.npy"), key=lambda p: p.stat().st_size)
    flip_bits(largest, skip=128)  # past the .npy header

    with pytest.raises(integrity.Damaged, match=f"checksum mismatch in {largest.name}"):
        integrity.verify_local(tier.dir / "4")
    assert listing.verify_main(cfg.run_dir) == 1
    said = []
    assert local.restore_newest(Persistent(), tier, say=said.append)[2] == "persistent"
    assert said == [f"local checkpoint step 4 is unusable (checksum mismatch in w ({largest.name}); moved it to "
                    f"{tier.dir}/unusable/4); trying an older step"]
    assert (tier.dir / "unusable/4" / largest.name).exists() and tier.steps() == []
    tier.close()


def test_a_local_directory_belongs_to_one_run(cfg_factory, capsys, tmp_path):
    shared = tmp_path / "local"
    first = cfg_factory(f"checkpoint.local.directory={shared}", "checkpoint.local.every_steps=1")
    Path(first.run_dir).mkdir()
    local_tier(first)[0].close()
    assert (shared / local.OWNER_FILE).read_text().strip() == str(Path(first.run_dir).resolve())
    second = tmp_path / "second"
    code, _, err = run_cli(capsys, *TRAIN, f"run_dir={second}", f"checkpoint.local.directory={shared}",
                           "checkpoint.local.every_steps=1")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"checkpoint.local.directory={shared} is the local tier of the run {Path(first.run_dir).resolve()}" in err
    assert not (second / "config.yaml").exists() and not (second / "metrics.jsonl").exists()
    shutil.rmtree(first.run_dir)  # a run that is gone no longer holds its directory
    local.owner_conflict(config.load(None, [f"run_dir={second}", f"checkpoint.local.directory={shared}"]))


def test_a_failing_local_tier_warns_once(cfg_factory, capsys, monkeypatch, tmp_path):
    cfg = cfg_factory(f"checkpoint.local.directory={tmp_path / 'local'}", "checkpoint.local.every_steps=1")
    tier, state = local_tier(cfg)
    monkeypatch.setattr(np, "save", lambda *a, **k: (_ for _ in ()).throw(OSError(30, "Read-only file system")))
    for step in (1, 2, 3):
        tier.save(step, state, {"step": step})
    tier.close()
    err = capsys.readouterr().err
    assert err.count("warning: a local checkpoint save") == 1 and "Read-only file system" in err, err
    assert tier.failed_saves == 3


@pytest.mark.parametrize("override, message", [
    ("checkpoint.max_to_keep=0", "checkpoint.max_to_keep: must be >= 1, got 0"),
    ("checkpoint.max_to_keep=-1", "checkpoint.max_to_keep: must be >= 1, got -1"),
    ("checkpoint.keep_period=0", "checkpoint.keep_period: must be >= 1, got 0"),
    ("checkpoint.local.max_to_keep=0", "checkpoint.local.max_to_keep: must be >= 1, got 0"),
    ("checkpoint.init_from=/nonexistent", "checkpoint.init_from: '/nonexistent' does not exist"),
])
def test_checkpoint_options_that_would_lose_work_stop_before_anything_is_written(capsys, tmp_path, override, message):
    code, _, err = run_cli(capsys, *TRAIN, "train.steps=3", override, f"run_dir={tmp_path / 'run'}")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert message in err, err
    assert not (tmp_path / "run").exists()
