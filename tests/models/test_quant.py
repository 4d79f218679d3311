"""Low-precision matmuls (models/quant.py, train.quantization): the numbers against the float
matmul within the derived bound, straight-through gradients, sharded = one device, the compiled
TPU program's s8 matmuls, the GPU's f8 GEMMs, resume across a change, and the planner's roofline."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from conftest import TINY
from models import quant
from shardtrain import chips, config, step
from shardtrain.config import ConfigError
from shardtrain.parallel import mesh as mesh_lib
from shardtrain.plan import hlo, planner, topology

SHAPES = [((16, 32), (32, 8)), ((2, 8, 64), (64, 48)), ((128, 256), (256, 24))]


def operands(x_shape, w_shape, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, x_shape), 0.05 * jax.random.normal(kw, w_shape)


def int8_bound(a, b, a_max=None, b_max=None):
    """|a @ b - dot(a, b, int8)| per output: each element rounds by at most half its scale (absmax
    / 127 along the contracted axis, or a_max / b_max where the scale spans more than a and b), so
    |a_k b_k - a'_k b'_k| <= |a_k| db + |b_k| da + da db."""
    a, b = np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
    da = (a.max(-1, keepdims=True) if a_max is None else a_max) / 127 / 2
    db = (b.max(0, keepdims=True) if b_max is None else b_max) / 127 / 2
    return a.sum(-1, keepdims=True) * db + da * b.sum(0, keepdims=True) + a.shape[-1] * da * db + 1e-6


def fp8_bound(a, b, a_max=None, b_max=None, rel_a=2.0 ** -4, rel_b=2.0 ** -4):
    """Relative rounding of each element by at most rel (e4m3: 3 mantissa bits; e5m2: 2), plus the
    smallest normal's absolute error (below it, steps are absolute), both per operand."""
    a, b = np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
    return (rel_a + rel_b + rel_a * rel_b) * (a @ b) + 1e-6


@functools.partial(jax.jit, static_argnums=3)
def forward_and_grads(x, w, g, how):
    """(y, dx, dw) of the quantized dot for the output cotangent g."""
    y, vjp = jax.vjp(lambda x, w: quant.dot(x, w, how), x, w)
    return (y, *vjp(g))


@pytest.mark.parametrize("x_shape, w_shape", SHAPES)
def test_int8_forward_and_gradients_are_within_the_rounding_bound(x_shape, w_shape):
    x, w = operands(x_shape, w_shape)
    g = jax.random.normal(jax.random.key(1), (*x_shape[:-1], w_shape[-1]))
    y, dx, dw = forward_and_grads(x, w, g, "int8")
    x2, w, g2 = (np.asarray(a, np.float64) for a in (x.reshape(-1, x.shape[-1]), w, g.reshape(-1, g.shape[-1])))
    assert np.all(np.abs(np.reshape(y, (x2.shape[0], -1)) - x2 @ w) <= int8_bound(x2, w))
    # straight-through: the gradients are the float matmul's (g @ w^T, x^T @ g) with rounded operands
    assert np.all(np.abs(np.reshape(dx, x2.shape) - g2 @ w.T) <= int8_bound(g2, w.T))
    assert np.all(np.abs(dw - x2.T @ g2) <= int8_bound(x2.T, g2))


@pytest.mark.parametrize("x_shape, w_shape", SHAPES)
def test_fp8_forward_and_gradients_are_within_the_rounding_bound(x_shape, w_shape):
    x, w = operands(x_shape, w_shape)
    g = jax.random.normal(jax.random.key(1), (*x_shape[:-1], w_shape[-1]))
    y, dx, dw = forward_and_grads(x, w, g, "fp8")
    x2, w, g2 = (np.asarray(a, np.float64) for a in (x.reshape(-1, x.shape[-1]), w, g.reshape(-1, g.shape[-1])))
    assert np.all(np.abs(np.reshape(y, (x2.shape[0], -1)) - x2 @ w) <= fp8_bound(x2, w))
    assert np.all(np.abs(np.reshape(dx, x2.shape) - g2 @ w.T) <= fp8_bound(g2, w.T, rel_a=2.0 ** -3))
    assert np.all(np.abs(dw - x2.T @ g2) <= fp8_bound(x2.T, g2, rel_b=2.0 ** -3))


