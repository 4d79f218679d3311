"""`shardtrain plan` with the real TPU compiler (libtpu, compile-only devices of a v5e:2x2 slice):
per-chip argument bytes against the analytical shard bytes, the TPU's collectives, the config's
`hardware` section, and the bound on MFU."""

import functools
import glob
import json
import subprocess
import sys
import threading

import jax
import pytest

from conftest import cli_env
from fit_memo import COMPILED_TARGETS, compiled_figures
from shardtrain import chips, cli, config, step
from shardtrain.parallel import mesh as mesh_lib, sharding
from shardtrain.plan import hlo, planner, topology

# An MLP whose sharded dimensions are 4 x 128 (TPU arrays are tiled by 8 x 128: with smaller
# dimensions the compiler pads them and the bytes are the padded ones), one layer, rows of 128 tokens.
D = 512
TPU_SMALL = ["model.name=mlp", "model.n_layers=1", f"model.d_model={D}", f"model.d_ff={D}", f"model.vocab_size={D}",
             "data.seq_len=127", "train.global_batch_size=32", "data.source=synthetic"]
PARAM_BYTES = 4 * D * D * 4  # embedding, w_in, w_out, unembed; float32
MESHES = {"data": (4, 1, 1), "fsdp": (1, 4, 1), "tensor": (1, 1, 4)}
HARDWARE = ["hardware.chip=v5e", "hardware.topology=2x2"]


def tpu_cfg(mesh_name, *extra):
    d, f, t = MESHES[mesh_name]
    return config.load(None, [*TPU_SMALL, *HARDWARE, f"mesh.data={d}", f"mesh.fsdp={f}", f"mesh.tensor={t}", *extra])


@functools.cache
def planned(mesh_name: str) -> dict:
    cfg = tpu_cfg(mesh_name)
    return planner.plan_one(cfg, list(topology.devices(chips.CHIPS["v5e"], "2x2")), chips.CHIPS["v5e"])


def test_config_hardware_plans_on_the_tpu_compiler_without_flags(capsys):
    cfg = tpu_cfg("fsdp")
    assert planner.main(cfg, *planner.target(cfg, 8), as_json=True) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["compiler"] == "tpu" and r["chip"] == "v5e" and r["devices"] == 4
    assert r["estimate"]["chip"] == "v5e" and r["memory_limit_bytes"] == 16 * 2 ** 30
    assert r["memory_per_device_bytes"] == planned("fsdp")["memory_per_device_bytes"]
    assert r["compile_s"] > 0 and r["fits"]


def test_tpu_argument_bytes_are_the_analytical_shard_bytes():
    args = {name: planned(name)["compiled_memory_bytes"]["arguments"] for name in MESHES}
    batch = {name: planned(name)["memory_per_device_bytes"]["batch"] for name in MESHES}
    state = 3 * PARAM_BYTES  # parameters and AdamW's two moments
    assert batch == {"data": 8 * 128 * 4, "fsdp": 8 * 128 * 4, "tensor": 32 * 128 * 4}
    # data holds the whole state, fsdp and tensor a quarter of it: the differences are exact
    assert args["data"] - args["fsdp"] == state - state // 4
    assert args["tensor"] - args["fsdp"] == batch["tensor"] - batch["fsdp"]
    # and the rest is the three int32 counters (step, Adam's and the schedule's), each one tile
    for name in MESHES:
        m = planned(name)["memory_per_device_bytes"]
        assert m["params"] == PARAM_BYTES // (1 if name == "data" else 4)
        assert 0 < args[name] - 3 * m["params"] - m["batch"] <= 4 * 512


