"""`shardtrain plan --search` (plan/search.py): every factorisation once, the expert and context
axes where the model allows them, pruning, the ranked table, the written config, the no-fit hints."""

import json
import math
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from conftest import TINY
from shardtrain import chips, config, step
from shardtrain.parallel import mesh as mesh_lib
from shardtrain.plan import analytic, planner, search, tune


def mlp_cfg(data, fsdp, tensor):
    return config.load(None, [*TINY, "model.name=mlp", f"mesh.data={data}", f"mesh.fsdp={fsdp}",
                              f"mesh.tensor={tensor}"])


def test_factorisations_are_complete_and_unique():
    meshes = search.factorisations(8)
    keys = [tuple(m[a] for a in config.MESH_AXES) for m in meshes]
    assert len(keys) == len(set(keys)) == 20  # ordered factorisations of 2^3 into 4 factors: C(6, 3)
    assert all(math.prod(k) == 8 for k in keys)
    with_experts = search.factorisations(8, search.BASE_AXES + ("expert",))
    assert len(with_experts) == 35 and sum(m["expert"] > 1 for m in with_experts) == 15  # C(7, 4); 35 - 20


def test_search_offers_expert_and_context_axes_only_where_the_model_allows():
    dense = config.load(None, ["data.seq_len=128"])
    assert search.search_axes(dense) == search.BASE_AXES
    moe = config.load(None, ["model.moe.n_experts=4", "data.seq_len=4096"])
    assert search.search_axes(moe) == (*search.BASE_AXES, "expert", "context")
    sizes = [m for m in search.factorisations(8, search.search_axes(moe)) if search.allowed(moe, m)]
    assert {m["expert"] for m in sizes} == {1, 2, 4} and {m["context"] for m in sizes} == {1, 2, 4}


def test_model_that_fits_nowhere_says_how_many_devices_would_do():
    cfg = mlp_cfg(1, 1, 1)
    with pytest.raises(config.ConfigError, match=r"would fit on about (\d+) devices \(--devices \1\)"):
        search.search(cfg, jax.devices(), planner.pick_chip("v5e", jax.devices(), memory_limit=1000))


