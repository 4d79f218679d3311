"""The model's view of sharding is two interfaces with two implementations each: `models.contract.Constraint`
(the trainer's `sharding.Constrain`, the unsharded `models.contract.no_constraint`) and `models.contract.Collectives`
(`sharding.Shard`, `models.contract.Whole`). Both implementations offer exactly the interface's members: one
the unsharded side lacked would break a model run alone; one only the trainer's had, a model that
used it would break unsharded."""

import dataclasses
import inspect
import typing

import pytest

from models import contract
from shardtrain.parallel import sharding


class _Empty(typing.Protocol):
    pass


def members(cls) -> set[str]:
    """Public members (and __call__) defined by cls and its bases, less a Protocol's own machinery
    and a dataclass's data fields."""
    names = {n for c in inspect.getmro(cls) if c is not object for n in vars(c)}
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return {n for n in names - fields if not n.startswith("_") or n == "__call__"} - set(vars(_Empty))


@pytest.mark.parametrize("protocol, trainers, unsharded, expected", [
    (contract.Constraint, sharding.Constrain, contract.NoConstraint, {"__call__", "platform", "size", "shard_map"}),
    (contract.Collectives, sharding.Shard, contract.Whole,
     {"size", "index", "psum", "pmax", "all_gather", "all_to_all", "ragged_all_to_all", "ring_shift"}),
])
def test_both_implementations_offer_exactly_the_interface(protocol, trainers, unsharded, expected):
    assert members(protocol) == expected
    assert members(trainers) == expected
    assert members(unsharded) == expected


def test_the_unsharded_ones_are_identities():
    x = object()
    assert contract.no_constraint(x, ("batch",)) is x and contract.no_constraint.size("seq") == 1
    whole = contract.Whole()
    assert whole.psum(x, "batch") is x and whole.all_gather(x, "seq", 0) is x and whole.size("expert") == 1
    shard, out = contract.no_constraint.shard_map(lambda shard, a: (shard, a), [("batch",)], ("batch",))(x)
    assert isinstance(shard, contract.Whole) and out is x
