"""A stand-in for the engine replicas' Serve handle, for tests of the ingress without Ray."""

import types

from replicas.messages import GenerateChunk, joined


def handle_over(generate) -> types.SimpleNamespace:
    """A replica handle whose streaming ``generate`` is ``generate(job)`` and whose
    ``generate_whole`` streams its chunks joined, as ``EngineReplica.generate_whole`` does."""
    async def whole(job):
        yield joined([chunk async for chunk in generate(job)])

    return types.SimpleNamespace(generate=types.SimpleNamespace(remote=generate),
                                 generate_whole=types.SimpleNamespace(remote=whole))


class Replicas:
    """Stands in for the replica handle: every request finishes in one block."""

    def __init__(self):
        handle = handle_over(self._generate)
        self.generate, self.generate_whole = handle.generate, handle.generate_whole
        self.jobs = []  # every request sent, in order

    async def _generate(self, job):
        self.jobs.append(job)
        yield GenerateChunk(text="x", token_ids=[5], finished=True, finish_reason="stop",
                            prompt_tokens=len(job.prompt_ids), completion_tokens=1, steps=2, block_steps=[2])