def test_quantized_operands_are_int8_with_int32_accumulation_forward_and_backward():
    x, w = operands((16, 32), (32, 8))
    text = jax.jit(jax.grad(lambda x, w: (quant.dot(x, w, "int8") ** 2).sum(), argnums=(0, 1))).lower(x, w).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 3 and all(d.split("->")[0].count("xi8>") == 2 for d in dots)
    assert all(d.split("->")[-1].strip().endswith("xi32>") for d in dots)


def test_unknown_quantization_is_a_config_error():
    with pytest.raises(ConfigError, match="train.quantization"):
        config.load(None, [*TINY, "train.quantization=int4"])


SHARDED = [*TINY, "model.name=mlp", "model.d_model=64", "model.d_ff=128", "train.global_batch_size=16",
           "train.quantization=int8"]


def losses_and_grads(cfg, devices=None):
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices))
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, prog.abstract_batch().shape, dtype=np.int32)
    params = prog.init(cfg.train.seed)["params"]
    losses, grads = prog.loss_and_grads(params, jax.device_put(tokens, prog.batch_sharding))
    return float(losses["loss"]), jax.tree.map(np.asarray, grads)


def test_sharded_int8_matmul_equals_one_device_exactly():
    """Rows split (data x fsdp) and the contraction or the output split (tensor): int32 sums are
    exact and absmax scales are maxima, so the sharded quantized dot and its gradients are bitwise
    one device's."""
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    x, w = operands((256, 64), (64, 128))
    g = jax.random.normal(jax.random.key(1), (256, 128))
    one = forward_and_grads(x, w, g, "int8")
    rows = ("data", "fsdp")
    for x_spec, w_spec, g_spec in [(P(rows, "tensor"), P("tensor", None), P(rows)),
                                   (P(rows), P(None, "tensor"), P(rows, "tensor"))]:
        put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
        sharded = forward_and_grads(put(x, x_spec), put(w, w_spec), put(g, g_spec), "int8")
        assert all(np.array_equal(a, b) for a, b in zip(sharded, one))


@pytest.mark.parametrize("how", ["int8", "fp8"])
def test_row_groups_weight_gradient_is_the_sum_of_each_groups_own(how):
    """With row_groups=4 the weight gradient is the sum of the four row blocks' own quantized weight
    gradients (each with its own channel scales); the output and dx are the ungrouped ones."""
    x, w = operands((64, 32), (32, 16))
    g = jax.random.normal(jax.random.key(2), (64, 16))
    y, vjp = jax.vjp(lambda x, w: quant.dot(x, w, how, row_groups=4), x, w)
    dx, dw = vjp(g)
    whole = forward_and_grads(x, w, g, how)
    blocks = [forward_and_grads(x[i:i + 16], w, g[i:i + 16], how)[2] for i in range(0, 64, 16)]
    np.testing.assert_array_equal(y, whole[0])
    np.testing.assert_array_equal(dx, whole[1])
    np.testing.assert_allclose(dw, sum(blocks), rtol=1e-6, atol=1e-7)
    assert not np.allclose(dw, whole[2], rtol=1e-6, atol=1e-7)  # the groups' scales are their own


@pytest.mark.slow  # two TPU compiles (libtpu), about 20 s
def test_tpu_int8_reduces_weight_gradients_in_the_compute_dtype():
    """FSDP over 8 v5e chips: the int8 step's gradient reduce-scatters move as many bf16 bytes as the
    `none` step's (one int8 product per batch shard, dequantized before the reduction; the compiler
    combines them differently), and no reduction carries int32 partial sums."""
    def reductions(how):
        cfg = config.load(None, ["model.n_layers=2", "model.d_model=256", "model.n_heads=2", "model.n_kv_heads=2",
                                 "model.d_ff=512", "model.vocab_size=256", "data.seq_len=128", "mesh.data=1",
                                 "mesh.fsdp=8", "mesh.tensor=1", "train.global_batch_size=16",
                                 "train.compute_dtype=bfloat16", f"train.quantization={how}", "model.attention=xla"])
        prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh, list(topology.devices(chips.CHIPS["v5e"], "2x4"))))
        colls = hlo.collectives(planner.compile_program(prog)[0].as_text(), dict(prog.mesh.shape))
        assert not [c for c in colls if "s32" in c.dtypes and c.kind in ("reduce-scatter", "all-reduce")]
        scatters = [c for c in colls if c.kind == "reduce-scatter"]
        return sum(c.bytes * c.count for c in scatters), {d for c in scatters for d in c.dtypes}
    int8, none = reductions("int8"), reductions("none")
    assert int8 == none and none[1] == {"bf16"}


