"""A callable that fails once, on a chosen call: for the tests of how faults are contained."""

import itertools


def failing_on_call(function, call: int, error: Exception):
    """``function``, except that its ``call``-th call (counting from 1) raises ``error``."""
    calls = itertools.count(1)

    def wrapper(*args, **kwargs):
        if next(calls) == call:
            raise error
        return function(*args, **kwargs)
    return wrapper
