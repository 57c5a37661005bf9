"""The replica engine: schedule, run, denoise, commit, once per step.

``Engine`` is synchronous and single-threaded in its step loop; ``add_request`` and
``abort`` may be called from other threads (they go through an inbox drained at the
start of every step). ``replicas.async_engine`` runs it in a thread for asyncio callers.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from algorithms import AlgorithmError, get_algorithm
from replicas.cost_model import OnlineCostModel
from replicas.kv_cache import KVCache, PagePool
from replicas.limits import length_error, pages_needed
from replicas.models import load_model, load_tokenizer
from replicas.output import OutputProcessor
from replicas.batching import Phase, SchedulerMode
from replicas.request import FinishReason, Request, RequestError, RequestOutput, SamplingParams
from replicas.runner import ModelRunner
from replicas.scheduler import Scheduler
from replicas.slots import SlotTable
from replicas.stats import EngineTotals, StepStats

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    mode: str = "fdfo"
    max_batch: int = 16
    num_pages: int | None = None  # None: enough for max_batch requests of max_model_len
    max_tokens_per_step: int | None = None  # None: max(512, max_batch x block length)
    max_model_len: int | None = None  # None: the model's position limit
    default_algorithm: str | None = None  # None: the model's default (replicas.models.defaults)
    default_algorithm_params: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    dtype: str | None = None  # None: bfloat16 on CUDA, float32 elsewhere
    kv_cache: str = "prefix"  # or "none": recompute the whole sequence every step (replicas.runner)
    attention_backend: str = "auto"  # "sdpa", "flash" (vllm-flash-attn, CUDA) or "auto"
    lora: str | None = None  # PEFT adapter directory merged into the weights at load
    model_overrides: dict[str, Any] = field(default_factory=dict)  # block_length, ids, attention, ...

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is None:
            return torch.bfloat16 if torch.device(self.device).type == "cuda" else torch.float32
        return DTYPES[self.dtype]
    fill_timeout_s: float | None = None  # fixed_fill: None = tuned online, else fixed seconds
    fdfo_fill_hold: bool = True  # fdfo: an under-filled step may wait briefly for arrivals


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        spec = model.spec
        self.spec = spec
        self.tokenizer = tokenizer
        self.block_length = size = spec.block_length
        self.max_model_len = config.max_model_len or spec.max_positions
        if self.max_model_len > spec.max_positions:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's {spec.max_positions} positions")
        self.max_pages_per_request = self.max_model_len // size
        num_pages = config.num_pages or config.max_batch * self.max_pages_per_request + 1
        budget = config.max_tokens_per_step or max(512, config.max_batch * size)
        if budget < config.max_batch * size:
            raise ValueError(f"max_tokens_per_step {budget} cannot hold {config.max_batch} blocks of {size}")
        if config.default_algorithm is None:
            self.config = config = dataclasses.replace(
                config, default_algorithm=spec.default_algorithm,
                default_algorithm_params={**spec.default_algorithm_params, **config.default_algorithm_params})
        self.default_algorithm = get_algorithm(config.default_algorithm)
        self.default_algorithm.make_params(config.default_algorithm_params)  # validate early
        device = torch.device(config.device)
        dtype = config.torch_dtype
        self.model = model.to(device=device, dtype=dtype).eval()
        self.pool = PagePool(num_pages)
        self.slots = SlotTable(config.max_batch, self.max_pages_per_request, size,
                               pad_id=spec.eos_token_id)
        kv_cache = KVCache(spec.num_layers, num_pages, size, spec.num_kv_heads, spec.head_dim, dtype, device)
        self.runner = ModelRunner(self.model, self.slots, kv_cache, device, config.kv_cache,
                                  config.attention_backend)
        self.cost_model = OnlineCostModel(config.max_batch)
        self.scheduler = Scheduler(SchedulerMode(config.mode), self.pool, self.slots, config.max_batch,
                                   budget, size, spec.mask_token_id, fill_timeout=self._fill_timeout,
                                   fdfo_hold=self.cost_model.fdfo_hold if config.fdfo_fill_hold else (lambda rows: 0.0))
        self.outputs = OutputProcessor(tokenizer, spec.eos_token_id)
        self.totals = EngineTotals()
        self._requests: dict[str, Request] = {}
        self._inbox: list[tuple[str, Any]] = []
        self._inbox_lock = threading.Lock()
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(cls, model: str = "tiny", config: EngineConfig | None = None) -> "Engine":
        config = config or EngineConfig()
        net = load_model(model, config.torch_dtype, config.device, lora=config.lora,
                         overrides=config.model_overrides)
        return cls(net, load_tokenizer(model), config)

    # ---- requests ---------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        """Tokenize user text; special-token strings in it stay text (never a mask)."""
        return self.tokenizer(prompt, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def make_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                     request_id: str | None = None,
                     on_output: Callable[[RequestOutput], None] | None = None) -> Request:
        """Validate and build a request (raises RequestError); does not enqueue it."""
        params = params or SamplingParams()
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if any(not 0 <= t < self.spec.vocab_size for t in prompt_ids):
            raise RequestError("the prompt has token ids outside the vocabulary")
        if self.spec.mask_token_id in prompt_ids:
            raise RequestError("the prompt contains the mask token id")
        too_long = length_error(len(prompt_ids), params.max_tokens, self.block_length, self.max_model_len)
        if too_long:
            raise RequestError(too_long)
        needed = pages_needed(len(prompt_ids), params.max_tokens, self.block_length)
        if needed > self.pool.capacity:
            raise RequestError(f"the request needs {needed} KV pages; the pool has {self.pool.capacity}")
        try:
            algorithm = get_algorithm(params.algorithm) if params.algorithm else self.default_algorithm
            overrides = params.algorithm_params if params.algorithm else {
                **self.config.default_algorithm_params, **params.algorithm_params}
            algorithm_params = algorithm.make_params(overrides)
        except AlgorithmError as exc:
            raise RequestError(str(exc)) from exc
        return Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_ids=prompt_ids,
            params=params,
            algorithm=algorithm,
            algorithm_params=algorithm_params,
            block_length=self.block_length,
            on_output=on_output,
        )

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None,
                    on_output: Callable[[RequestOutput], None] | None = None) -> str:
        request = self.make_request(prompt, params, request_id, on_output)
        with self._inbox_lock:
            self._inbox.append(("add", request))
        return request.request_id

    def abort(self, request_id: str) -> None:
        with self._inbox_lock:
            self._inbox.append(("abort", request_id))

    def has_work(self) -> bool:
        return bool(self._inbox or self.scheduler.has_work())

    def hold_s(self) -> float:
        """How long the scheduler chose to wait before its next step (fixed_fill), else 0."""
        hold_until = self.scheduler.hold_until
        return max(0.0, hold_until - time.monotonic()) if hold_until is not None else 0.0

    def _fill_timeout(self) -> float:
        if self.config.fill_timeout_s is not None:
            return self.config.fill_timeout_s
        return self.cost_model.fill_timeout()

    # ---- the step loop -------------------------------------------------------------
    def step(self) -> StepStats | None:
        start = time.perf_counter()
        self._drain_inbox()
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        try:
            logits, forward_s = self.runner.forward(batch)
        except Exception as exc:  # a broken forward fails its rows, never the engine
            log.exception("forward failed; failing %d requests", len(batch.rows))
            for request in batch.rows:
                self._fail(request, f"model forward failed: {exc}")
            return None
        committed = self._denoise_and_commit(batch, logits)
        stats = StepStats(
            batch_size=len(batch.rows),
            active_rows=int(batch.stepped.sum()),
            num_tokens=batch.num_tokens,
            forward_s=forward_s,
            step_s=time.perf_counter() - start,
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            blocks_committed=len(committed),
            block_steps=tuple(committed),
            prompt_units=len(batch.unit_is_block) - len(batch.block_rows),
        )
        self.totals.record(stats)
        self.cost_model.observe_step(stats.batch_size, stats.step_s, stats.block_steps)
        return stats

    def _denoise_and_commit(self, batch, logits: torch.Tensor) -> list[int]:
        """Advance stepped rows with their algorithms; commit done blocks; return their step counts."""
        if bool(batch.stepped.all()):
            stepped_rows = batch.block_rows
        else:
            stepped_rows = [r for r, s in zip(batch.block_rows, batch.stepped.tolist()) if s]
            logits = logits[batch.stepped]
        if not stepped_rows:
            return []
        slots = torch.tensor([r.slot for r in stepped_rows])
        segments = torch.tensor([r.active_segment for r in stepped_rows])
        blocks = self.slots.blocks(slots, segments)
        done = torch.zeros(len(stepped_rows), dtype=torch.bool)
        groups = self._group_by_algorithm(stepped_rows)
        for algorithm, members in groups.items():
            whole = len(groups) == 1  # the common case: no gather/scatter of the group
            index = slice(None) if whole else torch.tensor(members)
            sub_blocks = blocks if whole else blocks[index]
            try:
                done[index] = algorithm.step(
                    logits[index], sub_blocks, self.spec.mask_token_id,
                    [stepped_rows[i].algorithm_params for i in members],
                    [stepped_rows[i].algorithm_state for i in members])
            except Exception as exc:
                log.exception("algorithm %s failed", algorithm.name)
                for i in members:
                    self._fail(stepped_rows[i], f"algorithm {algorithm.name} failed: {exc}")
                continue
            if not whole:
                blocks[index] = sub_blocks
        self.slots.write_blocks(slots, segments, blocks)
        committed = []
        for i, (request, is_done) in enumerate(zip(stepped_rows, done.tolist())):
            if request.phase is not Phase.DENOISE:
                continue  # failed above
            request.block_steps += 1
            request.num_steps += 1
            if is_done:
                committed.append(request.block_steps)
                output = self.outputs.commit_block(request, blocks[i].tolist())
                self.totals.output_tokens += len(output.new_token_ids)
                if output.finished:
                    request.phase = Phase.FINISHED
                    self.totals.requests_finished += 1
                    self.cost_model.observe_finished(len(request.committed_block_steps))
                    self._requests.pop(request.request_id, None)
                else:
                    request.phase = Phase.BLOCK_DONE
                request.emit(output)
        return committed

    @staticmethod
    def _group_by_algorithm(rows: list[Request]) -> dict:
        groups: dict = {}
        for i, request in enumerate(rows):
            groups.setdefault(request.algorithm, []).append(i)
        return groups

    def _drain_inbox(self) -> None:
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
        for kind, item in inbox:
            if kind == "add":
                self.cost_model.observe_arrival(item.arrival_time)
                self._requests[item.request_id] = item
                self.scheduler.add(item)
            else:
                self._abort_now(item)

    def _abort_now(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return  # already finished or unknown: nothing to do
        self._end(request, FinishReason.ABORT, None)
        self.totals.requests_aborted += 1

    def _fail(self, request: Request, error: str) -> None:
        self._requests.pop(request.request_id, None)
        self._end(request, FinishReason.ERROR, error)
        self.totals.requests_failed += 1

    def _end(self, request: Request, reason: FinishReason, error: str | None) -> None:
        if request.phase is Phase.WAITING or request.slot >= 0:
            self.scheduler.remove(request)
        request.phase = Phase.FINISHED
        if request.finish_reason is None:
            request.finish_reason = reason
            request.finish_time = time.monotonic()
            request.emit(OutputProcessor.snapshot(request, [], "", error))

    # ---- offline convenience ---------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_step: Callable[[StepStats], None] | None = None) -> list[RequestOutput]:
        """Run ``prompts`` to completion as one closed batch; one final output (whole text
        and ids) per prompt, in order. ``on_step`` sees every step's statistics."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        results: dict[str, RequestOutput] = {}
        order = []

        def collect(output: RequestOutput) -> None:
            previous = results.get(output.request_id)
            if previous is not None:
                output.new_token_ids = previous.new_token_ids + output.new_token_ids
                output.new_text = previous.new_text + output.new_text
            results[output.request_id] = output

        for prompt, p in zip(prompts, params):
            order.append(self.add_request(prompt, p, on_output=collect))
        while self.has_work():
            stats = self.step()
            if stats is None:
                time.sleep(min(self.hold_s(), 0.01))
            elif on_step is not None:
                on_step(stats)
        return [results[rid] for rid in order]
