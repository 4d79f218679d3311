"""Tests that share something costly (a module-scoped fixture, a functools.cache) run on one worker
under `pytest -n N --dist loadgroup` (make test), so that it is built once, not once per worker.

xdist's own way, the `xdist_group` mark, is ignored with pytest 9.2 (pytest-xdist#1386: xdist
records a test's group by rewriting its node id, which pytest 9.2 no longer reads back), and xdist
has no public way to group tests from the controller, which sees only node ids. So `scheduler`
overrides the one private method that names a test's group, `LoadGroupScheduling._split_scope`;
tests/system/test_one_worker.py runs a small suite on 2 workers and fails if xdist stops calling it."""

from __future__ import annotations


def scheduler(config, log, groups: dict[str, str]):
    """xdist's loadgroup scheduler, except that the tests whose node id starts with a key of `groups`
    (e.g. "tests/test_plan.py::") form one group, run by one worker."""
    from xdist.scheduler import LoadGroupScheduling

    class OneWorkerGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((p for p in groups if nodeid.startswith(p)), None) or super()._split_scope(nodeid)

    return OneWorkerGroups(config, log)
