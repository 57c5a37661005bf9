"""A stand-in for the engine replicas' Serve handle, for tests of the ingress without Ray."""

import types

from replicas.messages import GenerateChunk


class Replicas:
    """Stands in for the replica handle: every request finishes in one block."""

    def __init__(self):
        self.generate = types.SimpleNamespace(remote=self._generate)

    async def _generate(self, job):
        yield GenerateChunk(text="x", token_ids=[5], finished=True, finish_reason="stop",
                            prompt_tokens=len(job.prompt_ids), completion_tokens=1, steps=2, block_steps=[2])
