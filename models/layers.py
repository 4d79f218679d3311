"""Building blocks the models share: parameters with logical axis names, stacked layers and the rolled
layer scan, matmuls and embedding lookups in the form that suits the compilers. Nothing here takes a
mesh or a sharding: activations are constrained through the `constrain` a model is handed
(models/contract.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models import quant

# Logical names of every dimension of the activations models constrain (the rules map each to mesh axes).
BTD = ("batch", "seq", "activation_embed")
BTF = ("batch", "seq", "mlp")
BTV = ("batch", "seq", "vocab")


def param(rngs: nnx.Rngs, init, shape, names) -> nnx.Param:
    """A parameter annotated with logical axis names (sharded later by the trainer)."""
    return nnx.Param(init(rngs.params(), shape), out_sharding=tuple(names), eager_sharding=False)


def gathered(var: nnx.Variable, constrain):
    """A weight as a matmul reads it: whole along the model dimension (`embed`, which FSDP splits),
    its other dimensions split as stored; FSDP's all-gather before use, made explicit (its gradient:
    a reduce-scatter). Left to the partitioner, a weight split along the dimension a matmul contracts
    becomes a windowed loop (the TPU compiler's collective matmul) that reads and writes the whole
    output once per window, 16 times for embed over 32 devices; the weight is the small operand."""
    w = var[...]
    names = tuple(var.get_metadata().get("out_sharding") or ())[-w.ndim:] if w.ndim else ()
    if "embed" not in names or constrain.size("embed") == 1:
        return w
    return constrain(w, tuple(None if n == "embed" else n for n in names))


def stacked(make_block, n_layers: int, rngs: nnx.Rngs):
    """`n_layers` copies of a block, parameters stacked on a leading `layers` axis."""
    @nnx.split_rngs(splits=n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(r):
        return make_block(r)
    return make(rngs)


def scan_layers(body, x, xs, kinds=(), unroll: int = 1):
    """`lax.scan` of `body(x, layer_xs, kind) -> (x, y)` over the leading (layer) axis of `xs`,
    returning (x, ys stacked over the layers). Layers of several kinds (`kinds`, a repeating group
    of G: a model's layer_pattern) keep a rolled scan: it runs over groups of G layers, each
    iteration the G kinds in turn (the program grows with G, not with depth), and the L mod G
    layers after the last whole group follow the pattern's first kinds. `unroll`: iterations per
    loop trip. No kinds: kind is None."""
    if len(kinds) <= 1:
        kind = kinds[0] if kinds else None
        return jax.lax.scan(lambda c, layer: body(c, layer, kind), x, xs, unroll=unroll)
    g, n = len(kinds), jax.tree.leaves(xs)[0].shape[0]
    whole = n - n % g

    def group(c, group_xs):
        ys = []
        for j, kind in enumerate(kinds):
            c, y = body(c, jax.tree.map(lambda a, j=j: a[j], group_xs), kind)
            ys.append(y)
        return c, jax.tree.map(lambda *a: jnp.stack(a), *ys)
    grouped = jax.tree.map(lambda a: a[:whole].reshape(whole // g, g, *a.shape[1:]), xs)  # (L/G, G, ...)
    x, ys = jax.lax.scan(group, x, grouped, unroll=unroll)
    ys = [jax.tree.map(lambda a: a.reshape(whole, *a.shape[2:]), ys)]
    for i in range(whole, n):  # the last, partial group
        x, y = body(x, jax.tree.map(lambda a, i=i: a[i], xs), kinds[i - whole])
        ys.append(jax.tree.map(lambda a: a[None], y))
    return x, jax.tree.map(lambda *a: jnp.concatenate(a), *ys) if len(ys) > 1 else ys[0]


class Stages(nnx.Module):
    """Stacks of blocks of different kinds run one after the other, each its own rolled scan
    (DeepSeek's first dense layers, then the MoE ones): `stages` in order."""

    def __init__(self, **stacks):
        self.names = tuple(stacks)
        for name, stack in stacks.items():
            setattr(self, name, stack)

    def stages(self):
        return [getattr(self, name) for name in self.names]


def scan_blocks(blocks, x, wrap=lambda body: body, segment_ids=None, positions=None, unroll: int = 1):
    """Runs stacked blocks in order with a rolled lax.scan (`unroll` iterations per loop trip), so
    the program does not grow with depth; `wrap` decorates the per-layer body (remat). Blocks with a
    `kinds` pattern (models/gpt.py, model.layer_pattern) are called with each layer's kind and
    scanned a group of layers at a time (`scan_layers`).

    A block returns `x` or `(x, aux)`, `aux` a dict of scalar auxiliary losses (an MoE router's);
    then this returns `(x, aux)` with each loss summed over the layers, for the trainer to add.
    An aux entry that is not a scalar is a statistic for the model's `update_state` (an MoE router's
    load per expert), kept per layer: (L, ...)
    `Stages` run stage after stage."""
    if isinstance(blocks, Stages):
        aux = {}
        for stage in blocks.stages():
            out = scan_blocks(stage, x, wrap, segment_ids, positions, unroll)
            x, more = out if isinstance(out, tuple) else (out, {})
            aux = {k: jnp.concatenate([aux[k], more[k]]) if k in aux and k in more and jnp.ndim(more[k])
                   else aux.get(k, 0) + more.get(k, 0) for k in {*aux, *more}}
        return (x, aux) if aux else x
    graphdef, state = nnx.split(blocks)
    kinds = tuple(getattr(blocks, "kinds", ()))

    def layer(kind):
        @wrap
        def run(x, layer_state):
            block = nnx.merge(graphdef, layer_state)
            out = block(x, segment_ids, positions) if kind is None else block(x, segment_ids, positions, kind=kind)
            return out if isinstance(out, tuple) else (out, {})
        return run
    runs = {kind: layer(kind) for kind in set(kinds) or {None}}
    x, aux = scan_layers(lambda x, layer_state, kind: runs[kind](x, layer_state), x, state, kinds, unroll)
    return (x, {k: a.sum(0) if a.ndim == 1 else a for k, a in aux.items()}) if aux else x


# The helpers below are the models' own arithmetic written in a form that suits the compilers, not
# parallelism: they take no mesh and no sharding (models import nothing from shardtrain). Each computes
# exactly what the plain form would (an einsum, a gather).


def flat_matmuls(constrain) -> bool:
    """Whether `dense` runs as one 2D matmul (flat=True) under `constrain`: not when the sequence is
    split (context parallelism), and not on TPUs, where a weight reshaped to 2D is FSDP-gathered a
    second time, transposed, for the backward (Llama-3: 3 of a layer's 7 weights gathered 3 times
    instead of twice)."""
    return constrain.size("seq") == 1 and constrain.platform != "tpu"


def dense(x, w, n_in=1, flat=True, quantization="none", row_groups=1):
    """Contracts the last `n_in` dims of x with the first `n_in` of w, as one 2D matmul: the same
    numbers as `einsum("...k,k...")`, and XLA's CPU backend runs (N, K) @ (K, M) much faster than a
    batched einsum, backward too (the simulated-device tests and demo run on CPU). `flat=False`
    keeps x's leading dims (a tensordot): when both batch and sequence are split over devices
    (context parallelism) XLA cannot merge them without gathering the sequence. `quantization`
    (int8 / fp8) quantizes both operands forward and backward (models/quant.py); `row_groups`: the
    ways x's leading (batch) dim is split over devices, which the weight gradient's groups follow."""
    lead, k = x.shape[:x.ndim - n_in], math.prod(w.shape[:n_in])
    if quantization != "none":
        x_k = x.reshape(-1, k) if flat else x.reshape(*lead, k)
        return quant.dot(x_k, w.reshape(k, -1), quantization, row_groups).reshape(*lead, *w.shape[n_in:])
    if not flat:
        return jnp.tensordot(x, w, axes=n_in)
    return (x.reshape(-1, k) @ w.reshape(k, -1)).reshape(*lead, *w.shape[n_in:])


def embed_lookup(table_vd, tokens_bt, how: str = "gather", flat: bool = True):
    """Token embeddings: `gather` takes rows of the table (no B x T x V intermediate, no 2 V D
    FLOPs per token); `one_hot` is a one-hot matmul, which shards cleanly over a vocab-sharded
    table (a gather from one makes XLA replicate the table) and is fast for tiny vocabularies."""
    if how == "one_hot":
        return dense(jax.nn.one_hot(tokens_bt, table_vd.shape[0], dtype=table_vd.dtype), table_vd, flat=flat)
    return jnp.take(table_vd, tokens_bt, axis=0)


def lookup_table(table_vd, constrain):
    """The embedding table as a lookup reads it when its vocabulary is split over devices (e.g.
    rules.vocab=tensor): whole along the model dimension (FSDP gathers it, as it does every weight
    before use), so each vocab shard looks up its own rows and one all-reduce sums them (Megatron's
    vocab-parallel embedding) and the rows come out split like the batch. From a table still split
    along the model dimension the partitioner could only reach that by replicating the looked-up
    rows (XLA's "[SPMD] Involuntary full rematerialization"). An unsplit vocabulary is left alone."""
    return constrain(table_vd, ("vocab", None)) if constrain.size("vocab") > 1 else table_vd


def matmul_params(cfg, n_params: int) -> int:
    """The parameters a token's forward pass multiplies with: all of them but a separate embedding
    table read by gather (a lookup, no FLOPs; a tied table is the unembedding's matmul)."""
    looked_up = cfg.embed == "gather" and not getattr(cfg, "tie_embeddings", False)
    return n_params - (cfg.vocab_size * cfg.d_model if looked_up else 0)
