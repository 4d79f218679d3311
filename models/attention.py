"""Causal grouped-query attention by implementation: one function the decoder calls.

    o_bthe = attend(q_bthe, k_btke, v_btke, segment_ids_bt=None, impl="auto", constrain=None, window=None)

Shapes: B batch, T sequence, H query heads, K key/value heads (K divides H, G = H / K queries per
key head), E head dim. q is not pre-scaled: every implementation scales scores by E**-0.5.
`segment_ids_bt` (int, one id per packed document) restricts attention to tokens of the same
document; None means one document per row. `window` W (sliding-window attention, Mistral's
`sliding_window`) lets query t see keys t - W + 1 .. t only; None: every earlier key.

- `xla`: `jax.nn.dot_product_attention`, which materialises the B x H x T x T scores. The reference;
  fastest on CPU at short T. A window is its `local_window_size` (W - 1, 0).
- `chunked`: flash-style in plain XLA: a scan over query chunks, inside it a scan over key chunks
  with an online softmax; never holds more than one chunk x chunk block of scores per head;
  recomputed in the backward pass. Any platform, long T without a kernel. With a window, each
  query chunk scans only the ceil((W - 1) / chunk) + 1 key chunks that can reach it.
- `splash`: Pallas splash attention (TPU kernel, block-sparse causal mask (a `LocalMask` with a
  window: blocks outside it are skipped), segment ids), one kernel
  per key head with its G query heads (MQA form, no repeat of k/v), in a `shard_map` over the batch
  and kv-head axes. TPU (tests run it with `interpret=True` on CPU).
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")` (flash attention; a window is
  cuDNN's sliding_window_length W). NVIDIA GPU.
- `auto`: splash on TPU, cudnn on GPU, xla on CPU.

`constrain` is the trainer's activation-sharding object (or None): `splash` needs a mesh to run
per shard and asks for it with `constrain.shard_map(fn, in_names, out_names)`, and
`constrain.platform` says which chip the program is compiled for; without them the kernel runs on
the whole arrays on the default backend. The model never sees the mesh.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

IMPLS = ("auto", "xla", "chunked", "splash", "cudnn")
CHUNK = 512
"""Query / key chunk of the `chunked` implementation (the whole sequence when shorter)."""


def resolve(impl: str, platform: str | None = None) -> str:
    """The implementation `auto` stands for on `platform` (default: the default backend's)."""
    if impl != "auto":
        if impl not in IMPLS:
            raise ValueError(f"unknown attention implementation '{impl}'; known: {', '.join(IMPLS)}")
        return impl
    platform = platform or jax.default_backend()
    return {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn"}.get(platform, "xla")


def attend(q_bthe, k_btke, v_btke, *, segment_ids_bt=None, impl: str = "auto", constrain=None,
           window: int | None = None):
    """Causal attention of q over k, v (see the module docstring); returns o_bthe in q's dtype.

    The platform (for `auto`, and for running splash compiled or in the Pallas interpreter) is
    `constrain.platform` (the mesh's devices: `tpu` when compiling for a TPU topology on a CPU
    host) or else the default backend; splash off TPU runs interpreted (CPU tests)."""
    platform = getattr(constrain, "platform", None) or jax.default_backend()
    impl = resolve(impl, platform)
    if impl == "xla" or impl == "cudnn":
        mask = None
        if segment_ids_bt is not None:
            mask = (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])[:, None]  # (B, 1, T, T)
        return jax.nn.dot_product_attention(q_bthe, k_btke, v_btke, mask=mask, is_causal=True, implementation=impl,
                                            local_window_size=None if window is None else (window - 1, 0))
    if impl == "chunked":
        return chunked(q_bthe, k_btke, v_btke, segment_ids_bt, window=window)
    return splash(q_bthe, k_btke, v_btke, segment_ids_bt, constrain=constrain, interpret=platform != "tpu",
                  window=window)


# ----------------------------------------------------------------------------- chunked XLA


def chunked(q_bthe, k_btke, v_btke, segment_ids_bt=None, chunk: int = CHUNK, window: int | None = None):
    """Flash attention in plain XLA: online softmax over key chunks, one query chunk at a time.
    Query chunk i scans key chunks i - R + 1 .. i (R = all chunks, or those a window reaches);
    chunk indices below 0 are masked out."""
    b, t, h, e = q_bthe.shape
    k_heads = k_btke.shape[2]
    g = h // k_heads
    c = min(chunk, t)
    if t % c:
        raise ValueError(f"chunked attention: sequence length {t} is not a multiple of the chunk {c}")
    n = t // c
    seg_bt = jnp.zeros((b, t), jnp.int32) if segment_ids_bt is None else segment_ids_bt.astype(jnp.int32)
    # (n, B, c, K, G, E) query chunks; (n, B, c, K, E) key / value chunks
    q_nbckge = (q_bthe * jnp.asarray(e ** -0.5, q_bthe.dtype)).reshape(b, n, c, k_heads, g, e).swapaxes(0, 1)
    k_nbcke = k_btke.reshape(b, n, c, k_heads, e).swapaxes(0, 1)
    v_nbcke = v_btke.reshape(b, n, c, k_heads, e).swapaxes(0, 1)
    seg_nbc = seg_bt.reshape(b, n, c).swapaxes(0, 1)
    pos_nc = jnp.arange(t).reshape(n, c)
    reach = n if window is None else min(n, -(-(window - 1) // c) + 1)  # key chunks one query chunk reads

    @jax.checkpoint  # the backward pass recomputes each query chunk instead of saving its scores
    def query_chunk(q_bckge, seg_q_bc, pos_q_c, i):
        def key_chunk(carry, r):
            m_bkgc, l_bkgc, acc_bckge = carry
            j = i - reach + 1 + r
            k_bcke, v_bcke, seg_k_bc, pos_k_c = (x[jnp.maximum(j, 0)] for x in (k_nbcke, v_nbcke, seg_nbc, pos_nc))
            s_bkgcs = jnp.einsum("bqkge,bske->bkgqs", q_bckge, k_bcke, preferred_element_type=jnp.float32)
            near_qs = pos_q_c[:, None] >= pos_k_c[None, :]
            if window is not None:
                near_qs &= pos_q_c[:, None] - pos_k_c[None, :] < window
            allowed_bqs = (near_qs & (j >= 0))[None] & (seg_q_bc[:, :, None] == seg_k_bc[:, None, :])
            s_bkgcs = jnp.where(allowed_bqs[:, None, None], s_bkgcs, -jnp.inf)
            m_new = jnp.maximum(m_bkgc, s_bkgcs.max(-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with nothing allowed yet
            p_bkgcs = jnp.exp(s_bkgcs - m_safe[..., None])
            corr_bkgc = jnp.exp(m_bkgc - m_safe)
            l_new = l_bkgc * corr_bkgc + p_bkgcs.sum(-1)
            pv_bckge = jnp.einsum("bkgqs,bske->bqkge", p_bkgcs.astype(v_bcke.dtype), v_bcke,
                                  preferred_element_type=jnp.float32)
            acc_new = acc_bckge * corr_bkgc.transpose(0, 3, 1, 2)[..., None] + pv_bckge
            return (m_new, l_new, acc_new), None

        init = (jnp.full((b, k_heads, g, c), -jnp.inf, jnp.float32), jnp.zeros((b, k_heads, g, c), jnp.float32),
                jnp.zeros((b, c, k_heads, g, e), jnp.float32))
        (_, l_bkgc, acc_bckge), _ = jax.lax.scan(key_chunk, init, jnp.arange(reach))
        return acc_bckge / l_bkgc.transpose(0, 3, 1, 2)[..., None]

    o_nbckge = jax.lax.map(lambda args: query_chunk(*args), (q_nbckge, seg_nbc, pos_nc, jnp.arange(n)))
    return o_nbckge.swapaxes(0, 1).reshape(b, t, h, e).astype(q_bthe.dtype)


# ----------------------------------------------------------------------------- splash (TPU)


@functools.lru_cache(maxsize=32)
def _splash_kernel(g: int, t: int, interpret: bool, window: int | None = None):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk,
        splash_attention_mask as sm,
    )
    blk = min(512, t)
    sizes = sk.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk,
                          block_kv_dkv=blk, block_kv_dkv_compute=blk, block_q_dq=blk, block_kv_dq=blk)
    one = sm.CausalMask((t, t)) if window is None else sm.LocalMask((t, t), (window - 1, 0), offset=0)
    mask = sm.MultiHeadMask([one] * g)
    return sk.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def _splash_local(q_btkge, k_btke, v_btke, seg_bt, *, interpret: bool, window: int | None = None):
    """Splash on one shard: vmap over batch and key heads of the MQA kernel (G query heads)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    b, t, k_heads, g, e = q_btkge.shape
    kernel = _splash_kernel(g, t, interpret, window)
    q_bkgte = (q_btkge * jnp.asarray(e ** -0.5, q_btkge.dtype)).transpose(0, 2, 3, 1, 4)
    k_bkte, v_bkte = k_btke.transpose(0, 2, 1, 3), v_btke.transpose(0, 2, 1, 3)

    def one(q_gte, k_te, v_te, seg_t):
        return kernel(q_gte, k_te, v_te, segment_ids=sk.SegmentIds(q=seg_t, kv=seg_t))

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None))
    o_bkgte = jax.vmap(per_head)(q_bkgte, k_bkte, v_bkte, seg_bt)
    return o_bkgte.transpose(0, 3, 1, 2, 4)  # (B, T, K, G, E)


def splash(q_bthe, k_btke, v_btke, segment_ids_bt=None, *, constrain=None, interpret: bool = False,
           window: int | None = None):
    b, t, h, e = q_bthe.shape
    k_heads = k_btke.shape[2]
    seg_bt = jnp.zeros((b, t), jnp.int32) if segment_ids_bt is None else segment_ids_bt.astype(jnp.int32)
    q_btkge = q_bthe.reshape(b, t, k_heads, h // k_heads, e)  # query head h = k G + g uses key head k
    local = functools.partial(_splash_local, interpret=interpret, window=window)
    wrap = getattr(constrain, "shard_map", None)
    if wrap is not None:
        # the sequence stays whole inside (a causal kernel needs every earlier key)
        names_q = ("batch", None, "kv_heads", None, None)
        names_kv = ("batch", None, "kv_heads", None)
        local = wrap(local, (names_q, names_kv, names_kv, ("batch", None)), names_q)
    return local(q_btkge, k_btke, v_btke, seg_bt).reshape(b, t, h, e)