def test_tpu_program_keeps_the_offloaded_optimizer_state_in_host_memory():
    """train.offload.optimizer on the TPU compiler: AdamW's two moments leave the device's arguments
    for the host's (the compiler's own figures, exact up to the counters' tiles), the plan reports them
    apart, and its step adds their trip in and out over the host link."""
    cfg = tpu_cfg("fsdp", "train.offload.optimizer=true")
    r = planner.plan_one(cfg, list(topology.devices(chips.CHIPS["v5e"], "2x2")), chips.CHIPS["v5e"])
    plain, moments = planned("fsdp"), 2 * PARAM_BYTES // 4
    host = r["compiled_memory_bytes"]["host_arguments"]
    assert 0 <= host - moments <= 2 * 512 and plain["compiled_memory_bytes"]["host_arguments"] == 0
    assert plain["compiled_memory_bytes"]["arguments"] - r["compiled_memory_bytes"]["arguments"] == host
    assert r["memory_per_device_bytes"]["params"] == plain["memory_per_device_bytes"]["params"]
    assert r["host_memory_per_device_bytes"]["optimizer"] - moments <= 2 * 512
    assert r["host_link_bytes_per_step"] == 2 * r["host_memory_per_device_bytes"]["total"]
    link_s = r["host_link_bytes_per_step"] / chips.CHIPS["v5e"].host_bandwidth
    assert r["estimate"]["host_link_s"] == pytest.approx(link_s)
    assert r["estimate"]["step_time_s"] >= max(r["estimate"]["compute_s"], r["estimate"]["memory_s"]) + link_s


@pytest.mark.slow  # two compiles of a 16-layer model, about 30 s
def test_tpu_program_frees_the_device_of_the_offloaded_optimizer_state():
    """Streamed through the device a layer at a time after the backward pass (offload.py), the
    offloaded moments leave the TPU program's device total: it drops by (nearly) their bytes. Brought
    in whole, the compiler copies them in at the program's start and the total does not drop."""
    devices, deep = list(topology.devices(chips.CHIPS["v5e"], "2x2")), ["model.n_layers=16"]
    plain, off = (planner.plan_one(tpu_cfg("fsdp", *deep, *extra), devices, chips.CHIPS["v5e"])
                  for extra in ([], ["train.offload.optimizer=true"]))
    state = off["host_memory_per_device_bytes"]["optimizer"]
    assert state >= 2 * (16 * 2 + 2) * D * D * 4 // 4  # AdamW's two moments of every weight, a quarter each
    assert plain["memory_per_device_bytes"]["total"] - off["memory_per_device_bytes"]["total"] >= 0.8 * state
    assert off["compiled_memory_bytes"]["host_arguments"] >= state


def test_tpu_fsdp_gathers_weights_and_reduce_scatters_gradients():
    c = planned("fsdp")["collectives"]
    assert {a for row in c.values() for a in row["axes"]} == {"fsdp"}
    assert c["reduce-scatter"]["bytes"] == PARAM_BYTES  # every gradient, reduced and scattered (bf16 nowhere)
    # each weight gathered whole, in bf16 (the embedding table in f32, before its lookup), and again
    # in the backward unless kept (each async gather counted once, not per start / done fusion)
    assert PARAM_BYTES // 2 <= c["all-gather"]["bytes"] <= PARAM_BYTES
    assert c.get("all-reduce", {"bytes": 0})["bytes"] <= 64  # only the loss and metric scalars
    d = planned("data")["collectives"]
    assert set(d) == {"all-reduce"} and PARAM_BYTES <= d["all-reduce"]["bytes"] <= PARAM_BYTES + 64


def test_tpu_plan_bypasses_the_persistent_compilation_cache_a_run_switched_on(tmp_path, monkeypatch):
    """A topology's compile-only client cannot read cache entries back: planning twice in a process
    whose compilation cache is on (as `train` turns it on) must not try to."""
    from jax.experimental.compilation_cache import compilation_cache

    from shardtrain import cli
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = tpu_cfg("fsdp")
    cli.enable_compile_cache(cfg)
    try:
        devices = list(topology.devices(chips.CHIPS["v5e"], "2x2"))
        first, again = (planner.plan_one(cfg, devices, chips.CHIPS["v5e"]) for _ in range(2))
        assert first["memory_per_device_bytes"] == again["memory_per_device_bytes"]
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()