@pytest.mark.slow
def test_search_ranks_every_factorisation_once_and_its_top_row_trains(tmp_path):
    cfg = config.load(None, [*TINY, "model.name=mlp", f"run_dir={tmp_path / 'run'}"])
    # per-device totals of this MLP are 150-250 KB with fsdp x tensor >= 4, more with data >= 4; data=8
    # holds the whole state (295 KB) and is pruned before compiling
    limit = 250_000
    result = search.search(cfg, jax.devices(), planner.pick_chip("cpu", jax.devices(), memory_limit=limit),
                           schedules=())  # the configured schedule only: the next test tries the others
    seen = [(tuple(r["mesh"][a] for a in config.MESH_AXES), r["microbatches"], r["schedule"]) for r in result["rows"]]
    seen += [(tuple(r["mesh"][a] for a in config.MESH_AXES), None, None) for r in result["rejected"]]
    assert len(seen) == len(set(seen))
    assert {s[0] for s in seen} == {tuple(m[a] for a in config.MESH_AXES) for m in search.factorisations(8)}
    plain = [r for r in result["rows"] if r["mesh"]["pipeline"] == 1]
    assert len(plain) == 10  # every pipeline=1 factorisation is valid for this MLP
    assert [r["status"] for r in plain if r["mesh"]["data"] == 8] == ["no fit (state)"]
    assert {tuple(r["mesh"].values()) for r in result["rejected"]} == {  # 2 layers: pipeline <= 2
        tuple(m.values()) for m in search.factorisations(8) if m["pipeline"] > 2}
    fits = [r["report"]["fits"] for r in result["rows"] if r["report"]]
    assert fits == sorted(fits, reverse=True) and True in fits and False in fits
    # the analytical model picks which to compile: those predicted to fit first, each by predicted step
    order = sorted((r for r in result["rows"] if r["predicted_step_s"] is not None),
                   key=lambda r: (r["predicted_bytes"] > analytic.FITS_WITH_ROOM * limit, r["predicted_bytes"] > limit,
                                  r["predicted_step_s"]))
    assert [r["report"] is not None for r in order] == [True] * search.MESHES_COMPILED + [False] * (
        len(order) - search.MESHES_COMPILED)
    assert all(r["status"].startswith("pruned: predicted") for r in order[search.MESHES_COMPILED:])
    for r in result["rows"]:
        if r["report"]:
            assert r["report"]["fits"] == (r["report"]["memory_per_device_bytes"]["total"] <= limit)
    out = tmp_path / "best.yaml"
    search.write_best(cfg, result, str(out))
    best = config.load(str(out))
    top = result["rows"][0]["mesh"]
    assert {a: getattr(best.mesh, a) for a in config.MESH_AXES} == top and best.name == "best"
    run = subprocess.run([sys.executable, "-m", "shardtrain.cli", "train", str(out), f"run_dir={tmp_path / 'best'}",
                          "train.steps=2", "checkpoint.every_steps=2"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "best" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]


@pytest.mark.slow
def test_search_tries_each_pipeline_schedule_at_each_micro_batch_count():
    """A pipeline mesh is planned under the configured schedule (gpipe), 1f1b and zero_bubble at each
    micro-batch count; the compiled 1f1b program holds fewer activations than gpipe's at M = 8 (2 of 8
    micro-batches live), and a row's config carries its schedule and M."""
    cfg = config.load(None, [*TINY, "model.name=mlp", "train.global_batch_size=16"])
    rows = search.search(cfg, *planner.target(cfg, 2, chip="cpu"), meshes=0)["rows"]  # 0: compile every one
    piped = {(r["schedule"], r["microbatches"]): r for r in rows if r["mesh"]["pipeline"] == 2}
    assert set(piped) == {(s, m) for s in ("gpipe", "1f1b", "zero_bubble") for m in (4, 8)}
    assert all(r["schedule"] is None for r in rows if r["mesh"]["pipeline"] == 1)
    temp = {k: r["report"]["memory_per_device_bytes"]["temp"] for k, r in piped.items()}
    assert temp[("1f1b", 8)] < 0.5 * temp[("gpipe", 8)] and temp[("1f1b", 8)] < temp[("1f1b", 4)], temp
    chosen = search.config_of(cfg, piped[("zero_bubble", 8)])
    assert (chosen.train.pipeline.schedule, chosen.train.pipeline.microbatches, chosen.mesh.pipeline) == (
        "zero_bubble", 8, 2)
    assert "1x2x1x1 zero_bubble M=8" in search.format_table({"rows": rows, "rejected": [], "devices": 2,
                                                             "chip": "cpu", "memory_limit_bytes": 1})


@pytest.mark.slow
def test_search_entry_point_prints_the_ranking_and_writes_the_top_row(tmp_path, capsys):
    cfg = config.load(None, [*TINY, "model.name=mlp", f"run_dir={tmp_path / 'run'}"])
    out = tmp_path / "best.yaml"
    assert search.main(cfg, *planner.target(cfg, 2, chip="cpu"), as_json=True, write=str(out)) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["devices"] == 2 and result["chip"] == "cpu"
    meshes = {tuple(r["mesh"][a] for a in config.MESH_AXES) for r in result["rows"]}
    assert meshes == {tuple(m[a] for a in config.MESH_AXES) for m in search.factorisations(2)}
    best = config.load(str(out))
    assert {a: getattr(best.mesh, a) for a in config.MESH_AXES} == result["rows"][0]["mesh"]


@pytest.mark.slow
def test_search_across_slices_tries_each_split_of_the_slices(tmp_path, capsys):
    # two granules (mesh.dcn) of one device each: the slices split over data, pipeline or fsdp
    cfg = config.load(None, [*TINY, "model.name=mlp", "mesh.dcn.data=2", f"run_dir={tmp_path / 'run'}"])
    out = tmp_path / "best.yaml"
    assert search.main(cfg, *planner.target(cfg, 2, chip="cpu"), as_json=True, write=str(out)) == 0
    result = json.loads(capsys.readouterr().out)
    tried = [r["dcn"] for r in result["rows"]] + [r["dcn"] for r in result["rejected"]]
    assert {tuple(d[a] for a in ("data", "pipeline", "fsdp")) for d in tried} == {(1, 1, 2), (1, 2, 1), (2, 1, 1)}
    assert all(r["mesh"] == dict.fromkeys(config.MESH_AXES, 1) for r in result["rows"])  # one device per slice
    best = config.load(str(out))
    assert {a: getattr(best.mesh.dcn, a) for a in config.MESH_AXES} == result["rows"][0]["dcn"]
    assert "dcn" in search.format_table(result)


@pytest.mark.slow
def test_analytical_model_orders_meshes_as_their_compiled_communication_does():
    """The model `--search` prunes by: its communication time is within 2x of the compiled program's
    collectives (plan's count) on FSDP, data, tensor and mixed meshes, and exact for data parallelism
    alone (one all-reduce of every gradient)."""
    predicted, compiled = [], []
    for data, fsdp, tensor in ((1, 8, 1), (8, 1, 1), (1, 4, 2), (2, 2, 2)):
        cfg = config.load(None, [*TINY, f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}"])
        devices, chip = planner.target(cfg, 8, chip="cpu")
        compiled.append(planner.plan_one(cfg, devices, chip)["estimate"]["comm_s"])
        prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices))
        predicted.append(analytic.predict(prog, planner.per_device(chip, 8))["comm_s"])
    assert all(1 / 2 < p / c < 2 for p, c in zip(predicted, compiled)), (predicted, compiled)
    assert predicted[1] == pytest.approx(compiled[1], rel=1e-3), (predicted, compiled)


