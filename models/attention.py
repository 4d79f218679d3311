"""Causal grouped-query attention by implementation: one function the decoder calls.

    o_bthe = attend(q_bthe, k_btke, v_btke, segment_ids_bt=None, positions_bt=None, impl="auto",
                    constrain=None, window=None, scale=None, softcap=None, sinks_h=None)

Shapes: B batch, T sequence, H query heads, K key/value heads (K divides H, G = H / K queries per
key head), E head dim. q is not pre-scaled: every implementation scales scores by `scale`
(default E**-0.5) and, with `softcap` c (Gemma 2), caps them to c * tanh(s / c) before the mask.
`segment_ids_bt` (int, one id per packed document) restricts attention to tokens of the same
document; None means one document per row. `window` W (sliding-window attention, Mistral's
`sliding_window`) lets query t see keys t - W + 1 .. t only; None: every earlier key.
`attention_chunk` C (Llama 4) lets it see only the earlier keys of its aligned chunk of C positions,
as segment ids (`chunk_segments`), under every implementation. `sinks_h` (H,)
(gpt-oss's attention sinks) adds exp(sink_h) to every softmax denominator of head h, as a key of
that logit with a zero value would: the online softmax below starts from it, splash's kernel takes it,
cuDNN's output is scaled by sigmoid(lse - sink_h) (lse: its logsumexp without the sink).

- `xla`: `jax.nn.dot_product_attention`, which materialises the B x H x T x T scores. The reference;
  fastest on CPU at short T. A window is its `local_window_size` (W - 1, 0). With a soft cap or
  sinks (which it lacks) the same whole scores by `fold_block` below.
- `chunked`: flash-style in plain XLA: a scan over query chunks, inside it a scan over key chunks
  with an online softmax; never holds more than one chunk x chunk block of scores per head;
  recomputed in the backward pass. Any platform, long T without a kernel. With a window, each
  query chunk reads only the ceil((W - 1) / chunk) + 1 key chunks that can reach it.
- `splash`: Pallas splash attention (TPU kernel, block-sparse causal mask (a `LocalMask` with a
  window: blocks outside it are skipped), segment ids), one kernel
  per key head with its G query heads (MQA form, no repeat of k/v), in a `shard_map` over the batch
  and kv-head axes. TPU (tests run it with `interpret=True` on CPU).
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")` (flash attention; a window is
  cuDNN's sliding_window_length W). NVIDIA GPU. Its kernel has no sinks: with them it runs without
  and returns its softmax's logsumexp, and `with_sinks_by_logsumexp` rescales the output (a custom
  VJP; the logsumexp's gradient by XLA in query chunks). No soft cap: asking for one is an error.
- `auto`: splash on TPU, cudnn on GPU (chunked for float32, heads over 128 channels or a soft cap), xla on CPU.
- ring (context parallelism): when the trainer splits the sequence over devices
  (`constrain.size("seq") > 1`), every implementation runs as ring attention (below); `xla`
  computes each ring step's block whole, the others in chunks like `chunked`.

`constrain` is the trainer's activation-sharding object (or None): `splash` and ring attention
run per shard with `constrain.shard_map(fn, in_names, out_names)`, and
`constrain.platform` says which chip the program is compiled for; without them the kernel runs on
the whole arrays on the default backend. The model never sees the mesh.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from models.contract import no_constraint

IMPLS = ("auto", "xla", "chunked", "splash", "cudnn")
CHUNK = 512
"""Query / key chunk of the `chunked` implementation (the whole sequence when shorter)."""
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
"""What cuDNN's fused attention takes; `auto` on a GPU runs `chunked` for other compute dtypes."""
CUDNN_MAX_HEAD_DIM = 128
"""The widest query/key head jax's cuDNN flash attention takes (MLA's 128 + 64 is wider)."""