def test_parallel_tpu_plans_keep_the_compilation_cache_off_until_the_last_one_ends(monkeypatch):
    """Two plans compiling at once from two threads (as `search`'s pool compiles): A enters its
    compile first, B while A compiles; A finishes, then B compiles. While B compiles the cache must
    still be off (a topology's compile-only client cannot read it), and afterwards it is as before."""
    memory = planned("fsdp")["memory_per_device_bytes"]  # planned alone, before the threads
    devices = list(topology.devices(chips.CHIPS["v5e"], "2x2"))
    lowered_compile, compile_fast = jax.stages.Lowered.compile, planner.compile_fast
    a_compiling, b_compiling, a_done = threading.Event(), threading.Event(), threading.Event()
    cache_on_while_compiling = {}

    def compile_in_turn(self, *args, **kwargs):
        me = threading.current_thread().name
        (a_compiling if me == "A" else b_compiling).set()
        assert (b_compiling if me == "A" else a_done).wait(timeout=600), f"plan {me} waited in vain"
        cache_on_while_compiling[me] = jax.config.jax_enable_compilation_cache
        return lowered_compile(self, *args, **kwargs)

    def compile_fast_in_turn(lowered, platform):
        if threading.current_thread().name == "B":
            assert a_compiling.wait(timeout=600), "plan A never compiled"
        try:
            return compile_fast(lowered, platform)
        finally:
            if threading.current_thread().name == "A":
                a_done.set()

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_in_turn)
    monkeypatch.setattr(planner, "compile_fast", compile_fast_in_turn)
    results, errors = {}, []

    def plan(name):
        try:
            results[name] = planner.plan_one(tpu_cfg("fsdp"), devices, chips.CHIPS["v5e"])
        except Exception as e:  # reported by the main thread below
            errors.append(e)

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", True)
    try:
        threads = [threading.Thread(target=plan, args=(name,), name=name) for name in "AB"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=900)
        assert not errors, errors
        assert cache_on_while_compiling == {"A": False, "B": False}
        assert jax.config.jax_enable_compilation_cache is True
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
    assert results["A"]["memory_per_device_bytes"] == results["B"]["memory_per_device_bytes"] == memory


def test_tpu_estimate_is_within_the_chip():
    for name in MESHES:
        e = planned(name)["estimate"]
        assert 0 < e["mfu"] <= 1 and e["chip"] == "v5e"
        assert e["tpu_cost_model_step_s"] is None or e["tpu_cost_model_step_s"] > 0


def test_one_slice_over_several_hosts_is_one_slice():
    # v5p 2x2x2: 8 chips on 2 hosts of one slice (a compile-only topology's devices have no
    # slice_index): no axis is costed as DCN and the report does not call the hosts slices
    cfg = config.load(None, ["mesh.data=2", "mesh.fsdp=4", "mesh.tensor=1", "mesh.dcn.data=1"])
    devices = list(topology.devices(chips.CHIPS["v5p"], "2x2x2"))
    assert len({d.process_index for d in devices}) == 2
    mesh = mesh_lib.make_mesh(cfg.mesh, devices)
    assert mesh_lib.cross_granule_axes(mesh) == set()
    assert planner.topology_name(mesh) == "TPU v5, 8 chips"


def test_multi_slice_plan_counts_the_reduction_across_slices():
    """Two v5p 2x2x1 slices, fsdp=4 inside each, data=2 across them over DCN: the gradient shards
    (a quarter of every gradient per chip) are reduced across the slices once per step."""
    cfg = config.load(None, [*TPU_SMALL, "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=1", "mesh.dcn.data=2",
                             "hardware.chip=v5p", "hardware.topology=2x2x1", "hardware.slices=2"])
    r = planner.plan_one(cfg, list(topology.devices(chips.CHIPS["v5p"], "2x2x1", 2)), chips.CHIPS["v5p"])
    assert r["devices"] == 8 and "2 slices" in r["topology"]
    across = r["collectives"]["all-reduce"]
    assert "data" in across["axes"]
    assert PARAM_BYTES // 4 <= across["bytes"] <= PARAM_BYTES // 4 + 64 * 1024  # + the loss and metric scalars
    assert r["collectives"]["reduce-scatter"]["bytes"] == PARAM_BYTES and r["estimate"]["comm_s"] > 0


