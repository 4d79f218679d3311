"""train.offload.optimizer: the optimizer's update with its state in the host's pinned memory,
streamed through the device a slice at a time.

Brought in whole (one `jax.device_put` of the state in the step), the TPU compiler starts every
host-to-device copy at the program's start (a copy of an argument depends on nothing, and no
barrier orders it after the backward pass), so the moments sit in device memory through the
forward and backward passes and the device total barely drops. Here the update runs in a loop
of n_layers iterations: iteration i slices the i-th part of every parameter along an axis the
mesh does not split (`stream_axis`: the layer axis of the stacked layers; an embedding's axis
where its parts are whole TPU tiles), brings that part's state in, updates it and the parameter
in place and sends the state back. A copy whose slice depends on the loop index cannot start
before the loop reaches it, so about 1/n_layers of the state is on the device at a time, after
the backward pass. Parameters without such an axis (norm scales; an embedding whose rows do not
split into whole tiles) are updated whole after the loop.

Exact: global-norm clipping sees every gradient first, then the optimizer runs on each part with
the other parts' leaves as `optax.MaskedNode`s. That is the same arithmetic as the whole update
for an optimizer that treats each element alone (`STREAMED`); the others (Adafactor's factored
statistics, Muon's orthogonalisation) and LoRA bring their state in whole (`streams`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax

from shardtrain import optim
from shardtrain.config import RunConfig

STREAMED = ("adamw", "lion")
"""Optimizers whose update of a slice of a parameter is that slice of the parameter's update."""


def streams(cfg: RunConfig, platform: str) -> bool:
    """Whether the offloaded optimizer state is streamed (else brought in whole): on TPUs, whose
    compiler needs it. The CPU and XLA:GPU compilers start a whole copy where it is used, and keep
    the update's arithmetic bit for bit the plain run's (the CPU compiler fuses a streamed slice's
    update differently: its parameters differ from the plain run's in the last bit)."""
    o = cfg.train.offload
    return o.optimizer and platform == "tpu" and cfg.optimizer.name in STREAMED and cfg.model.lora.rank == 0


WHOLE, COUNTER = -1, -2
"""`stream_axis` of a parameter updated whole, after the loop; the mark of a state leaf that is no
parameter's (a step counter)."""


def stream_axis(shape: tuple, sharding, parts: int) -> int:
    """The axis a parameter is sliced along into `parts` parts: the first one the mesh does not split
    whose length `parts` divides, a leading one or one whose parts are whole TPU tiles (the TPU
    compiler may lay either of the last two axes out as the 128-wide minor one, and a slice across
    its tiles does not compile), else WHOLE."""
    spec, rank = (*sharding.spec, *(None,) * len(shape)), len(shape)
    fits = (a for a, n in enumerate(shape)
            if spec[a] is None and n % parts == 0 and (a < rank - 2 or n // parts % 128 == 0))
    return next(fits, WHOLE) if parts > 1 else WHOLE


def streamed_update(cfg: RunConfig, names: dict, param_shardings, opt_shardings) -> Callable:
    """(grads, opt, params) -> (params, opt): `optim.make`'s optimizer applied, with `opt` (and the
    returned state) in pinned host memory, its shardings `opt_shardings`: n_layers parts of every
    parameter (`stream_axis`) in turn, then the rest whole."""
    clip, inner, parts = optim.clipping(cfg), optim.unclipped(cfg, names), cfg.model.n_layers

    def update(grads, opt, params):
        clip_state, state = opt  # optim.clipped's chain
        grads, clip_state = clip.update(grads, clip_state)
        axes = jax.tree.map(lambda p, s: stream_axis(p.shape, s, parts), params, param_shardings)
        (flat_p, param_def), flat_g = jax.tree.flatten(params), jax.tree.leaves(grads)
        (flat_s, state_def), p_axes = jax.tree.flatten(state), param_def.flatten_up_to(axes)
        s_axes = state_def.flatten_up_to(optax.tree_map_params(  # a state leaf has its parameter's axis
            inner, lambda _, a: a, state, axes, transform_non_params=lambda _: COUNTER))
        host = state_def.flatten_up_to(opt_shardings[1])

        def masked(flat, flat_axes, keep, treedef):  # the tree with the leaves `keep` does not pick masked
            return treedef.unflatten([x if keep(a) else optax.MaskedNode() for x, a in zip(flat, flat_axes)])

        def apply(flat_g, flat_s, flat_p, keep):  # the leaves `keep` picks updated, their state brought in and back
            flat_s = [jax.device_put(x, h.with_memory_kind("device")) if keep(a) else x
                      for x, a, h in zip(flat_s, s_axes, host)]
            p = masked(flat_p, p_axes, keep, param_def)
            updates, new = inner.update(masked(flat_g, p_axes, keep, param_def),
                                        masked(flat_s, s_axes, lambda a: keep(a) or a == COUNTER, state_def), p)
            new = [jax.device_put(x, h) if keep(a) else x
                   for x, a, h in zip(state_def.flatten_up_to(new), s_axes, host)]
            return param_def.flatten_up_to(optax.apply_updates(p, updates)), new

        def streamed(a):
            return a >= 0

        def part(i, carry):  # the i-th part of every streamed parameter and its state, updated in place
            flat_p, flat_s = carry

            def sliced(xs, flat_axes):
                return [jax.lax.dynamic_slice_in_dim(x, i * (x.shape[a] // parts), x.shape[a] // parts, a)
                        if streamed(a) else x for x, a in zip(xs, flat_axes)]

            def put(xs, news, flat_axes):
                return [jax.lax.dynamic_update_slice_in_dim(x, n, i * (x.shape[a] // parts), a) if streamed(a) else x
                        for x, n, a in zip(xs, news, flat_axes)]
            new_p, new_s = apply(sliced(flat_g, p_axes), sliced(flat_s, s_axes), sliced(flat_p, p_axes), streamed)
            return put(flat_p, new_p, p_axes), put(flat_s, new_s, s_axes)

        flat_p, flat_s = jax.lax.fori_loop(0, parts, part, (flat_p, flat_s))
        new_p, new_s = apply(flat_g, flat_s, flat_p, lambda a: a == WHOLE)  # and the counters advance, once
        flat_p = [p if streamed(a) else n for p, n, a in zip(flat_p, new_p, p_axes)]
        flat_s = [s if streamed(a) else n for s, n, a in zip(flat_s, new_s, s_axes)]
        return param_def.unflatten(flat_p), (clip_state, state_def.unflatten(flat_s))
    return update
