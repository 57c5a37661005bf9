"""Test doubles around an engine's step stages: what a step runs, and faults injected into it."""

from __future__ import annotations

from collections.abc import Callable

from replicas.request import Request


class InjectedFault(RuntimeError):
    """Raised by a step that a test made fail (``inject_faults``)."""


def track_stepped(engine) -> Callable[[], list[Request]]:
    """Wrap ``engine``'s executor; returns a function that gives the requests whose blocks
    the step being executed (or the last one) advances."""
    current: list[Request] = []
    execute = engine.executor.execute

    def tracked(step):
        current[:] = step.stepped
        return execute(step)

    engine.executor.execute = tracked
    return lambda: current


def inject_faults(engine, steps: int) -> None:
    """The next ``steps`` steps of ``engine`` that run a batch raise after scheduling it,
    outside the forward (-1: every step; 0: none): a replica fault."""
    execute = getattr(engine.executor.execute, "unfaulted", engine.executor.execute)
    left = steps

    def faulty(step):
        nonlocal left
        if left:
            left -= left > 0
            raise InjectedFault("a fault injected by the test")
        return execute(step)

    faulty.unfaulted = execute
    engine.executor.execute = faulty


def faulty_replica_class():
    """``EngineReplica`` with a hook a test reaches through a Serve handle:
    ``inject_faults(steps)`` into its engine, returning the replica's id. Made on demand
    and pickled by value, so that Ray's workers need not import the tests."""
    import cloudpickle

    from replicas.deployment import EngineReplica

    cloudpickle.register_pickle_by_value(__import__(__name__, fromlist=["_"]))

    class FaultyReplica(EngineReplica):
        def inject_faults(self, steps: int) -> str:
            inject_faults(self.engine, steps)
            return self.replica_id

    return FaultyReplica
