"""The runner-side stage of a step: the forward, the algorithms, the log-probabilities and
the one read from the device, for a ``ScheduledStep``; it returns a ``StepOutput`` and
changes no request (``replicas.step``).

The stepped blocks' tokens live in the row table (``replicas.rows``): they are read on
the host before the forward, advanced by the algorithms on the device, and written back
to the rows. The algorithms read their per-block states (``Request.algorithm_state``)
and return the next ones, which the output carries to the scheduler.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from algorithms import AlgorithmStep, DllmAlgorithm
from replicas.constrained_block import NoValidBlock, class_scores, constrain_block
from replicas.devices import to_device
from replicas.logprobs import step_logprobs
from replicas.request import Request
from replicas.rows import RowTable
from replicas.runner import ModelRunner
from replicas.step import ScheduledStep, StepOutput

log = logging.getLogger(__name__)


class ForwardFailed(RuntimeError):
    """The model's forward raised: the step's rows fail, the engine goes on."""


class StepExecutor:
    def __init__(self, runner: ModelRunner, rows: RowTable, mask_id: int, fused_commit: bool):
        """``fused_commit``: a filled block of a rule that never edits is final at the step
        that filled it (``EngineConfig.fused_commit``)."""
        self.runner = runner
        self.rows = rows
        self.mask_id = mask_id
        self.fused_commit = fused_commit

    def execute(self, step: ScheduledStep) -> StepOutput:
        """Run ``step``'s forward and advance its stepped blocks; raises ForwardFailed."""
        batch, requests = step.batch, step.stepped
        # the stepped blocks as the forward sees them, read on the host before it (6 against
        # 49 us after it, where the first host work pays for the caches the forward evicted)
        fed = self.rows.blocks(*batch.stepped_blocks)
        # fed with masks: final KV still to write. (No numpy reduction such as ``any`` runs
        # between two forwards: each forward evicts that code, and bringing it back cost a
        # step ~25 us on a CPU host; docs/benchmarks.md)
        kv_stale = [self.mask_id in block for block in fed.tolist()]
        constrained = [i for i, request in enumerate(requests) if request.constraint is not None]
        fed_constrained = fed[constrained] if constrained else None  # a copy: the step writes ``fed``
        forward_cpu = time.thread_time()
        try:
            logits, forward_timer = self.runner.forward(batch)
        except Exception as exc:
            raise ForwardFailed(f"model forward failed: {exc}") from exc
        forward_cpu = time.thread_time() - forward_cpu
        if not requests:  # prompt chunks only
            return StepOutput([], [], [], None, [], None, forward_timer.seconds(), forward_cpu)
        if len(requests) < batch.advances.size:  # idle rows (sync, static) computed but not advanced
            logits = logits[to_device(torch.from_numpy(batch.advances), logits.device)]
        fed_unmasked = [not stale for stale in kv_stale]
        blocks = to_device(torch.from_numpy(fed), logits.device)  # may share ``fed``'s memory: read above
        asking = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        before = blocks[asking] if asking else None  # a copy (indexed by a list)
        failed: list[tuple[Request, str]] = []
        done, states = self._run_algorithms(requests, logits, blocks, fed_unmasked, failed)
        if constrained:
            self._constrain([requests[i] for i in constrained], constrained, fed_constrained, logits, blocks, failed)
        logprobs = None
        if asking:
            logprobs = [None] * len(requests)
            written = step_logprobs([requests[i].params.logprobs for i in asking], logits[asking], before,
                                    blocks[asking], self.mask_id)
            for i, positions in zip(asking, written):
                logprobs[i] = positions
        # one read of the blocks' tokens (and done flags): on a GPU, the step's one wait
        if done is None:
            block_ids, done = blocks.tolist(), fed_unmasked
        else:
            read = torch.cat([blocks, done[:, None]], 1).tolist()
            block_ids, done = [row[:-1] for row in read], [row[-1] for row in read]
        # on the host the step wrote ``fed`` itself (``blocks`` shares it): no lists to convert
        rows, page_indices = batch.stepped_blocks
        self.rows.write_blocks(rows, page_indices, fed if blocks.device.type == "cpu" else block_ids)
        if self.fused_commit:  # a filled block of a rule that never edits is final now
            mask_id = self.mask_id
            done = [is_done or (mask_id not in ids and request.algorithm.final_when_filled)
                    for is_done, ids, request in zip(done, block_ids, requests)]
        return StepOutput(block_ids, done, kv_stale, logprobs, failed, states, forward_timer.seconds(), forward_cpu)

    def _run_algorithms(self, requests: list[Request], logits: torch.Tensor, blocks: torch.Tensor,
                        fed_unmasked: list[bool], failed: list) -> AlgorithmStep:
        """One algorithm step per block (``blocks`` in place): [R] bool, the block is done, or
        None where that is ``fed_unmasked``; the blocks' next states, or None where they stay
        (see ``DllmAlgorithm.step``). A failing algorithm's rows go to ``failed``."""
        groups: dict[DllmAlgorithm, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(request.algorithm, []).append(i)
        if len(groups) == 1:  # the common case: the whole batch, no gather or scatter
            [algorithm] = groups
            return self._step_algorithm(algorithm, requests, logits, blocks, failed)
        done = torch.tensor(fed_unmasked, device=logits.device)
        states = None
        for algorithm, members in groups.items():
            index = to_device(torch.tensor(members), logits.device)
            sub_blocks = blocks[index]
            sub_done, sub_states = self._step_algorithm(algorithm, [requests[i] for i in members], logits[index],
                                                        sub_blocks, failed)
            if sub_done is not None:
                done[index] = sub_done
            if sub_states is not None:
                states = states or [r.algorithm_state for r in requests]
                for i, state in zip(members, sub_states):
                    states[i] = state
            blocks[index] = sub_blocks
        return AlgorithmStep(done, states)

    def _constrain(self, requests: list[Request], rows: list[int], fed, logits: torch.Tensor,
                   blocks: torch.Tensor, failed: list) -> None:
        """Decide the tokens the step chose for constrained rows (``replicas.constrained_block``),
        in ``blocks``; ``fed``: their blocks as fed to the forward."""
        stepped = blocks[rows].cpu().numpy()
        for request, row, fed_block, block in zip(requests, rows, fed, stepped):
            chosen = ((block != fed_block) & (block != self.mask_id)).nonzero()[0]
            if not chosen.size:
                continue
            first = request.answer_offset
            room = request.params.max_tokens - len(request.output_ids)
            size = block.size
            stop, room_after = (size, first + room - size) if first + room > size else (first + room, None)
            try:
                decided = constrain_block(request.constraint, request.constraint_state, fed_block, block,
                                          self.mask_id, functools.partial(self._chosen_scores, request, logits[row],
                                                                          blocks[row], chosen), first, stop, room_after)
            except NoValidBlock as exc:
                log.error("request %s: %s", request.request_id, exc)
                failed.append((request, f"constrained decoding failed: {exc}"))
                continue
            blocks[row] = to_device(torch.from_numpy(decided), blocks.device)

    @staticmethod
    def _chosen_scores(request: Request, logits: torch.Tensor, block: torch.Tensor, chosen) -> dict:
        """The chosen positions' ``class_scores`` rows, by position (``logits``, ``block``: the row's)."""
        at = to_device(torch.from_numpy(chosen), logits.device)
        best, token = class_scores(request.constraint, logits[at], block[at])
        return dict(zip(chosen.tolist(), zip(best, token)))

    def _step_algorithm(self, algorithm: DllmAlgorithm, requests: list[Request], logits: torch.Tensor,
                        blocks: torch.Tensor, failed: list) -> AlgorithmStep:
        """``algorithm``'s step over its rows; a failure sends them to ``failed`` (none done)."""
        try:
            return algorithm.step(logits, blocks, self.mask_id, [r.algorithm_params for r in requests],
                                  [r.algorithm_state for r in requests])
        except Exception as exc:
            log.exception("algorithm %s failed", algorithm.name)
            failed.extend((owner, f"algorithm {algorithm.name} failed: {exc}")
                          for owner in dict.fromkeys(request.owner for request in requests))  # once, ahead blocks too
            return AlgorithmStep(torch.zeros(len(requests), dtype=torch.bool, device=blocks.device))
