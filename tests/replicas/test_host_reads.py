"""Where a step reads tensors back to Python (``.item()``, ``.tolist()``, ``.cpu()``,
``bool()``, ``int()`` ...): on CUDA each read of a device tensor waits for the GPU, so a
step should read as little as it can. Counted on CPU through the patched tensor API,
while the engine steps a batch of 16; a new place that reads, or a place that reads more
often than it does today, fails the test (and says where).

Today a step reads at most seven times, at the places below: once the step's results (the
blocks' ids and flags, in one read, in ``StepExecutor.execute``), twice the attention
layout's host tensors (its unit starts and the kept tokens: they wait for nothing), and where the algorithm
runs numpy on CPU tensors only (on a device they stay torch's and read nothing): the
argmax (``algorithms.sampling.argmax_last``) or a greedy confidence rule's host path
(``algorithms.confidence_rule``: the block, the logits and their softmax viewed as numpy
arrays); never per committed block. The
scheduler's batch and the runner's input building are numpy arrays on the host
(``replicas.rows``), so they read no tensor at all. Logits, blocks and the algorithms' work stay on the model's device until that one
read (no other wait inside a step; on a GPU the forward is timed by CUDA events,
read after it, ``replicas.runner.ForwardTimer``). This test cannot tell a host tensor's read
from a device tensor's: the places are listed by name."""

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tools.bench.evaluation import tiny_params
from replicas.engine import Engine, EngineConfig
from replicas.tiny import task

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
READS_PER_STEP = {("replicas/executor.py", "execute"): 1, ("replicas/attention.py", "__init__"): 2,
                  ("algorithms/sampling.py", "argmax_last"): 1,  # the places below: CPU tensors only
                  ("algorithms/confidence_rule.py", "step"): 1, ("algorithms/sampling.py", "greedy_on_host"): 2}
ROOT = str(Path(__file__).resolve().parents[2]) + "/"


def _project_site(frame) -> tuple[str, str] | None:
    """The innermost caller in the project's code: (path from the root, function)."""
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(ROOT) and not path.startswith(ROOT + "tests/"):
            return path[len(ROOT):], frame.f_code.co_name
        frame = frame.f_back
    return None


@pytest.fixture
def counted_reads(monkeypatch):
    reads: Counter = Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            site = _project_site(sys._getframe(1))
            if site is not None:
                reads[site] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def test_a_step_reads_tensors_back_no_more_than_it_does_today(counted_reads):
    engine = Engine.from_pretrained("tiny", EngineConfig(max_batch=16, fdfo_fill_hold=False))
    prompts = [r.prompt for r in task.heldout_requests()[:48]]
    engine.generate(prompts[:2], tiny_params())  # warm: the first step builds what later ones reuse
    counted_reads.clear()
    steps = []
    engine.generate(prompts, tiny_params(), on_step=steps.append)
    unknown = set(counted_reads) - set(READS_PER_STEP)
    assert not unknown, f"new places that read tensors back in a step: {sorted(unknown)}"
    for site, reads in READS_PER_STEP.items():
        assert counted_reads[site] <= reads * len(steps), (site, counted_reads[site], len(steps))
    assert sum(s.blocks_committed for s in steps) > len(steps)  # blocks were committed: per-block reads would show
