"""Logical axis names -> PartitionSpecs through the rules table, with loud errors.

Models annotate parameters (flax NNX `sharding_names`) and activations (`Constrain`) with
logical names only; this module is the one place where those names meet mesh axes.
`param_layout(cfg, mesh)` is where a model's parameters meet them: one abstract trace of the
model gives its structure, every parameter's shape, logical names and sharding, nothing allocated
(the train step, generation and Hugging Face import/export all start from it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import models
from models import contract
from shardtrain.config import AxisRule, ConfigError, ModelConfig, RulesConfig, RunConfig, mesh_axes

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
        axes = [a for a in mesh_axes(getattr(rules, name)) if mesh.shape[a] > 1]
        for a in axes:
            if a in used:
                raise ConfigError(f"{what}: mesh axis '{a}' is used twice in one PartitionSpec (by logical "
                                  f"axes '{used[a]}' and '{name}'); change rules.{name} or rules.{used[a]}")
            used[a] = name
        if shape is not None and axes:
            ways = axes_size(mesh, axes)
            if shape[dim] % ways:
                raise ConfigError(f"{what}: dimension {dim} ('{name}') of size {shape[dim]} is not divisible by "
                                  f"mesh axes {'x'.join(axes)} = {ways}; change the mesh or rules.{name}")
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return P(*spec)


def axes_size(mesh: Mesh, axes: AxisRule) -> int:
    """How many ways `axes` (a rule, a PartitionSpec entry or a tuple of mesh axes) split a dimension."""
    return math.prod(mesh.shape[a] for a in mesh_axes(axes))


def shard_bytes(tree) -> int:
    """Bytes per device of a tree of ShapeDtypeStructs (or arrays) with shardings (every device
    holds the same amount, since every sharded dimension divides)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


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


def model_class(cfg: RunConfig):
    """The model class that model.name names (ConfigError for an unknown name)."""
    try:
        return models.get(cfg.model.name)
    except models.UnknownModel as e:
        raise ConfigError(str(e)) from None


def check_adapters(cfg: RunConfig) -> None:
    """model.lora.targets against the weights the model class publishes as adaptable for this model
    config (`adaptable(model_cfg)`: parameter name -> Hugging Face module name, either may be named)."""
    if cfg.model.lora.rank == 0:
        return
    adaptable = model_class(cfg).adaptable(cfg.model)
    if not adaptable:
        raise ConfigError(f"model.lora.rank > 0: model.name={cfg.model.name} has no weights LoRA can adapt; "
                          "set model.lora.rank=0")
    for target in cfg.model.lora.targets:
        if target not in adaptable and target not in adaptable.values():
            raise ConfigError(f"model.lora.targets: unknown weight '{target}' for this model; choose from "
                              f"{', '.join(adaptable)} (or {', '.join(adaptable.values())})")


def abstract_model(cfg: RunConfig, constrain=contract.no_constraint):
    """The model with ShapeDtypeStructs for parameters: one trace of its constructor, nothing allocated
    (after the LoRA targets are checked against the model)."""
    check_adapters(cfg)
    cls = model_class(cfg)
    return nnx.eval_shape(lambda: cls(cfg.model, rngs=nnx.Rngs(0), constrain=constrain,
                                      quantization=cfg.train.quantization))


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """A model's parameters on a mesh, without allocating them (`param_layout`)."""

    model_class: type
    model: ModelConfig
    mesh: Mesh
    graphdef: Any
    """The model's structure; its activations are constrained by the rules on the mesh."""
    params: dict
    """ShapeDtypeStructs in train.param_dtype carrying their NamedShardings (pure nested dict)."""
    names: dict
    """Logical axis names of every parameter (same tree as params)."""
    shardings: dict
    """NamedSharding of every parameter (same tree as params)."""

    def init(self, key: jax.Array) -> dict:
        """Parameters drawn by the model's own initialisers from `key`, in the layout's dtypes (jit
        it with out_shardings=self.shardings to create them already sharded)."""
        model = self.model_class(self.model, rngs=nnx.Rngs(params=key))
        return jax.tree.map(lambda p, a: p.astype(a.dtype), nnx.to_pure_dict(nnx.state(model)), self.params)


def param_layout(cfg: RunConfig, mesh: Mesh) -> ParamLayout:
    """The parameters of cfg's model on `mesh` by cfg's rules (ConfigError naming a parameter whose
    dimension the mesh axes do not divide). Traces the model once (`abstract_model`)."""
    graphdef, state = nnx.split(abstract_model(cfg, Constrain(cfg.rules, mesh)))
    names = logical_names(state)
    param_dtype = jnp.dtype(cfg.train.param_dtype)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, param_dtype), nnx.to_pure_dict(state))
    shardings = named(mesh, param_specs(shapes, names, cfg.rules, mesh))
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    return ParamLayout(model_class(cfg), cfg.model, mesh, graphdef, params, names, shardings)