def resolve(impl: str, platform: str | None = None) -> str:
    """The implementation `auto` stands for on `platform` (default: the default backend's)."""
    if impl != "auto":
        if impl not in IMPLS:
            raise ValueError(f"unknown attention implementation '{impl}'; known: {', '.join(IMPLS)}")
        return impl
    platform = platform or jax.default_backend()
    return {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn"}.get(platform, "xla")


def attend(q_bthe, k_btke, v_btke, *, segment_ids_bt=None, positions_bt=None, impl: str = "auto",
           constrain=None, window: int | None = None, scale: float | None = None, softcap: float | None = None,
           attention_chunk: int | None = None, sinks_h=None):
    """Causal attention of q over k, v (see the module docstring); returns o_bthe in q's dtype.
    `positions_bt` matter only to ring attention, whose masks come from them (the trainer feeds a
    context-parallel sequence out of order); None: 0..T-1.

    The platform (for `auto`, and for running splash compiled or in the Pallas interpreter) is
    `constrain.platform` (the mesh's devices: `tpu` when compiling for a TPU topology on a CPU
    host) or else the default backend; splash off TPU runs interpreted (CPU tests)."""
    platform = getattr(constrain, "platform", None) or jax.default_backend()
    if impl == "auto" and resolve(impl, platform) == "cudnn" and (q_bthe.dtype not in CUDNN_DTYPES or softcap
                                                                  or q_bthe.shape[-1] > CUDNN_MAX_HEAD_DIM):
        impl = "chunked"  # cuDNN's fused attention: half-precision inputs only, heads up to 128, no soft cap
    impl = resolve(impl, platform)
    if impl == "cudnn" and softcap is not None:
        raise ValueError("cudnn attention has no soft cap (model.attn_softcap); use chunked")
    scale = q_bthe.shape[-1] ** -0.5 if scale is None else scale
    if attention_chunk is not None:
        segment_ids_bt = chunk_segments(segment_ids_bt, positions_bt, q_bthe.shape[:2], attention_chunk)
    if constrain is not None and constrain.size("seq") > 1:
        return ring(q_bthe, k_btke, v_btke, positions_bt, segment_ids_bt, constrain=constrain,
                    chunk=None if impl == "xla" else CHUNK, window=window, scale=scale, softcap=softcap,
                    sinks_h=sinks_h)
    if impl == "xla" and (softcap is not None or sinks_h is not None):
        return chunked(q_bthe, k_btke, v_btke, segment_ids_bt, chunk=None, window=window, scale=scale, softcap=softcap,
                       sinks_h=sinks_h)
    if impl == "cudnn" and constrain is not None and jax.sharding.get_abstract_mesh().manual_axes:
        return cudnn_per_shard(q_bthe, k_btke, v_btke, segment_ids_bt, constrain=constrain, window=window, scale=scale,
                               sinks_h=sinks_h)
    if impl == "cudnn" and sinks_h is not None:
        return with_sinks_by_logsumexp(q_bthe, k_btke, v_btke, sinks_h, segment_ids_bt, window=window, scale=scale)
    if impl == "xla" or impl == "cudnn":
        return dot_product(q_bthe, k_btke, v_btke, segment_ids_bt, impl=impl, window=window, scale=scale)
    if impl == "chunked":
        return chunked(q_bthe, k_btke, v_btke, segment_ids_bt, window=window, scale=scale, softcap=softcap,
                       sinks_h=sinks_h)
    return splash(q_bthe, k_btke, v_btke, segment_ids_bt, constrain=constrain, interpret=platform != "tpu",
                  window=window, scale=scale, softcap=softcap, sinks_h=sinks_h)


def dot_product(q_bthe, k_btke, v_btke, segment_ids_bt, *, impl, window, scale, return_residual=False):
    """`jax.nn.dot_product_attention` (`xla` or `cudnn`), causal, within documents and the window;
    with return_residual, also its softmax's (B, T, H) logsumexp."""
    mask = None
    if segment_ids_bt is not None:
        mask = (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])[:, None]  # (B, 1, T, T)
    return jax.nn.dot_product_attention(q_bthe, k_btke, v_btke, mask=mask, is_causal=True, implementation=impl,
                                        scale=scale, local_window_size=None if window is None else (window - 1, 0),
                                        return_residual=return_residual)