SHIPPED = sorted(glob.glob("meshes/*.yaml"))
FULL_REMAT = [p for p in SHIPPED if config.load(p).hardware.chip and config.load(p).train.remat == "full"]
"""The large configs: planned at 2 layers, what depth adds counted exactly (a full compile takes minutes)."""


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in SHIPPED if p not in FULL_REMAT])
def test_every_shipped_config_fits_the_hardware_it_names(path):
    """`shardtrain plan CONFIG`, no flags, at full depth: GPU configs through XLA:GPU (compile-only),
    demo on cpu."""
    env = cli_env()  # the CLI sets the mesh's device count
    out = subprocess.run([sys.executable, "-m", "shardtrain.cli", "plan", path, "--json"], env=env,
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    chip = config.load(path).hardware.chip or "cpu"
    assert r["chip"] == chip and r["compiler"] == ("gpu" if chips.CHIPS[chip].gpu else "cpu")
    assert r["fits"], f"{path}: {r['memory_per_device_bytes']['total'] / 2 ** 30:.2f} GiB per device"
    assert 0 < r["estimate"]["mfu"] <= 1


@pytest.mark.slow
@pytest.mark.parametrize("path", FULL_REMAT)
def test_every_large_shipped_config_fits_its_topology(path):
    """The config's own compiler (TPU, or XLA:GPU compile-only) on its own topology, at 2 layers (a
    full compile takes minutes; the acceptance scripts and `shardtrain plan CONFIG` compile all of
    them): what depth adds per chip is the state of the other layers (exact, from the abstract state)
    and, with train.remat=full, each layer's saved bf16 input; both are added before comparing with
    the device's memory."""
    cfg = config.load(path)
    dense = ["model.moe.first_dense_layers=1"] if cfg.model.moe.first_dense_layers > 1 else []  # DeepSeek-V3's 3
    short = config.load(path, ["model.n_layers=2", *dense])
    devices, chip = planner.target(cfg, cli.mesh_devices(cfg))
    assert cfg.train.compute_dtype == "bfloat16"
    mesh = mesh_lib.make_mesh(cfg.mesh, devices)
    progs = {c.model.n_layers: step.build(c, mesh) for c in (cfg, short)}
    r = compiled_figures(path, progs[2], chip)
    assert r["compiler"] == ("gpu" if chip.gpu else "tpu")
    state = {n: sharding.shard_bytes(p.abstract_state) for n, p in progs.items()}
    rows = progs[2].batch_sharding.shard_shape(progs[2].batch_shape())[0] // cfg.train.grad_accum_steps
    saved = (cfg.model.n_layers - 2) * rows * cfg.data.seq_len * cfg.model.d_model * 2
    total = r["total"] + state[cfg.model.n_layers] - state[2] + saved
    limit = planner.per_device(chip, len(devices)).hbm_bytes  # TPU7x: half a chip per device
    assert total <= limit, f"{path}: about {total / 2 ** 30:.2f} GiB per device of {limit / 2 ** 30:.0f}"
    assert 0 < r["mfu"] <= 1


MOE_TARGETS = {  # (most compiled FLOPs / the model's, least roofline MFU, most GiB per device)
    "meshes/mixtral_8x7b_gpu_32.yaml": (1.45, 0.40, None),
    "meshes/deepseek_v2_lite_v5p_64.yaml": (None, 0.30, 35),
    "meshes/deepseek_v3_v5p_512.yaml": (None, None, None),
    "meshes/deepseek_v3_h100_256.yaml": (None, None, None),
}


@pytest.mark.slow
@pytest.mark.parametrize("path", MOE_TARGETS)
def test_moe_configs_meet_their_targets_at_full_depth(path):
    """The MoE configs' targets by plan, on their own compiler at full depth (grouped GEMM on GPUs,
    bounded dropless buffers, DeepSeek-V3 at 671B): each fits; Mixtral on 32 H100 within 1.45x the
    model's FLOPs at >= 40% MFU; DeepSeek-V2-Lite on v5p-64 in <= 35 GiB at >= 30%. A full compile
    takes 1-5 minutes here, so the figures are memoised (`compiled_figures`) like the fit checks'."""
    cfg = config.load(path)
    assert cfg.model.moe.capacity_factor is None  # dropless
    devices, chip = planner.target(cfg, cli.mesh_devices(cfg))
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices))
    r = compiled_figures(path, prog, chip, COMPILED_TARGETS)
    most_flops, least_mfu, most_gib = MOE_TARGETS[path]
    assert r["fits"] and r["compiler"] == ("gpu" if chip.gpu else "tpu"), r
    assert most_flops is None or r["flops_ratio"] <= most_flops, r
    assert least_mfu is None or r["mfu"] >= least_mfu, r
    assert most_gib is None or r["total"] <= most_gib * 2 ** 30, r


