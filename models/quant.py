"""Quantized matmuls for training: `dot(x_nk, w_km, how)` with `how` in none / int8 / fp8.

Both formats quantize each operand of every matmul, forward and backward, with a scale per row
or column taken along the axes the matmul does *not* contract (AQT's and torchtitan's "rowwise"
recipe), so a scale factors out of the sum and is applied to the product afterwards:

    x ~ s_x q_x, w ~ s_w q_w     y = x @ w ~ (q_x @ q_w) * s_x[:, None] * s_w[None, :]

- forward  y  = x @ w:    x per token (row, over K), w per output channel (column, over K);
- backward dx = g @ w^T:  g per token (over M),      w per input channel (row, over M);
           dw = x^T @ g:  x per channel (over tokens), g per channel (over tokens).

Scaling recipe: current (just-in-time) absmax scaling, s = max|v| / Q over the scaled axes (1
where that max is 0), recomputed from the float values at each use, so nothing is carried from
step to step (no amax history: the train state and checkpoints are unchanged).

- int8: q = round(v / s) in [-127, 127] (Q = 127), products accumulated in int32
  (`preferred_element_type=int32`): the TPU's int8 MXU path. Rounding error per element is at most
  s / 2, so |y - x @ w| <= sum_k (|x_k| s_w / 2 + |w_k| s_x / 2 + s_x s_w / 4) per output (the bound
  tests/models/test_quant.py checks).
- fp8: e4m3 (Q = 448) for the forward operands, e5m2 (Q = 57344, more range, less precision) for
  the gradient g in the backward products, accumulated in float32 and returned in the compute
  dtype: on XLA:GPU (H100 / H200) an fp8 x fp8 dot becomes an fp8 GEMM (cuBLASLt or Triton).
  Relative rounding error per element <= 2^-4 (e4m3), 2^-3 (e5m2).

Gradients are straight-through: rounding is treated as the identity, so dx and dw are the float
matmul's gradients computed with quantized operands (no clipping happens: absmax scales map every
value into range). Residuals are the float x and w, requantized along the backward's axes.

Weight gradients of data-split rows (`row_groups`: the ways the batch is split over devices, AQT's
"local" quantization): dw sums over every row, so its int32 product is a partial sum on each device
that XLA would reduce across devices as int32, twice the bytes of the bf16 reduction without
quantization. With x's leading dim cut into `row_groups` groups (one per batch shard), each group
gets its own channel scales and its own product, dequantized to the compute dtype before the groups
are summed: the cross-device reduction then moves compute-dtype gradients, as without quantization.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

HOWS = ("none", "int8", "fp8")
_INT8_MAX = 127.0


def _format(how: str, grad: bool = False):
    """(operand dtype, largest representable magnitude Q) of a format."""
    if how == "int8":
        return jnp.int8, _INT8_MAX
    dtype = jnp.float8_e5m2 if grad else jnp.float8_e4m3fn
    return dtype, float(jnp.finfo(dtype).max)


def _product_dtype(how: str, like):
    """What a quantized product comes out in: int32 sums for int8; for fp8 the unquantized
    operand's dtype (the GEMM accumulates in float32 inside; a bf16 result is what a sharded
    contraction then reduces across devices, as without quantization, not float32)."""
    return jnp.int32 if how == "int8" else like.dtype


def quantize(v, axes: tuple[int, ...], how: str, grad: bool = False):
    """(q, s): v ~ s * q with one absmax scale s (float32, keepdims) per slice along `axes`."""
    dtype, qmax = _format(how, grad)
    v32 = v.astype(jnp.float32)
    amax = jnp.max(jnp.abs(v32), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    scaled = v32 / scale
    if how == "int8":
        scaled = jnp.clip(jnp.round(scaled), -_INT8_MAX, _INT8_MAX)
    return scaled.astype(dtype), scale


def _qmatmul(a, a_axes, b, b_axes, dims, how, grads=(False, False), batched=False):
    """a . b over `dims` (lax dimension numbers: contracting, or with `batched` (contracting,
    batch)) with both operands quantized along the given (contracted) axes; the scales multiply
    the float32 product."""
    qa, sa = quantize(a, a_axes, how, grads[0])
    qb, sb = quantize(b, b_axes, how, grads[1])
    dims = dims if batched else (dims, ((), ()))
    out = jax.lax.dot_general(qa, qb, dims, preferred_element_type=_product_dtype(how, a))
    out = out.astype(jnp.float32)
    return out, sa, sb


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dot(x, w_km, how, row_groups):
    return _forward(x, w_km, how)


def _forward(x, w_km, how):
    lead = x.ndim - 1
    y, sx, sw = _qmatmul(x, (lead,), w_km, (0,), ((lead,), (0,)), how)
    return (y * sx * sw).astype(x.dtype)  # sx (..., 1), sw (1, M)


def _dot_fwd(x, w_km, how, row_groups):
    return _forward(x, w_km, how), (x, w_km)


def _dot_bwd(how, row_groups, res, g):
    x, w_km = res
    # dx = g @ w^T: g per token over M, w per input channel over M
    dx, sg, sw = _qmatmul(g, (g.ndim - 1,), w_km, (1,), ((g.ndim - 1,), (1,)), how, (True, False))
    dx = dx * sg * sw.reshape(1, -1)
    # dw = x^T @ g: both per channel over each group's tokens, one product per group
    x, g = (v.reshape(row_groups, v.shape[0] // row_groups, *v.shape[1:]) for v in (x, g))
    rows = tuple(range(1, x.ndim - 1))
    dw, sx, sg = _qmatmul(x, rows, g, rows, ((rows, rows), ((0,), (0,))), how, (False, True), batched=True)
    dw = (dw * sx.reshape(row_groups, -1, 1) * sg.reshape(row_groups, 1, -1)).astype(w_km.dtype)
    zero = jnp.zeros((), dw.dtype)
    return dx.astype(x.dtype), jax.lax.reduce(dw, zero, jax.lax.add, (0,))  # summed in the compute dtype


_dot.defvjp(_dot_fwd, _dot_bwd)


def _row_groups(group_e, rows: int):
    """The group of each of `rows` rows sorted by group (group_e rows each; padding rows after the
    groups get the last group, whose scale is then harmless: ragged_dot leaves those rows zero)."""
    return jnp.minimum(jnp.searchsorted(jnp.cumsum(group_e), jnp.arange(rows), side="right"), group_e.shape[0] - 1)


def _grouped_matmul(a_rk, b_ekm, group_e, how, grad=False):
    """ragged_dot(a, b) with a per row and b per (group, output column) quantized over K."""
    qa, sa = quantize(a_rk, (1,), how, grad)
    qb, sb = quantize(b_ekm, (1,), how)
    out = jax.lax.ragged_dot(qa, qb, group_e, preferred_element_type=_product_dtype(how, a_rk))
    out = out.astype(jnp.float32)
    return out * sa * sb[_row_groups(group_e, a_rk.shape[0]), 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(x_rd, w_edf, group_e, how):
    return _grouped_matmul(x_rd, w_edf, group_e, how).astype(x_rd.dtype)


def _grouped_fwd(x_rd, w_edf, group_e, how):
    return _grouped(x_rd, w_edf, group_e, how), (x_rd, w_edf, group_e)


def _grouped_bwd(how, res, g_rf):
    x_rd, w_edf, group_e = res
    dx = _grouped_matmul(g_rf, jnp.swapaxes(w_edf, 1, 2), group_e, how, grad=True)
    # dw[e] = x_e^T g_e: contracted over each group's rows, so x and g are scaled per column over all rows
    qx, sx = quantize(x_rd, (0,), how)
    qg, sg = quantize(g_rf, (0,), how, grad=True)
    numbers = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                                lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    dw = jax.lax.ragged_dot_general(qx, qg, group_e, numbers, preferred_element_type=_product_dtype(how, x_rd))
    dw = dw.astype(jnp.float32) * sx.reshape(1, -1, 1) * sg.reshape(1, 1, -1)
    return dx.astype(x_rd.dtype), dw.astype(w_edf.dtype), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_dot(x_rd, w_edf, group_e, how: str = "none"):
    """Rows x_rd (sorted by group, group_e rows each, padding after) times their group's w_edf
    (`jax.lax.ragged_dot`, the MoE experts' grouped matmul), quantized like `dot`: x per row, w per
    (expert, output channel) forward; g per row and w per (expert, input channel) for dx; x and g
    per channel over all rows for dw."""
    if how == "none":
        return jax.lax.ragged_dot(x_rd, w_edf, group_e)
    return _grouped(x_rd, w_edf, group_e, how)


def dot(x, w_km, how: str = "none", row_groups: int = 1):
    """x (..., K) @ w_km (K, M) -> (..., M) in x's dtype, the operands quantized by `how` (see the
    module docstring); `none` is the plain matmul. `row_groups` divides x's leading dim: the weight
    gradient's groups (the ways that dim is split over devices)."""
    if how == "none":
        return x @ w_km
    if how not in HOWS:
        raise ValueError(f"unknown quantization '{how}'; known: {', '.join(HOWS)}")
    return _dot(x, w_km, how, math.gcd(x.shape[0], row_groups))  # rows a shard_map already split: fewer
