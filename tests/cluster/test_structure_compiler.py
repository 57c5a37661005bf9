"""The ingress's structure compiles run in a worker process stopped at the bound: an
automaton that explodes costs its bound, not a minute, and the next structure compiles."""

import time

import pytest

from cluster.structure_compiler import ProcessCompiler
from replicas.grammar import ConstraintError, Grammars
from tools.bench.bytelevel import bytelevel_tokenizer


def test_an_exploding_structure_is_stopped_at_the_bound_and_the_next_one_compiles():
    compiler = ProcessCompiler(timeout_s=3.0)
    tokenizer = bytelevel_tokenizer()
    grammars = Grammars(tokenizer, [0], [1], index_of=compiler)
    try:
        assert grammars.automaton("(yes|no)").num_states > 2  # the worker started and answers
        start = time.monotonic()
        with pytest.raises(ConstraintError, match="took over 3 s"):  # 56 s in one process
            grammars.automaton("(a|b)*a(a|b){20}")
        assert time.monotonic() - start < 30  # the bound, and a busy machine's slack
        with pytest.raises(ConstraintError, match="cannot be compiled"):  # the library's own error, from a new worker
            grammars.automaton("(?=x)y")
        automaton = grammars.automaton("[0-9]{3}")
        assert automaton.accepting[automaton.walk(automaton.start, tokenizer.encode("123"))]
    finally:
        compiler.close()
