"""Logical axis names -> PartitionSpecs through the rules table, with loud errors.

Models annotate parameters (flax NNX `sharding_names`) and activations (`Constrain`) with
logical names only; this module is the one place where those names meet mesh axes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Any, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from shardtrain.config import ConfigError, RulesConfig

LOGICAL_AXES = tuple(f.name for f in dataclasses.fields(RulesConfig))


def spec_for(names: Sequence[str | None], rules: RulesConfig, mesh: Mesh, *, shape=None,
             what: str = "array") -> P:
    """PartitionSpec for an array whose dimensions carry `names` (None = replicated).

    Mesh axes of size 1 are dropped (they cost nothing and keep specs readable). Raises
    ConfigError for an unknown logical name, a mesh axis used twice, or (given `shape`) a
    dimension its mesh axes do not divide.
    """
    used: dict[str, str] = {}
    spec = []
    for dim, name in enumerate(names):
        if name is None:
            spec.append(None)
            continue
        if name not in LOGICAL_AXES:
            raise ConfigError(f"{what}: unknown logical axis '{name}'; rules define: {', '.join(LOGICAL_AXES)}")
        rule = getattr(rules, name)
        axes = [a for a in ((rule,) if isinstance(rule, str) else rule or ()) if mesh.shape[a] > 1]
        for a in axes:
            if a in used:
                raise ConfigError(f"{what}: mesh axis '{a}' is used twice in one PartitionSpec (by logical "
                                  f"axes '{used[a]}' and '{name}'); change rules.{name} or rules.{used[a]}")
            used[a] = name
        if shape is not None and axes:
            ways = 1
            for a in axes:
                ways *= mesh.shape[a]
            if shape[dim] % ways:
                raise ConfigError(f"{what}: dimension {dim} ('{name}') of size {shape[dim]} is not divisible by "
                                  f"mesh axes {'x'.join(axes)} = {ways}; change the mesh or rules.{name}")
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return P(*spec)


def logical_names(abstract_state: nnx.State) -> dict:
    """Pure dict (same structure as the parameters) of each parameter's logical axis names."""
    def names(v):
        n = v.get_metadata().get("out_sharding")
        return tuple(n) if n is not None else (None,) * len(v.shape)
    return nnx.to_pure_dict(jax.tree.map(names, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def path_str(path) -> str:
    """'params/blocks/w_in_df' for a pytree key path (dict keys, sequence indices, attributes)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def param_specs(abstract_params: dict, names: dict, rules: RulesConfig, mesh: Mesh) -> dict:
    """PartitionSpec for every parameter; errors name the parameter path."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x, n: spec_for(n, rules, mesh, shape=x.shape, what=f"parameter {path_str(path)} {x.shape}"),
        abstract_params, names, is_leaf=lambda x: isinstance(x, tuple))


def named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


@dataclasses.dataclass(frozen=True)
class Constrain:
    """Activation sharding constraint by logical names: `constrain(x_btd, ("batch", "seq", None))`.

    Built by the trainer from the rules and mesh and handed to the model; the default
    (`mesh=None`) does nothing, so models also run unsharded.
    """

    rules: RulesConfig = RulesConfig()
    mesh: Mesh | None = None

    def __call__(self, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
        if self.mesh is None:
            return x
        spec = spec_for(names, self.rules, self.mesh, shape=x.shape, what=f"activation {names} {x.shape}")
        # inside a shard_map (e.g. the pipeline's, manual over `pipeline`) constrain the other axes
        # on the current abstract mesh, whose manual axes the spec must not name
        current = jax.sharding.get_abstract_mesh()
        mesh = current if current.manual_axes else self.mesh
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    def mesh_axes(self, name: str) -> tuple[str, ...]:
        """Mesh axes (of size > 1) that logical axis `name` is split over; () without a mesh."""
        if self.mesh is None:
            return ()
        rule = getattr(self.rules, name)
        return tuple(a for a in ((rule,) if isinstance(rule, str) else rule or ()) if self.mesh.shape[a] > 1)

    def size(self, name: str) -> int:
        """Ways logical axis `name` is split (1 without a mesh): a model asks `size("seq")` to pick
        ring attention, never which mesh axes those are."""
        return math.prod(self.mesh.shape[a] for a in self.mesh_axes(name)) if self.mesh is not None else 1

    def per_shard(self, fn, in_names, out_names):
        """`fn(shard, *local_arrays)` run on each device's shards (a `jax.shard_map` manual over
        every mesh axis not already manual), arrays split by logical names. `shard` (a `Shard`)
        offers collectives over logical axes, so the function never names a mesh axis. Without a
        mesh: `fn(Shard.UNSHARDED, *arrays)` on the whole arrays. `out_names`: one tuple of names,
        or a tuple of them for several outputs."""
        if self.mesh is None:
            return functools.partial(fn, Shard.UNSHARDED)
        current = jax.sharding.get_abstract_mesh()
        mesh = current if current.manual_axes else self.mesh
        free = frozenset(a for a in self.mesh.axis_names if a not in current.manual_axes)
        axes = {n: self.mesh_axes(n) for n in LOGICAL_AXES}
        shard = Shard({n: a for n, a in axes.items() if a and set(a) <= free},
                      {a: int(self.mesh.shape[a]) for a in free})

        def spec(names):
            return spec_for(names, self.rules, self.mesh, what=f"per-shard array {tuple(names)}")
        many = bool(out_names) and all(isinstance(n, tuple) for n in out_names)
        out_specs = tuple(spec(n) for n in out_names) if many else spec(out_names)
        return jax.shard_map(functools.partial(fn, shard), mesh=mesh, in_specs=tuple(spec(n) for n in in_names),
                             out_specs=out_specs, axis_names=set(free))


@dataclasses.dataclass(frozen=True)
class Shard:
    """Collectives over logical axes inside `Constrain.per_shard` (identity when unsharded)."""

    axes: dict
    """logical name -> its mesh axes (size > 1, manual here); absent names are not split."""
    sizes: dict
    """manual mesh axis -> size."""

    UNSHARDED: typing.ClassVar["Shard"]

    def size(self, name: str) -> int:
        return math.prod(self.sizes[a] for a in self.axes.get(name, ()))

    def index(self, name: str):
        """This device's position along logical axis `name` (0 when not split)."""
        index = 0
        for a in self.axes.get(name, ()):
            index = index * self.sizes[a] + jax.lax.axis_index(a)
        return index

    def psum(self, x, name: str):
        axes = self.axes.get(name, ())
        return jax.lax.psum(x, axes) if axes else x

    def all_gather(self, x, name: str, axis: int):
        """The whole of dimension `axis`, which is split over logical axis `name`."""
        axes = self.axes.get(name, ())
        return jax.lax.all_gather(x, axes, axis=axis, tiled=True) if axes else x

    def all_to_all(self, x, name: str, axis: int = 0):
        """Block j of dimension `axis` (size = size(name)) goes to device j along `name`; block i of
        the result came from device i."""
        axes = self.axes.get(name, ())
        return jax.lax.all_to_all(x, axes, axis, axis, tiled=True) if axes else x

    def ring_shift(self, x, name: str):
        """Each device's `x` (a pytree) to the next device along `name` (the last to the first)."""
        axes = self.axes.get(name, ())
        if not axes:
            return x
        n = self.size(name)
        return jax.lax.ppermute(x, axes, [(i, (i + 1) % n) for i in range(n)])

    def like(self, x, *refs):
        """`x` (created inside, e.g. a loop carry's zeros) varying over the mesh axes `refs` vary over."""
        vma = set()
        for ref in refs:
            vma |= getattr(getattr(jax.typeof(ref), "manual_axis_type", None), "varying", frozenset())
        vma -= getattr(getattr(jax.typeof(x), "manual_axis_type", None), "varying", frozenset())
        return jax.lax.pcast(x, tuple(sorted(vma)), to="varying") if vma else x


Shard.UNSHARDED = Shard({}, {})