def test_sharded_int8_step_equals_one_device():
    """The whole step on 2x2x2: the loss within 1e-5. The gradients within 1e-3 of their norm
    (measured: median leaf 2e-7, worst 1.2e-4): the float parts of the program (the head's
    vocab-split softmax, reductions in another order) differ from one device's by float rounding
    (~4e-7 for the gpt, as without quantization), and round-to-nearest turns such a difference into
    a whole int8 step wherever a value sits at a rounding boundary; and the weight gradients'
    quantization groups follow the batch shards (one device: one group)."""
    loss1, grads1 = losses_and_grads(config.load(None, SHARDED), jax.devices()[:1])
    loss8, grads8 = losses_and_grads(config.load(None, [*SHARDED, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]))
    assert abs(loss8 - loss1) <= 1e-5 * abs(loss1)
    for a, b in zip(jax.tree.leaves(grads8), jax.tree.leaves(grads1)):
        assert np.linalg.norm(a - b) <= 1e-3 * np.linalg.norm(b)


@pytest.mark.slow  # two short training runs
def test_resume_switches_quantization_and_keeps_the_step_count(tmp_path):
    from shardtrain import loop
    tiny = [*TINY, "model.name=mlp", "train.compile_cache=false", "checkpoint.every_steps=2", f"run_dir={tmp_path}"]
    assert loop.train(config.load("meshes/demo.yaml", [*tiny, "train.steps=2"])) == 0
    assert loop.train(config.load("meshes/demo.yaml", [*tiny, "train.steps=4", "train.quantization=int8"])) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)


@pytest.mark.slow  # a TPU compile (libtpu), about 25 s
def test_tpu_int8_step_runs_every_block_matmul_as_s8_forward_and_backward():
    """One MoE layer with a shared expert, 8 experts split 4 ways, compiled for v5e:2x2: its 10 block
    weights (4 attention projections, 3 experts' grouped matmuls, 3 shared-expert matmuls) each
    make a forward, an input-gradient and a weight-gradient matmul, all 30 s8 (the grouped ones in
    the TPU's ragged-dot kernel); the head and the router stay float (the `none` program holds no s8
    matmul: tests/plan/test_plan_tpu.py::test_none_has_no_int8_matmuls). The plan's MoE FLOPs are the
    9 grouped products, all s8, each over the 640 rows of the receive buffer (1.1 x 256 tokens x 2
    experts per device = 564, rounded up to the kernel's 128-row tiles: with 564 rows the TPU compiler
    makes each a dense convolution over both local experts, in bf16 as in s8)."""
    cfg = config.load(None, ["model.n_layers=1", "model.d_model=128", "model.n_heads=2", "model.n_kv_heads=2",
                             "model.d_ff=256", "model.vocab_size=128", "data.seq_len=128", "data.source=synthetic",
                             "model.moe.n_experts=8", "model.moe.n_shared_experts=1", "mesh.expert=4",
                             "model.moe.receive_buffer=1.1",
                             "train.global_batch_size=8", "train.compute_dtype=bfloat16",
                             "train.quantization=int8", "model.attention=xla"])
    devices = list(topology.devices(chips.CHIPS["v5e"], "2x2"))
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices))
    compiled, seconds = planner.compile_program(prog)
    counts = hlo.matmul_flops_by_dtype(compiled.as_text(), count=True)
    assert counts.get("s8") == 30 and not any("f8" in k for k in counts)
    r = planner.report(prog, compiled, chips.CHIPS["v5e"], seconds)
    assert r["flops_by_dtype"]["s8"] > r["flops_by_dtype"]["bf16"]
    assert r["moe_flops_by_dtype"] == {"s8": 9 * 2 * 640 * 128 * 256} and r["moe_low_precision_share"] == 1.0
    assert "grouped matmuls: s8 3.775e+08 (100.0% in int8 / fp8)\n" in planner.format_report(r)