def test_tpu_flops_count_every_layer_of_the_rolled_scan():
    # the TPU compiler prints no known trip counts and writes dots as convolutions: plan reads the
    # trip counts from the loop conditions and counts the convolutions' FLOPs, so the compiled step's
    # FLOPs (cost analysis counts a loop body once) are the model's, not a quarter of them
    cfg = config.load(None, ["model.name=gpt", "model.n_layers=4", f"model.d_model={D}", f"model.d_ff={D}",
                             "model.n_heads=4", "model.n_kv_heads=4", f"model.vocab_size={D}", "model.attention=xla",
                             "data.seq_len=128", "train.global_batch_size=8", "data.source=synthetic",
                             "train.scan_unroll=1", *HARDWARE, "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=1"])
    r = planner.plan_one(cfg, list(topology.devices(chips.CHIPS["v5e"], "2x2")), chips.CHIPS["v5e"])
    assert r["loop_repeats_per_device"]["flops"] > 0
    # (loop bodies read from the text come within ~7% of cost analysis's own count: 0.96 here, 0.28 before)
    assert 0.9 <= r["flops_per_device"] * r["devices"] / r["model_flops_per_step"] <= 1.3
    assert r["collectives"]["reduce-scatter"]["count"] >= 4  # each layer's gradients, inside the loop


def test_none_has_no_int8_matmuls():
    """train.quantization=none (the default): every matmul of the TPU program is a float one."""
    by_type = planned("fsdp")["flops_by_dtype"]
    assert by_type and not any(k.startswith(("s8", "u8", "f8")) for k in by_type)


@pytest.mark.parametrize("chip,shape", [("v5e", "2x4"), ("v5p", "4x4x4")])
def test_fsdp_weight_gathers_are_all_gathers_of_the_shard(chip, shape):
    """A rolled scan of 3 layers, FSDP over the whole slice: each weight is all-gathered whole
    (bytes = the weight's), none all-reduced from a zero-padded buffer, and each layer's gradients
    leave it as one reduce-scatter. On v5p 4x4x4 (a torus) every gather was such an all-reduce
    (twice the traffic) while the topology was described without its wraparound links."""
    n = topology.chip_count(shape)
    cfg = config.load(None, ["model.name=mlp", "model.n_layers=3", "model.d_model=1024", "model.d_ff=1024",
                             "model.vocab_size=1024", "data.seq_len=127", f"train.global_batch_size={n}",
                             "data.source=synthetic", f"hardware.chip={chip}", f"hardware.topology={shape}",
                             "mesh.data=1", f"mesh.fsdp={n}", "mesh.tensor=1"])
    mesh = mesh_lib.make_mesh(cfg.mesh, list(topology.devices(chips.CHIPS[chip], shape)))
    found = hlo.collectives(planner.compile_program(step.build(cfg, mesh))[0].as_text(), dict(mesh.shape))
    weight = 1024 * 1024  # every weight here is 1024 x 1024
    gathers = [c for c in found if c.kind == "all-gather" and c.dtypes != ("s32",)]  # not the token batch
    assert {c.bytes for c in gathers} == {2 * weight}  # one whole bf16 weight each
    in_layers = [c for c in found if c.count == 3]  # inside the scan over the 3 layers
    assert 2 <= sum(c.kind == "all-gather" for c in in_layers) <= 4  # w_in, w_out: forward (+ backward)
    [grads] = [c for c in in_layers if c.kind == "reduce-scatter"]
    assert grads.bytes == 2 * 4 * weight  # both gradients of the layer, float32, in one
    assert all(c.bytes <= 64 for c in found if c.kind == "all-reduce")