def cudnn_per_shard(q_bthe, k_btke, v_btke, segment_ids_bt, *, constrain, window, scale, sinks_h=None):
    """cuDNN attention on each device's shards (batch, key heads; the sinks of their query heads), for a
    partly manual shard_map (the pipeline's), where XLA:GPU's custom partitioner of cuDNN attention
    cannot read the shardings."""
    b, t, h, e = q_bthe.shape
    k_heads = k_btke.shape[2]
    seg_bt = jnp.zeros((b, t), jnp.int32) if segment_ids_bt is None else segment_ids_bt.astype(jnp.int32)

    def local(shard, q_btkge, k_btke, v_btke, seg_bt, sinks_kg=None):  # attend's own cuDNN call, on local shapes
        o = attend(q_btkge.reshape(*q_btkge.shape[:2], -1, e), k_btke, v_btke, segment_ids_bt=seg_bt, impl="cudnn",
                   window=window, scale=scale, sinks_h=None if sinks_kg is None else sinks_kg.reshape(-1))
        return o.reshape(q_btkge.shape)
    names_q, names_kv = ("batch", None, "kv_heads", None, None), ("batch", None, "kv_heads", None)
    sinks = () if sinks_h is None else (sinks_h.reshape(k_heads, h // k_heads),)
    names_in = (names_q, names_kv, names_kv, ("batch", None), *((("kv_heads", None),) * len(sinks)))
    run = constrain.shard_map(local, names_in, names_q)
    return run(q_bthe.reshape(b, t, k_heads, h // k_heads, e), k_btke, v_btke, seg_bt, *sinks).reshape(b, t, h, e)


def with_sinks_by_logsumexp(q_bthe, k_btke, v_btke, sinks_h, segment_ids_bt=None, *, window=None, scale,
                            impl: str = "cudnn"):
    """Attention with sinks from a kernel without them that returns its softmax's logsumexp (cuDNN's
    `return_residual`; `impl` the `jax.nn.dot_product_attention` implementation, `xla` in CPU tests):
    with o the attention without sinks and lse its (B, T, H) logsumexp, the attention with sinks is
    o * s, s = sigmoid(lse - sink). A custom VJP, because cuDNN's drops the logsumexp's cotangent:
    d_out * s goes into the kernel's own backward; ds = d_out . o gives d_lse = ds s (1 - s) and
    d_sink = -sum d_lse; the logsumexp's gradient into q and k (d lse_i / d score_ij = P_ij) is the
    VJP of `chunked_logsumexp`, one query chunk of scores at a time, under the same masks. (Arrays
    enter as arguments: a custom VJP closing over a tracer of an enclosing scan fails to lower.)"""
    def forward(q_bthe, k_btke, v_btke, sinks_h, seg_bt):
        attention_and_lse = functools.partial(dot_product, segment_ids_bt=seg_bt, impl=impl, window=window,
                                              scale=scale, return_residual=True)
        (o_bthe, lse_bth), kernel_vjp = jax.vjp(attention_and_lse, q_bthe, k_btke, v_btke)
        s_bth = jax.nn.sigmoid(lse_bth.astype(jnp.float32) - sinks_h.astype(jnp.float32))
        out_bthe = (o_bthe.astype(jnp.float32) * s_bth[..., None]).astype(o_bthe.dtype)
        return out_bthe, (q_bthe, k_btke, o_bthe, lse_bth, s_bth, kernel_vjp, sinks_h, seg_bt)

    def backward(res, d_out_bthe):
        q_bthe, k_btke, o_bthe, lse_bth, s_bth, kernel_vjp, sinks_h, seg_bt = res
        d_out_bthe = d_out_bthe.astype(jnp.float32)
        dq, dk, dv = kernel_vjp(((d_out_bthe * s_bth[..., None]).astype(o_bthe.dtype), jnp.zeros_like(lse_bth)))
        d_lse_bth = (d_out_bthe * o_bthe.astype(jnp.float32)).sum(-1) * s_bth * (1 - s_bth)
        chunk = math.gcd(q_bthe.shape[1], CHUNK)  # cuDNN takes any length; chunks must divide it
        _, lse_vjp = jax.vjp(functools.partial(chunked_logsumexp, segment_ids_bt=seg_bt, chunk=chunk, window=window,
                                               scale=scale), q_bthe, k_btke)
        dq_lse, dk_lse = lse_vjp(d_lse_bth)
        return (add_as(dq, dq_lse), add_as(dk, dk_lse), dv, (-d_lse_bth.sum((0, 1))).astype(sinks_h.dtype), None)

    run = jax.custom_vjp(lambda *args: forward(*args)[0])
    run.defvjp(forward, backward)
    return run(q_bthe, k_btke, v_btke, sinks_h, segment_ids_bt)


def add_as(x, y):
    """x + y in float32, in x's dtype."""
    return (x.astype(jnp.float32) + y.astype(jnp.float32)).astype(x.dtype)


def chunk_segments(segment_ids_bt, positions_bt, bt, chunk: int):
    """Segment ids under which attention stays within aligned chunks of `chunk` positions (Llama 4's
    chunked attention): each (document, chunk) pair its own segment, so every implementation's
    segment masking (splash's and ring attention's included) does it. Positions default to 0..T-1."""
    pos_bt = jnp.arange(bt[1]) if positions_bt is None else positions_bt
    seg_bt = jnp.zeros(bt, jnp.int32) if segment_ids_bt is None else segment_ids_bt.astype(jnp.int32)
    return seg_bt * 65536 + jnp.broadcast_to(pos_bt, bt).astype(jnp.int32) // chunk  # < 2^16 chunks a row


# ----------------------------------------------------------------------------- chunked XLA
# Online softmax (flash attention's): a carry (m running max, l denominator, acc weighted sum of
# values; float32) per query folds in one block of keys at a time. `chunked` folds every key chunk
# into each query chunk; ring attention folds each device's block as it passes.


def empty_carry(b, t, k_heads, g, e, sinks_h=None):
    """(m, l, acc) before any key: m (B, K, G, T) -inf, l (B, K, G, T) 0, acc (B, T, K, G, E) 0. With
    attention sinks (H,) the carry starts as if it had folded a key of logit sink and value 0: m the
    sink, l 1."""
    if sinks_h is None:
        m_bkgt, l_bkgt = jnp.full((b, k_heads, g, t), -jnp.inf, jnp.float32), jnp.zeros((b, k_heads, g, t), jnp.float32)
    else:
        sink_kg1 = sinks_h.astype(jnp.float32).reshape(k_heads, g, 1)
        m_bkgt, l_bkgt = jnp.broadcast_to(sink_kg1, (b, k_heads, g, t)), jnp.ones((b, k_heads, g, t), jnp.float32)
    return m_bkgt, l_bkgt, jnp.zeros((b, t, k_heads, g, e), jnp.float32)


def fold(q_bqkge, pos_q_bq, seg_q_bq, k_bske, v_bske, pos_k_bs, seg_k_bs, carry, window=None, softcap=None):
    """Folds one key/value block into the carry; a query sees keys at positions <= its own (and
    within `window` of it), in its document. q is pre-scaled; `softcap` caps the scores."""
    m_bkgq, l_bkgq, acc_bqkge = carry
    s_bkgqs = jnp.einsum("bqkge,bske->bkgqs", q_bqkge, k_bske, preferred_element_type=jnp.float32)
    if softcap is not None:
        s_bkgqs = jnp.tanh(s_bkgqs / softcap) * softcap
    allowed_bqs = (pos_q_bq[:, :, None] >= pos_k_bs[:, None, :]) & (seg_q_bq[:, :, None] == seg_k_bs[:, None, :])
    if window is not None:
        allowed_bqs &= pos_q_bq[:, :, None] - pos_k_bs[:, None, :] < window
    s_bkgqs = jnp.where(allowed_bqs[:, None, None], s_bkgqs, -jnp.inf)
    m_new = jnp.maximum(m_bkgq, s_bkgqs.max(-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with nothing allowed yet
    p_bkgqs = jnp.exp(s_bkgqs - m_safe[..., None])
    corr_bkgq = jnp.exp(m_bkgq - m_safe)
    l_new = l_bkgq * corr_bkgq + p_bkgqs.sum(-1)
    pv_bqkge = jnp.einsum("bkgqs,bske->bqkge", p_bkgqs.astype(v_bske.dtype), v_bske,
                          preferred_element_type=jnp.float32)
    return m_new, l_new, acc_bqkge * corr_bkgq.transpose(0, 3, 1, 2)[..., None] + pv_bqkge


def fold_block(q_bqkge, pos_q_bq, seg_q_bq, k_bske, v_bske, pos_k_bs, seg_k_bs, carry, chunk=None, window=None,
               softcap=None):
    """Folds a block of keys into the carry `chunk` x `chunk` at a time (None: all at once), each
    query chunk rematerialised in the backward pass (its scores are never saved)."""
    b, t, k_heads, g, e = q_bqkge.shape
    s = k_bske.shape[1]
    cq, ck = min(chunk or t, t), min(chunk or s, s)
    if t % cq or s % ck:
        raise ValueError(f"chunked attention: sequence length {t} is not a multiple of the chunk {chunk}")

    def split(x, c, axis=1):  # (.., N c, ..) -> (N, .., c, ..)
        return jnp.moveaxis(x.reshape(*x.shape[:axis], x.shape[axis] // c, c, *x.shape[axis + 1:]), axis, 0)

    keys = tuple(split(x, ck) for x in (k_bske, v_bske, pos_k_bs, seg_k_bs))
    carry = varying_like(carry, q_bqkge, k_bske, v_bske)

    @jax.checkpoint
    def query_chunk(q_bckge, pos_q_bc, seg_q_bc, carry):
        def key_chunk(carry, kv):
            return fold(q_bckge, pos_q_bc, seg_q_bc, *kv, carry, window, softcap), None
        return jax.lax.scan(key_chunk, carry, keys)[0]

    if cq == t:
        return query_chunk(q_bqkge, pos_q_bq, seg_q_bq, carry)
    m_bkgq, l_bkgq, acc_bqkge = carry
    out = jax.lax.map(lambda a: query_chunk(*a), (split(q_bqkge, cq), split(pos_q_bq, cq), split(seg_q_bq, cq),
                                                  (split(m_bkgq, cq, 3), split(l_bkgq, cq, 3), split(acc_bqkge, cq))))

    def merge(x, axis):  # (N, .., c, ..) -> (.., N c, ..)
        x = jnp.moveaxis(x, 0, axis)
        return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2:])
    return merge(out[0], 3), merge(out[1], 3), merge(out[2], 1)


def varying(x) -> frozenset:
    """The manual mesh axes (inside a shard_map) x varies over."""
    return getattr(getattr(jax.typeof(x), "manual_axis_type", None), "varying", frozenset())


def varying_like(carry, *xs):
    """The carry varying over every manual mesh axis any of xs varies over (inside a shard_map, e.g.
    a pipeline stage's): a scan's carry created there must have its body's output type."""
    axes = frozenset().union(*map(varying, xs))

    def cast(c):
        missing = tuple(sorted(axes - varying(c)))
        return jax.lax.pcast(c, missing, to="varying") if missing else c
    return jax.tree.map(cast, carry)


def grouped_queries(q_bthe, k_heads, scale):
    """(B, T, K, G, E) queries times `scale`: query head h = k G + g uses key head k."""
    b, t, h, e = q_bthe.shape
    return (q_bthe * jnp.asarray(scale, q_bthe.dtype)).reshape(b, t, k_heads, h // k_heads, e)


def normalised(carry, dtype):
    _, l_bkgq, acc_bqkge = carry
    b, t, k_heads, g, e = acc_bqkge.shape
    return (acc_bqkge / l_bkgq.transpose(0, 3, 1, 2)[..., None]).reshape(b, t, k_heads * g, e).astype(dtype)


def chunked(q_bthe, k_btke, v_btke, segment_ids_bt=None, chunk: int | None = CHUNK, window: int | None = None,
            scale: float | None = None, softcap: float | None = None, sinks_h=None):
    """Flash attention in plain XLA: online softmax over key chunks, one query chunk at a time
    (chunk None: the whole sequence at once). With a window, query chunk i reads only key chunks
    i - R + 1 .. i (R = the chunks a window reaches; clamped at the first chunk, the extra keys are
    masked as future ones)."""
    carry = chunked_softmax(q_bthe, k_btke, v_btke, segment_ids_bt, chunk, window, scale, softcap, sinks_h)
    return normalised(carry, q_bthe.dtype)


def chunked_logsumexp(q_bthe, k_btke, segment_ids_bt=None, chunk: int | None = CHUNK, window: int | None = None,
                      scale: float | None = None):
    """(B, T, H) float32 logsumexp of each query's scaled, masked scores (no sinks, no cap): `chunked`'s
    online softmax over keys without values (zero-width), so never more than a chunk x chunk block of
    scores per head, and the same masks."""
    v_bsk0 = jnp.zeros((*k_btke.shape[:3], 0), k_btke.dtype)
    m_bkgt, l_bkgt, _ = chunked_softmax(q_bthe, k_btke, v_bsk0, segment_ids_bt, chunk, window, scale)
    b, k_heads, g, t = m_bkgt.shape
    return (m_bkgt + jnp.log(l_bkgt)).transpose(0, 3, 1, 2).reshape(b, t, k_heads * g)


def chunked_softmax(q_bthe, k_btke, v_btke, segment_ids_bt=None, chunk: int | None = CHUNK,
                    window: int | None = None, scale: float | None = None, softcap: float | None = None, sinks_h=None):
    """`chunked`'s online softmax carry (m, l, acc) after every key, not yet normalised."""
    b, t, h, e = q_bthe.shape
    k_heads, g = k_btke.shape[2], h // k_btke.shape[2]
    seg_bt = jnp.zeros((b, t), jnp.int32) if segment_ids_bt is None else segment_ids_bt.astype(jnp.int32)
    pos_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    q_btkge = grouped_queries(q_bthe, k_heads, e ** -0.5 if scale is None else scale)
    c = min(chunk or t, t)
    reach = t if window is None else (-(-(window - 1) // c) + 1) * c  # keys one query chunk reads
    if reach >= t:
        return fold_block(q_btkge, pos_bt, seg_bt, k_btke, v_btke, pos_bt, seg_bt,
                          empty_carry(b, t, k_heads, g, v_btke.shape[-1], sinks_h), chunk, window, softcap)
    if t % c:
        raise ValueError(f"chunked attention: sequence length {t} is not a multiple of the chunk {c}")

    def query_chunk(i):
        def rows(x, start, size):
            return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)
        first_key = jnp.maximum((i + 1) * c - reach, 0)
        keys = (rows(x, first_key, reach) for x in (k_btke, v_btke, pos_bt, seg_bt))
        return fold_block(rows(q_btkge, i * c, c), rows(pos_bt, i * c, c), rows(seg_bt, i * c, c), *keys,
                          empty_carry(b, c, k_heads, g, v_btke.shape[-1], sinks_h), c, window, softcap)

    m_nbkgc, l_nbkgc, acc_nbckge = jax.lax.map(query_chunk, jnp.arange(t // c))
    m_bkgt, l_bkgt = (jnp.moveaxis(x, 0, 3).reshape(b, k_heads, g, t) for x in (m_nbkgc, l_nbkgc))
    return m_bkgt, l_bkgt, jnp.moveaxis(acc_nbckge, 0, 1).reshape(b, t, k_heads, g, v_btke.shape[-1])


# ----------------------------------------------------------------------------- splash (TPU)


@functools.lru_cache(maxsize=32)
def _splash_kernel(g: int, t: int, interpret: bool, window: int | None = None, softcap: float | None = None):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk,
        splash_attention_mask as sm,
    )
    blk = min(512, t)
    sizes = sk.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk,
                          block_kv_dkv=blk, block_kv_dkv_compute=blk, block_q_dq=blk, block_kv_dq=blk)
    one = sm.CausalMask((t, t)) if window is None else sm.LocalMask((t, t), (window - 1, 0), offset=0)
    mask = sm.MultiHeadMask([one] * g)
    with jax.ensure_compile_time_eval():  # concrete mask arrays: the cached kernel serves several traces
        return sk.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret,
                                  attn_logits_soft_cap=softcap)


def _splash_local(shard, q_btkge, k_btke, v_btke, seg_bt, sinks_kg=None, *, interpret: bool, window: int | None = None,
                  scale: float, softcap: float | None = None):
    """Splash on one shard: vmap over batch and key heads of the MQA kernel (G query heads; the
    kernel takes their attention sinks, (G,) per key head)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    b, t, k_heads, g, e = q_btkge.shape
    kernel = _splash_kernel(g, t, interpret, window, softcap)
    q_bkgte = (q_btkge * jnp.asarray(scale, q_btkge.dtype)).transpose(0, 2, 3, 1, 4)  # the kernel does not scale
    k_bkte, v_bkte = k_btke.transpose(0, 2, 1, 3), v_btke.transpose(0, 2, 1, 3)

    def one(q_gte, k_te, v_te, seg_t, sinks_g):
        return kernel(q_gte, k_te, v_te, segment_ids=sk.SegmentIds(q=seg_t, kv=seg_t), sinks=sinks_g)

    sinks_axis = None if sinks_kg is None else 0
    per_head = jax.vmap(one, in_axes=(0, 0, 0, None, sinks_axis))
    o_bkgte = jax.vmap(per_head, in_axes=(0, 0, 0, 0, None))(q_bkgte, k_bkte, v_bkte, seg_bt, sinks_kg)
    return o_bkgte.transpose(0, 3, 1, 2, 4)  # (B, T, K, G, E)


def splash(q_bthe, k_btke, v_btke, segment_ids_bt=None, *, constrain=None, interpret: bool = False,
           window: int | None = None, scale: float | None = None, softcap: float | None = None, sinks_h=None):
    b, t, h, e = q_bthe.shape
    k_heads = k_btke.shape[2]
    seg_bt = jnp.zeros((b, t), jnp.int32) if segment_ids_bt is None else segment_ids_bt.astype(jnp.int32)
    q_btkge = q_bthe.reshape(b, t, k_heads, h // k_heads, e)  # query head h = k G + g uses key head k
    # the sequence stays whole inside (a causal kernel needs every earlier key)
    names_q = ("batch", None, "kv_heads", None, None)
    names_kv = ("batch", None, "kv_heads", None)
    sinks = () if sinks_h is None else (sinks_h.astype(jnp.float32).reshape(k_heads, h // k_heads),)
    local = (constrain or no_constraint).shard_map(
        functools.partial(_splash_local, interpret=interpret, window=window, softcap=softcap,
                          scale=e ** -0.5 if scale is None else scale),
        (names_q, names_kv, names_kv, ("batch", None), *((("kv_heads", None),) if sinks else ())), names_q)
    return local(q_btkge, k_btke, v_btke, seg_bt, *sinks).reshape(b, t, h, e)


# ----------------------------------------------------------------------------- ring (context parallelism)
# Each device keeps its queries and passes its key/value block (with the blocks' positions and
# segment ids) around the ring of the n devices that split `seq` (`shard.ring_shift`, a ppermute):
# in each of n steps it first issues the transfer of the block it holds to the next device, then
# folds that block into its online softmax (`fold_block`), so the transfer overlaps the block's
# computation. After n steps every query has seen every key; no device ever holds the whole
# sequence's keys and values.
#
# Masks come from the positions that travel with each block (query position >= key position, and
# equal segment ids for packed documents), so the layout of the sequence is free. The trainer uses
# the causal load-balanced one: the sequence cut into 2n chunks, device i holding chunks i and
# 2n-1-i, so every device has the same number of query-key pairs below the diagonal (with a plain
# split the last device would have n times the first's). Every block is computed in full with its
# mask: 2x the FLOPs that skipping the masked half would need, equal on every device. Splash's
# kernels take a static mask, and a ring step's mask depends on the device, so ring steps run the
# chunked blocks under `splash` too.


def load_balanced_order(t: int, n: int) -> np.ndarray:
    """Positions 0..t-1 in the order that puts chunks i and 2n-1-i (of 2n) on device i."""
    chunks = np.arange(t).reshape(2 * n, t // (2 * n))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def _ring_local(shard, q_bthe, k_btke, v_btke, pos_bt, seg_bt, sinks_h=None, *, chunk, window=None, scale,
                softcap=None):
    """One device's queries against every device's keys/values, passed around the `seq` ring."""
    b, t, h, e = q_bthe.shape
    k_heads = k_btke.shape[2]
    n = shard.size("seq")
    q_bqkge = grouped_queries(q_bthe, k_heads, scale)
    carry = empty_carry(b, t, k_heads, h // k_heads, e, sinks_h)

    def step(state, _):
        kv, carry = state
        nxt = shard.ring_shift(kv, "seq")  # issued first: the transfer overlaps this block's compute
        return (nxt, fold_block(q_bqkge, pos_bt, seg_bt, *kv, carry, chunk, window, softcap)), None

    kv = (k_btke, v_btke, pos_bt, seg_bt)
    if n > 1:
        (kv, carry), _ = jax.lax.scan(step, (kv, carry), None, length=n - 1)
    carry = fold_block(q_bqkge, pos_bt, seg_bt, *kv, carry, chunk, window, softcap)  # the last block: no transfer
    return normalised(carry, q_bthe.dtype)


def ring(q_bthe, k_btke, v_btke, positions_bt=None, segment_ids_bt=None, *, constrain, chunk=None, window=None,
         scale=None, softcap=None, sinks_h=None):
    """Causal attention with the sequence split over `seq` (see above); `chunk`: key/query chunk
    of each ring step's block (None: the whole block at once)."""
    bt = q_bthe.shape[:2]
    seg_bt = jnp.zeros(bt, jnp.int32) if segment_ids_bt is None else segment_ids_bt.astype(jnp.int32)
    pos_bt = jnp.arange(bt[1]) if positions_bt is None else positions_bt
    pos_bt = jnp.broadcast_to(pos_bt, bt).astype(jnp.int32)
    names_q, names_kv = ("batch", "seq", "heads", None), ("batch", "seq", "kv_heads", None)
    scale = q_bthe.shape[-1] ** -0.5 if scale is None else scale
    names_in = (names_q, names_kv, names_kv, ("batch", "seq"), ("batch", "seq"))
    sinks = () if sinks_h is None else (sinks_h,)
    local = constrain.shard_map(functools.partial(_ring_local, chunk=chunk, window=window, scale=scale,
                                                  softcap=softcap),
                                (*names_in, *((("heads",),) if sinks else ())), names_q)
    return local(q_bthe, k_btke, v_btke, pos_bt, seg_bt, *sinks)