def test_fp8_compiles_to_f8_gemms_on_a_compile_only_h100():
    """XLA:GPU without a GPU (jax's CUDA plugin, compile-only): the fp8 dot's forward and both
    gradient matmuls keep f8 operands (e4m3 x e4m3 forward, e5m2 gradients)."""
    devices = topology.devices(chips.CHIPS["h100"], "1x1")
    replicated = NamedSharding(Mesh(np.array(devices), ("fsdp",)), P())
    x, w = (jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=replicated) for s in ((256, 512), (512, 384)))
    loss = jax.jit(jax.grad(lambda x, w: (quant.dot(x, w, "fp8").astype(jnp.float32) ** 2).sum(), argnums=(0, 1)))
    counts = hlo.matmul_flops_by_dtype(planner.compile_fast(loss.lower(x, w), "gpu").as_text(), count=True)
    assert counts == {"f8e4m3fn": 1, "f8e5m2xf8e4m3fn": 1, "f8e4m3fnxf8e5m2": 1}


def test_flops_by_dtype_reads_operand_types_and_counts_loop_trips():
    text = """HloModule m

%body (p: (s32[], s8[4,8])) -> (s32[], s8[4,8]) {
  %p = (s32[], s8[4,8]) parameter(0)
  %a = s8[4,8]{1,0} get-tuple-element(%p), index=1
  %b = s8[8,2]{1,0} constant({...})
  %d = s32[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], s8[4,8]) tuple(%i, %a)
}

%cond (p: (s32[], s8[4,8])) -> pred[] {
  ROOT %c = pred[] compare(%x, %y), direction=LT
}

ENTRY %main (x: bf16[4,8], w: bf16[8,2]) -> bf16[4,2] {
  %x = bf16[4,8]{1,0} parameter(0)
  %w = bf16[8,2]{1,0} parameter(1)
  %l = (s32[], s8[4,8]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %y = bf16[4,2]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    assert hlo.matmul_flops_by_dtype(text) == {"s8": 3 * 2 * 4 * 2 * 8, "bf16": 2 * 4 * 2 * 8}
    assert hlo.matmul_flops_by_dtype(text, count=True) == {"s8": 3, "bf16": 1}


def test_moe_flops_by_dtype_are_the_grouped_matmuls_only():
    """The MoE experts' grouped matmuls: the TPU's ragged-dot kernel, forward (rows, K) x (groups, K, N)
    and weight gradient (rows, K) x (rows, N) -> (groups, K, N), both over every row of the buffer;
    a dense dot that a compiler made of `ragged_dot` inside their named scope; not the other dots."""
    scope = 'metadata={op_name="jit(step)/transpose(jvp(moe_grouped_matmul))/dot_general"}'
    text = f"""HloModule m

