"""What a model may ask of the trainer: `Constraint` (the `constrain` a model is built with: activation
sharding by logical names, the ways a logical axis is split, a per-device `shard_map`) and `Collectives`
(what a shard_map'd function gets: collectives over logical axes). The trainer's implementations are in
shardtrain/parallel/sharding.py; the do-nothing ones for an unsharded model are here (`no_constraint`,
`Whole`), with `ragged_all_to_all_by_blocks`, the ragged all-to-all written with a dense one (one
device, and XLA:CPU, which has no ragged-all-to-all)."""

from __future__ import annotations

import functools
import typing

import jax.numpy as jnp


class Collectives(typing.Protocol):
    """What `Constraint.shard_map`'s `fn` gets first: collectives over logical axes (identities on
    an axis that is not split). The trainer's is `shardtrain.parallel.sharding.Shard`; unsharded, `Whole`."""

    def size(self, name: str) -> int: ...
    def index(self, name: str): ...
    def psum(self, x, name: str): ...
    def pmax(self, x, name: str): ...
    def all_gather(self, x, name: str, axis: int): ...
    def all_to_all(self, x, name: str, axis: int = 0): ...
    def ragged_all_to_all(self, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                          name: str): ...
    def ring_shift(self, x, name: str): ...


class Constraint(typing.Protocol):
    """The `constrain` a model is built with. The trainer's is `shardtrain.parallel.sharding.Constrain`;
    unsharded, `no_constraint`."""

    @property
    def platform(self) -> str | None: ...
    def __call__(self, x, names): ...
    def size(self, name: str) -> int: ...
    def shard_map(self, fn, in_names, out_names): ...


class Whole:
    """The `Collectives` of unsharded arrays: every logical axis whole, collectives are identities."""

    def size(self, name):
        return 1

    def index(self, name):
        return 0

    def psum(self, x, name):
        return x

    def pmax(self, x, name):
        return x

    def all_gather(self, x, name, axis):
        return x

    def all_to_all(self, x, name, axis=0):
        return x

    def ragged_all_to_all(self, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, name):
        return ragged_all_to_all_by_blocks(lambda x: x, operand, output, input_offsets, send_sizes,
                                           output_offsets, recv_sizes)

    def ring_shift(self, x, name):
        return x


def ragged_all_to_all_by_blocks(all_to_all, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    """`jax.lax.ragged_all_to_all`'s result (for slices of `operand` that do not overlap) from a dense
    all-to-all of P blocks of operand's size: for one device and for XLA:CPU, which has no
    ragged-all-to-all. `all_to_all(x)` sends block j of x's leading axis to device j."""
    p, n, m = send_sizes.shape[0], operand.shape[0], output.shape[0]
    row_pn = jnp.arange(n)[None, :]
    spare_pn = jnp.arange(p * n).reshape(p, n)  # distinct indices out of range, for rows not sent
    take_pn = jnp.where(row_pn < send_sizes[:, None], input_offsets[:, None] + row_pn, n + spare_pn)
    blocks = operand.at[take_pn.reshape(-1)].get(mode="fill", fill_value=0, unique_indices=True)
    blocks = all_to_all(blocks.reshape(p, n, *operand.shape[1:]))  # block i: what device i sent here
    at_p = all_to_all(output_offsets)  # where device i's rows go in this device's output
    put_pn = jnp.where(row_pn < recv_sizes[:, None], at_p[:, None] + row_pn, m + spare_pn)
    return output.at[put_pn.reshape(-1)].set(blocks.reshape(p * n, *operand.shape[1:]), mode="drop",
                                             unique_indices=True)


class NoConstraint:
    """The `Constraint` a model gets when nobody shards it: no constraints, one shard, the default backend."""

    platform = None

    def __call__(self, x, names):
        return x

    def size(self, name):
        return 1

    def shard_map(self, fn, in_names, out_names):
        return functools.partial(fn, Whole())


no_constraint = NoConstraint()