def test_topology_wraparound_is_the_slices_torus():
    assert topology.wraparound("4x4x8") == (True, True, True) and topology.wraparound("2x4x4") == (False,) * 3
    assert topology.wraparound("16x16") == (True, True, False) and topology.wraparound("8x16") == (False, True, False)


def test_chunked_loss_gathers_the_unembedding_once():
    """FSDP over v5e 2x2, 4 loss chunks: the unembedding (512 x 2048, bf16) is all-gathered as
    often as with the plain loss (once for the step), not again for every chunk."""
    def head_sized_gathers(chunk):
        cfg = config.load(None, ["model.name=gpt", "model.n_layers=2", "model.d_model=512", "model.d_ff=512",
                                 "model.n_heads=4", "model.n_kv_heads=4", "model.vocab_size=2048",
                                 "model.attention=xla", "data.seq_len=512", "train.global_batch_size=8",
                                 "data.source=synthetic", f"train.loss_chunk={chunk}", *HARDWARE,
                                 "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=1"])
        mesh = mesh_lib.make_mesh(cfg.mesh, list(topology.devices(chips.CHIPS["v5e"], "2x2")))
        text = planner.compile_program(step.build(cfg, mesh))[0].as_text()
        return sum(c.count for c in hlo.collectives(text, dict(mesh.shape))
                   if c.kind == "all-gather" and c.bytes == 512 * 2048 * 2)
    chunked, plain = head_sized_gathers(128), head_sized_gathers(0)
    assert 1 <= chunked == plain <= 2  # the unembedding's gather, and the embedding table's if any


def test_tpu7x_plans_two_devices_per_chip_each_with_half_of_it():
    """TPU7x (Ironwood): libtpu shows each chip's two TensorCores as two devices; plan counts devices,
    holds each to half a chip's HBM and peak, and FSDP over 8 of them shards the state 8 ways."""
    chip, d = chips.CHIPS["tpu7x"], 2 * D  # 1024 / 8 = 128: no padding of the sharded dimension
    devices = list(topology.devices(chip, "2x2x1"))
    assert len(devices) == 8
    small = ["model.name=mlp", "model.n_layers=1", f"model.d_model={d}", f"model.d_ff={d}", f"model.vocab_size={d}",
             "data.seq_len=127", "train.global_batch_size=64", "data.source=synthetic", "hardware.chip=tpu7x",
             "hardware.topology=2x2x1", "mesh.tensor=1"]
    r = {name: planner.plan_one(config.load(None, [*small, f"mesh.data={n}", f"mesh.fsdp={8 // n}"]), devices, chip)
         for name, n in (("data", 8), ("fsdp", 1))}
    state = 3 * 4 * d * d * 4  # parameters and AdamW's two moments of four float32 matrices
    args = {name: x["compiled_memory_bytes"]["arguments"] for name, x in r.items()}
    assert args["data"] - args["fsdp"] == state - state // 8
    assert r["fsdp"]["compiler"] == "tpu" and r["fsdp"]["devices"] == 8
    assert r["fsdp"]["memory_limit_bytes"] == 96 * 2 ** 30 and "4 chips (8 devices)" in r["fsdp"]["topology"]
    assert planner.per_device(chip, 8).peak_flops == chip.peak_flops / 2


def test_a_pipeline_of_splash_attention_layers_compiles_for_the_tpu():
    """Splash's Pallas kernel inside the pipeline's shard_map: its cotangents carry no `pipeline`
    variance (jax 0.12), which shard_map's type check refused (every pipeline row of `plan --search` on a TPU)."""
    cfg = config.load(None, ["model.name=gpt", "model.n_layers=2", "model.d_model=256", "model.d_ff=512",
                             "model.n_heads=2", "model.n_kv_heads=2", "model.vocab_size=512", "model.attention=splash",
                             "data.seq_len=128", "train.global_batch_size=8", "data.source=synthetic", *HARDWARE,
                             "mesh.data=2", "mesh.pipeline=2", "mesh.fsdp=1", "mesh.tensor=1"])
    r = planner.plan_one(cfg, list(topology.devices(chips.CHIPS["v5e"], "2x2")), chips.CHIPS["v5e"])
    assert r["compiler"] == "tpu" and "pipeline" in r["collectives"]["collective-permute"]["axes"]