ENTRY %main (x: s8[40,8], w: s8[2,8,16], g: s8[40,16], n: s32[2], d: bf16[4,8], e: bf16[8,16]) -> s32[2,8,16] {{
  %x = s8[40,8]{{1,0}} parameter(0)
  %w = s8[2,8,16]{{2,1,0}} parameter(1)
  %g = s8[40,16]{{1,0}} parameter(2)
  %n = s32[2]{{0}} parameter(3)
  %d = bf16[4,8]{{1,0}} parameter(4)
  %e = bf16[8,16]{{1,0}} parameter(5)
  %ragged-dot-none = s32[40,16]{{1,0}} custom-call(%n, %x, %w), custom_call_target="tpu_custom_call"
  %ragged-dot-none.1 = s32[2,8,16]{{2,1,0}} custom-call(%n, %x, %g), custom_call_target="tpu_custom_call"
  %dense = bf16[4,16]{{1,0}} dot(%d, %e), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {scope}
  ROOT %other = bf16[4,16]{{1,0}} dot(%d, %e), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
"""
    grouped = 2 * 40 * 8 * 16  # each kernel, every row of the buffer
    assert hlo.matmul_flops_by_dtype(text, moe=True) == {"s8": 2 * grouped, "bf16": 2 * 4 * 8 * 16}
    assert hlo.matmul_flops_by_dtype(text)["bf16"] == 2 * 2 * 4 * 8 * 16
    assert planner.low_precision_share({"s8": 3.0, "bf16": 1.0}) == 0.75
    assert planner.low_precision_share({"f8e5m2xf8e4m3fn": 1.0, "s8xbf16": 1.0}) == 0.5
    assert planner.low_precision_share({}) is None


def test_roofline_counts_low_precision_matmuls_at_their_peak():
    v5p = chips.CHIPS["v5p"]
    assert chips.peak_flops(v5p, "s8") == 2 * chips.peak_flops(v5p, "bf16")
    assert chips.peak_flops(chips.CHIPS["h100"], "f8e5m2xf8e4m3fn") == 1979e12
    assert chips.peak_flops(v5p, "f8e4m3fn") == v5p.peak_flops  # no fp8 on a TPU: bf16's peak
    assert chips.peak_flops(v5p, "s8xbf16") == v5p.peak_flops
    peak = v5p.peak_flops
    assert planner.compute_seconds(peak, peak, {"bf16": 0.8 * peak}, v5p) == pytest.approx((1.0, 1.0))
    # 80% of the FLOPs in s8 matmuls at twice the peak: 0.2 + 0.8 / 2 of the time
    assert planner.compute_seconds(peak, peak, {"s8": 0.8 * peak}, v5p) == pytest.approx((0.6, 0.6))
    # the model's FLOPs (the floor) are split like the program's
    assert planner.compute_seconds(0.5 * peak, peak, {"s8": 0.4 * peak}, v5p) == pytest.approx((0.3, 0.6))
    e = planner.estimate(0.5 * peak, 0.0, [], v5p, set(), 4 * peak, 4, {"s8": 0.4 * peak})
    assert e["step_time_s"] == pytest.approx(0.6) and e["mfu"] == pytest.approx(1.0)


@pytest.mark.parametrize("how", ["int8", "fp8"])
def test_grouped_matmul_forward_and_gradients_are_within_the_rounding_bound(how):
    """The MoE experts' grouped matmul (ragged_dot), group by group against the float products; the
    padding rows after the groups stay zero."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x, w, g = jax.random.normal(kx, (24, 32)), 0.1 * jax.random.normal(kw, (3, 32, 16)), jax.random.normal(kg, (24, 16))
    group_e = jnp.array([5, 10, 6], jnp.int32)
    y, dx, dw = jax.jit(lambda x, w, g: (lambda y, vjp: (y, *vjp(g)))(
        *jax.vjp(lambda x, w: quant.grouped_dot(x, w, group_e, how), x, w)))(x, w, g)
    x, w, g = (np.asarray(a, np.float64) for a in (x, w, g))
    bound = int8_bound if how == "int8" else fp8_bound
    grad_bound = int8_bound if how == "int8" else functools.partial(fp8_bound, rel_a=2.0 ** -3, rel_b=2.0 ** -3)
    starts = np.concatenate([[0], np.cumsum(group_e)])
    for e in range(3):
        rows = slice(starts[e], starts[e + 1])
        assert np.all(np.abs(y[rows] - x[rows] @ w[e]) <= bound(x[rows], w[e]))
        assert np.all(np.abs(dx[rows] - g[rows] @ w[e].T) <= grad_bound(g[rows], w[e].T))
        # dw scales x and g per column over all rows (every group's), hence the whole columns' maxima
        dw_bound = grad_bound(x[rows].T, g[rows], np.abs(x).max(0)[:, None], np.abs(g).max(0)[None])
        assert np.all(np.abs(dw[e] - x[rows].T @ g[rows]) <= dw_bound)
    assert not np.any(y[starts[-1]:]) and not np.any(dx[starts[-1]:])