@dataclasses.dataclass(frozen=True)
class Constrain:
    """Activation sharding constraint by logical names: `constrain(x_btd, ("batch", "seq", "activation_embed"))`.

    Built by the trainer from the rules and mesh and handed to the model: the `models.contract.Constraint`
    whose unsharded counterpart is `models.contract.no_constraint`.
    """

    rules: RulesConfig
    mesh: Mesh

    def __call__(self, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
        spec = spec_for(names, self.rules, self.mesh, shape=x.shape, what=f"activation {names} {x.shape}")
        # inside a shard_map (e.g. the pipeline's, manual over `pipeline`) constrain the other axes
        # on the current abstract mesh, whose manual axes the spec must not name
        current = jax.sharding.get_abstract_mesh()
        mesh = current if current.manual_axes else self.mesh
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    @property
    def platform(self) -> str | None:
        """Platform of the mesh's devices ('tpu' for abstract TPU topology devices), or None for an
        AbstractMesh, which has no devices."""
        if isinstance(self.mesh, jax.sharding.AbstractMesh):
            return None
        return self.mesh.devices.flat[0].platform

    def _split_axes(self, name: str) -> tuple[str, ...]:
        """Mesh axes (of size > 1) that logical axis `name` is split over."""
        return tuple(a for a in mesh_axes(getattr(self.rules, name)) if self.mesh.shape[a] > 1)

    def size(self, name: str) -> int:
        """Ways logical axis `name` is split: a model asks `size("seq")` to pick ring attention, never
        which mesh axes those are."""
        return axes_size(self.mesh, self._split_axes(name))

    def shard_map(self, fn, in_names, out_names):
        """`fn(shard, *local_arrays)` run on each device's shards (a `jax.shard_map` manual over every
        mesh axis not already manual), inputs and outputs split by logical names (axes the names
        leave out see replicated data): for kernels that need local shapes (splash attention) and
        for code that moves data between devices (MoE dispatch, ring attention). `shard` (a `Shard`)
        offers collectives over logical axes, so `fn` never names a mesh axis. `out_names`: one
        tuple of names, or a tuple of them for several outputs. Varying-manual-axes checking is off
        (`check_vma=False`): Pallas kernels (splash) do not declare it; the collectives above are
        the only cross-device ones."""
        current = jax.sharding.get_abstract_mesh()
        mesh = current if current.manual_axes else self.mesh
        free = frozenset(a for a in self.mesh.axis_names if a not in current.manual_axes)
        axes = {n: self._split_axes(n) for n in LOGICAL_AXES}
        shard = Shard({n: a for n, a in axes.items() if a and set(a) <= free},
                      {a: int(self.mesh.shape[a]) for a in free}, self.platform)

        def spec(names, what):
            return spec_for(names, self.rules, self.mesh, what=f"{what} {tuple(names)}")

        many = bool(out_names) and all(isinstance(n, tuple) for n in out_names)
        out_specs = (tuple(spec(n, "shard_map output") for n in out_names) if many
                     else spec(out_names, "shard_map output"))
        in_specs = tuple(spec(n, "shard_map input") for n in in_names)
        return jax.shard_map(functools.partial(fn, shard), mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=set(free), check_vma=False)


@dataclasses.dataclass(frozen=True)
class Shard:
    """Collectives over logical axes inside `Constrain.shard_map` (a `models.contract.Collectives`; an axis
    not split here gets identities)."""

    axes: dict
    """logical name -> its mesh axes (size > 1, manual here); absent names are not split."""
    sizes: dict
    """manual mesh axis -> size."""
    platform: str | None = None
    """the devices' platform (`Constrain.platform`): which backends' compilers have ragged-all-to-all."""

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

    def pmax(self, x, name: str):
        axes = self.axes.get(name, ())
        return jax.lax.pmax(x, axes) if axes else x

    def all_gather(self, x, name: str, axis: int):
        """The whole of dimension `axis`, which is split over logical axis `name`."""
        axes = self.axes.get(name, ())
        return jax.lax.all_gather(x, axes, axis=axis, tiled=True) if axes else x

    def all_to_all(self, x, name: str, axis: int = 0):
        """Block j of dimension `axis` (size = size(name)) goes to device j along `name`; block i of
        the result came from device i."""
        axes = self.axes.get(name, ())
        return jax.lax.all_to_all(x, axes, axis, axis, tiled=True) if axes else x

    def ragged_all_to_all(self, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, name: str):
        """`jax.lax.ragged_all_to_all` over logical axis `name`: send_sizes[j] rows of `operand` from
        input_offsets[j] to device j, written there at output_offsets[j]; recv_sizes[i] rows arrive
        from device i. XLA:CPU has no ragged-all-to-all: there it is a dense all-to-all of blocks
        (`models.contract.ragged_all_to_all_by_blocks`, the same result)."""
        axes = self.axes.get(name, ())
        args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
        if axes and self.platform in ("tpu", "gpu"):
            return jax.lax.ragged_all_to_all(*args, axis_name=axes)
        return contract.ragged_all_to_all_by_blocks(lambda x: self.all_to_all(x, name), *args)

    def ring_shift(self, x, name: str):
        """Each device's `x` (a pytree) to the next device along `name` (the last to the first)."""
        axes = self.axes.get(name, ())
        if not axes:
            return x
        n = self.size(name)
        return jax.lax.ppermute(x, axes, [(i, (i + 1) % n) for i in range(n)])