def test_gpu_nodes_also_split_an_moes_experts_where_tpu_slices_do_not():
    """Expert parallelism crosses GPU nodes (over InfiniBand), never TPU slices."""
    moe = config.load(None, [*TINY, "model.moe.n_experts=4", "model.moe.experts_per_token=2"])
    nodes = [types.SimpleNamespace(platform="gpu", process_index=i // 8) for i in range(16)]
    slices = [types.SimpleNamespace(platform="tpu", slice_index=i // 8) for i in range(16)]
    assert {tuple(d.values()) for d in search.dcn_placements(moe, nodes)} == {
        tuple(d.values()) for d in search.factorisations(2, search.DCN_AXES + ("expert",))}
    assert all(d["expert"] == 1 for d in search.dcn_placements(moe, slices))
    dense = config.load(None, TINY)
    assert all(d["expert"] == 1 for d in search.dcn_placements(dense, nodes))


def test_search_table_lists_each_rejected_mesh_with_its_reason():
    row = {"mesh": {"data": 8, "pipeline": 1, "fsdp": 1, "tensor": 1}, "microbatches": None, "status": "no fit (state)",
           "state_bytes_per_device": 2 ** 20, "report": None}
    rejected = [{"mesh": {"data": 1, "pipeline": 8, "fsdp": 1, "tensor": 1},
                 "reason": "model.n_layers=2 is not a multiple of 8 stages"},
                {"mesh": {"data": 1, "pipeline": 1, "fsdp": 1, "tensor": 8},
                 "reason": "kv_heads of size 4 is not divisible by tensor = 8"}]
    table = search.format_table({"devices": 8, "chip": "cpu", "memory_limit_bytes": 2 ** 30, "rows": [row],
                                 "rejected": rejected}).splitlines()
    assert "2 factorisations rejected" in table[0]
    assert table[-2].split() == ["1x8x1x1", "model.n_layers=2", "is", "not", "a", "multiple", "of", "8", "stages"]
    assert table[-1].startswith("     1x1x1x8") and table[-1].endswith("not divisible by tensor = 8")


@pytest.mark.parametrize("activations, hint", [(2 ** 20, "train.global_batch_size <= about 16"),
                                               (2 ** 30, "even one sequence per device does not fit")])
def test_no_fit_hint_never_suggests_a_batch_below_one_row_per_device(activations, hint):
    cfg = mlp_cfg(2, 2, 2)  # global batch 8 (TINY)
    params, opt = 2 ** 20, 2 ** 21
    limit = params + opt + 2 * 2 ** 20  # room for twice the activations of the first case
    report = {"fits": False, "memory_per_device_bytes": {"total": params + opt + activations, "params": params,
                                                          "optimizer": opt}}
    row = search.Row({"data": 2, "pipeline": 1, "fsdp": 2, "tensor": 2}, None, "ranked", report, params + opt)
    message = search.no_fit_message(cfg, [row], 8, limit, chips.CHIPS["v5e"])
    assert hint in message and "about 0" not in message


@pytest.mark.slow  # 5 CPU compiles and a 2-step run
def test_search_tunes_remat_offload_and_accumulation_until_the_fastest_fits_and_its_config_trains(tmp_path, capsys):
    """One device whose memory is 90% of what the config's own knobs (remat none, no offload, no
    accumulation) need: the ranking finds no fitting mesh, the tuning does; the chosen config is the
    fastest fitting candidate compiled, every other is compiled, pruned by what its reason says, or
    past the budget; the written config plans to the same step and trains."""
    cfg = config.load(None, [*TINY, "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", f"run_dir={tmp_path / 'run'}"])
    one = jax.devices()[:1]
    own = planner.plan_one(cfg, one, planner.pick_chip("cpu", one))["memory_per_device_bytes"]["total"]
    devices, chip = planner.target(cfg, 1, chip="cpu", memory_limit=0.9 * own)
    out = tmp_path / "best.yaml"
    assert tune.main(cfg, devices, chip, as_json=True, write=str(out), budget=4) == 0
    result = json.loads(capsys.readouterr().out)
    assert not result["rows"][0]["report"]["fits"]
    tried, chosen = result["tuning"]["candidates"], result["chosen"]
    fitting = [c for c in tried if c["status"] == "compiled" and c["fits"]]
    assert fitting and chosen["step_time_s"] == min(c["step_time_s"] for c in fitting) and chosen["fits"]
    assert (chosen["remat"], chosen["offload"], chosen["accum"]) != ("none", False, 1)
    assert 1 < result["tuning"]["compiles"] <= 4
    for c in tried:
        if c["status"].startswith("pruned: predicted step"):
            assert c["predicted_step_s"] >= chosen["step_time_s"]
        elif c["status"].startswith("pruned: predicted"):
            assert c["predicted_bytes"] > 0.9 * own
    written = config.load(str(out))
    assert (written.train.remat, written.train.offload.optimizer, written.train.grad_accum_steps) == (
        chosen["remat"], chosen["offload"], chosen["accum"])
    replan = planner.plan_one(written, devices, chip)
    assert replan["fits"] and replan["estimate"]["step_time_s"] == chosen["step_time_s"]
    prog = step.build(written, mesh_lib.make_mesh(written.mesh, one))  # trains on the one device
    state, tokens = prog.init(0), jax.device_put(np.zeros(prog.batch_shape(), np.int32), prog.batch_sharding)
    for _ in range(2):
        state, metrics = prog.step(state, tokens)
        assert math.isfinite(float(metrics["loss"]))
