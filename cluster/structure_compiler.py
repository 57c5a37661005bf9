"""The ingress compiles structures in a worker process it stops at the bound.

A regular expression whose automaton explodes keeps outlines-core busy for as long as it
takes (``(a|b)*a(a|b){20}``: 56 s and four million states), and a thread cannot be stopped:
later structures would queue behind it. So the ingress's compiles run in a process of their
own (spawned, with the model's vocabulary, at the first structure); one that outlasts the
bound is killed, the request gets its 400, and the next structure starts a fresh process.
"""

from __future__ import annotations

import multiprocessing
import pickle
import threading

from outlines_core import Index, Vocabulary

from replicas.grammar import ConstraintError, compile_index


def _serve(connection, vocabulary: Vocabulary) -> None:
    """The worker: each regex received, its pickled automaton or the error's text back."""
    while True:
        regex = connection.recv()
        try:
            connection.send((True, pickle.dumps(compile_index(regex, vocabulary))))
        except ConstraintError as exc:
            connection.send((False, str(exc)))


class ProcessCompiler:
    """``Grammars``' ``index_of`` through a worker process bounded by ``timeout_s``."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._context = multiprocessing.get_context("spawn")  # no fork of a threaded process
        self._lock = threading.Lock()
        self._worker = None
        self._connection = None
        self._vocabulary: Vocabulary | None = None

    def __call__(self, regex: str, vocabulary: Vocabulary) -> Index:
        with self._lock:
            if self._worker is None or vocabulary is not self._vocabulary:
                self._start(vocabulary)
            self._connection.send(regex)
            if not self._connection.poll(self.timeout_s):
                self.close()
                raise ConstraintError(f"took over {self.timeout_s:g} s to compile for this model; ask for a "
                                      f"simpler one")
            compiled, payload = self._connection.recv()
        if not compiled:
            raise ConstraintError(payload)
        return pickle.loads(payload)

    def _start(self, vocabulary: Vocabulary) -> None:
        self.close()
        ours, theirs = self._context.Pipe()
        self._worker = self._context.Process(target=_serve, args=(theirs, vocabulary), daemon=True,
                                             name="dllm-structure-compiler")
        self._worker.start()
        theirs.close()
        self._connection, self._vocabulary = ours, vocabulary

    def close(self) -> None:
        """Stop the worker (a compile in progress with it)."""
        if self._worker is not None:
            self._worker.kill()
            self._worker.join()
            self._connection.close()
        self._worker = self._connection = None
