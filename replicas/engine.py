"""The replica engine: schedule, execute, update, stream, once per step.

Each step passes values along (``replicas.step``): the scheduler's ``ScheduledStep``, the
executor's ``StepOutput`` (the forward, the algorithms, one device read:
``replicas.executor``), and the commits the scheduler applied (``update_from_output``, the
one place that changes request state). The engine streams one ``GenerateChunk``
(``replicas.messages``) per committed block and at the end.

``Engine`` is synchronous and single-threaded in its step loop; ``add_request`` and
``abort`` may be called from other threads (they go through an inbox drained at the
start of every step). ``replicas.async_engine`` runs it in a thread for asyncio callers.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from algorithms import AlgorithmError, AlgorithmParams, DllmAlgorithm, get_algorithm
from replicas import block_pipeline
from replicas.adapters import Adapter, ResidentAdapters, enable_adapters
from replicas.grammar import IGNORE_EOS_UNSTRUCTURED, Grammars
from replicas.host_heap import keep_freed_memory
from replicas.cost_model import OnlineCostModel
from replicas.attention import resolve_backend
from replicas.kv_cache import PagePool
from replicas.models import load_model, load_tokenizer
from replicas.models.checkpoint import our_name
from replicas.models.lora import LoraError
from replicas.kv_cache import KVCache
from replicas.memory import PoolSize, allocate_pool, plan_pool
from replicas.models.parallel import SINGLE, TensorParallel
from replicas.tensor_parallel import ForwardBroadcast, agreed_pool, follow
from replicas.messages import (INFILL_NEEDS, GenerateChunk, GenerateRequest, RequestError, SamplingParams,
                               WholeAnswer, request_problem, resume_problem, text_at_end)
from replicas.executor import ForwardFailed, StepExecutor
from replicas.commits import OutputProcessor
from replicas.prefix_cache import PrefixCache
from replicas.batching import SchedulerMode
from replicas.request import FinishReason, Request
from replicas.rows import RowTable
from replicas.runner import ModelRunner, refreshes_rows
from replicas.scheduler import Scheduler
from replicas.engine_config import EngineConfig, ServingShape, resolve_algorithm
from replicas.telemetry.step_stats import EngineTotals, StepStats
from replicas.commits import BlockCommit
from replicas.step import ScheduledStep, StepOutput
from replicas.text_encoding import text_encoder

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WARM_UP_SWEEPS = 3  # ``Engine.warm_up``: its step measurements keep the fastest of this many
ALGORITHM_CHOICES_KEPT = 64  # ``Engine.algorithm_for``: distinct (algorithm, parameters) choices kept validated
KEPT_VALUE_TYPES = frozenset({int, float, str, bool, type(None)})  # parameter values such a choice may hold


def torch_dtype(config: EngineConfig) -> torch.dtype:
    if config.dtype is None:
        return torch.bfloat16 if torch.device(config.device).type == "cuda" else torch.float32
    return DTYPES[config.dtype]


def on_device_with_pool(model: torch.nn.Module, config: EngineConfig,
                        wanted: ServingShape) -> tuple[torch.nn.Module, PoolSize, KVCache]:
    """``model`` on the configured device and dtype, its pool's size and its pool (a
    tensor-parallel rank's: its KV heads, as many pages as every rank has room for). On a CPU
    the process's heap keeps what forwards free (``replicas.host_heap``)."""
    device, dtype, spec = torch.device(config.device), torch_dtype(config), model.spec
    if device.type == "cpu":
        keep_freed_memory()
    model = model.to(device=device, dtype=dtype).eval()
    memory = plan_pool(model, config, spec, wanted, resolve_backend(config.attention_backend, device, dtype),
                       refreshes_rows(spec, config.kv_cache))
    memory = agreed_pool(memory, getattr(model, "tp", SINGLE), device)
    return model, memory, allocate_pool(spec, memory, dtype, device)


def load_share(model: str, config: EngineConfig, tp: TensorParallel = SINGLE) -> torch.nn.Module:
    """The checkpoint ``model`` as ``config`` asks for it: ``tp``'s rank's share."""
    return load_model(model, torch_dtype(config), config.device, lora=config.lora, overrides=config.model_overrides,
                      tp=tp)


def follow_as_rank(model: torch.nn.Module, config: EngineConfig) -> int:
    """A tensor-parallel rank other than 0 (``model``: its share): size its pool as rank 0
    does, then run the forwards rank 0 sends until it closes (``replicas.tensor_parallel``);
    returns how many ran."""
    model, _, kv_cache = on_device_with_pool(model, config, ServingShape.of(config, model.spec))
    device = torch.device(config.device)
    return follow(model, kv_cache, resolve_backend(config.attention_backend, device, torch_dtype(config)),
                  model.tp, device)


@dataclass(frozen=True)
class Abort:
    """An abort in the engine's inbox (a request in it is an add)."""

    request_id: str


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, name: str = "local"):
        """``clock`` times arrivals, waits and finishes (step durations are measured with
        ``time.perf_counter``); a test may pass a virtual one and step the engine itself.
        ``name``: the replica's, in every chunk it emits."""
        self.config = config = config or EngineConfig()
        self.name = name
        self.clock = clock
        spec = model.spec
        self.spec = spec
        self.tokenizer = tokenizer
        self._encode = text_encoder(tokenizer)
        self.block_length = size = spec.block_length
        wanted = ServingShape.of(config, spec)  # validates the settings before anything is sized
        default_name, default_params = resolve_algorithm(config, spec)
        get_algorithm(default_name).make_params(default_params)  # validate early
        self.model, self.memory, kv_cache = on_device_with_pool(model, config, wanted)
        log.info("%s", self.memory.summary())
        self.shape = shape = ServingShape.of(config, spec, self.memory)
        self.pool = PagePool(shape.num_pages, PrefixCache() if shape.prefix_cache else None)
        self.rows = RowTable(config.max_batch, shape.max_pages_per_request, size, pad_id=spec.eos_token_id)
        device = torch.device(config.device)
        self.runner = ModelRunner(self.model, self.rows, kv_cache, device, config.kv_cache,
                                  config.attention_backend, shape.canvas)
        tp = getattr(model, "tp", SINGLE)
        if tp.size > 1:  # the other ranks run each forward with it (``follow_as_rank``)
            self.runner.broadcast = ForwardBroadcast(tp, device)
        self.adapters = self._serve_adapters(config)
        self.executor = StepExecutor(self.runner, self.rows, spec.mask_token_id, config.fused_commit)
        self.cost_model = OnlineCostModel(config.max_batch, clock=clock)
        self.outputs = OutputProcessor(tokenizer, spec.end_token_ids)
        self.grammars = Grammars(tokenizer, spec.end_token_ids, (spec.mask_token_id,), spec.vocab_size)
        self.scheduler = Scheduler(SchedulerMode(config.mode), self.pool, self.rows, self.outputs, config.max_batch,
                                   shape.token_budget, size, spec.mask_token_id, fill_timeout=self._fill_timeout,
                                   fdfo_hold=self.cost_model.fdfo_hold if config.fdfo_fill_hold else (lambda rows: 0.0),
                                   clock=clock, full_canvas=shape.canvas == "full", whole_prompt=spec.whole_prompt)
        self.totals = EngineTotals()
        self._requests: dict[str, Request] = {}
        self._deadlines: list[tuple[float, int, str]] = []  # heap of (deadline, arrival order, request id)
        self._inbox: list[Request | Abort] = []  # from any thread; applied at the next step
        self._inbox_lock = threading.Lock()
        self._ids = itertools.count()
        self._arrivals = itertools.count()  # breaks deadline ties in the heap
        self.failed_steps_in_a_row = 0
        self._kept_algorithm = functools.lru_cache(maxsize=ALGORITHM_CHOICES_KEPT)(self._resolve_algorithm)

    def _serve_adapters(self, config: EngineConfig) -> ResidentAdapters | None:
        """The unmerged adapters' bank on the model, where ``config.adapters`` names any."""
        if not config.adapters:
            return None
        bank = enable_adapters(self.model)
        self.runner.adapters = bank
        return ResidentAdapters(bank, config.adapters, config.max_adapters, functools.partial(our_name, self.model))

    @classmethod
    def from_pretrained(cls, model: str = "tiny", config: EngineConfig | None = None, name: str = "local",
                        tp: TensorParallel = SINGLE) -> "Engine":
        """``tp``: rank 0 of a tensor-parallel group (the other ranks ``follow_as_rank``)."""
        config = config or EngineConfig()
        return cls(load_share(model, config, tp), load_tokenizer(model), config, name=name)

    # ---- requests ---------------------------------------------------------------
    def encode(self, prompt: str | list[str]) -> list[int] | list[list[int]]:
        """Tokenize user text (a list: each text, in one call of the tokenizer, about half
        the time of a call each); special-token strings in it stay text (never a mask)."""
        return self._encode(prompt, True)

    def algorithm_for(self, params: SamplingParams) -> tuple[DllmAlgorithm, AlgorithmParams]:
        """The request's algorithm and its parameters (raises RequestError). Requests that
        ask alike share one (frozen) parameters object: validating it is a third of the
        cost of making a request, so the last ``ALGORITHM_CHOICES_KEPT`` choices are kept."""
        # keyed by type too: 1, 1.0 and True are equal keys, and a bool is refused where an int is not
        overrides = tuple((key, type(value), value) for key, value in params.algorithm_params.items())
        keepable = type(params.algorithm) in KEPT_VALUE_TYPES and all(
            kind in KEPT_VALUE_TYPES for _, kind, _ in overrides)
        return (self._kept_algorithm if keepable else self._resolve_algorithm)(params.algorithm, overrides)

    def _resolve_algorithm(self, name: str | None, overrides: tuple) -> tuple[DllmAlgorithm, AlgorithmParams]:
        """``algorithm_for`` without the kept choices (``overrides``: (key, type, value) each)."""
        name, overrides = resolve_algorithm(self.config, self.spec, name, {key: value for key, _, value in overrides})
        try:
            algorithm = get_algorithm(name)
            return algorithm, algorithm.make_params(overrides)
        except AlgorithmError as exc:
            raise RequestError(str(exc)) from exc

    def make_request(self, request: GenerateRequest | str | Sequence[int], params: SamplingParams | None = None,
                     request_id: str | None = None,
                     on_output: Callable[[GenerateChunk], None] | None = None, whole: bool = False) -> Request:
        """The engine's ``Request`` of ``request`` (raises RequestError); does not enqueue it.
        ``request``: the engine request as the ingress made it, taken as it comes; or, asked
        directly of the engine (offline use, benches, tests), a prompt (text or ids) with
        ``params`` and ``request_id``, whose suffix and resumed ids are checked here as the
        ingress's preprocess and failover make theirs. Either way its ids and size are
        checked against the model and this replica's pool (``messages.request_problem``,
        cheap): an id outside the vocabulary would fault the device, a mask id would be
        denoised, and its pages must fit.
        ``whole``: ``on_output`` sees one chunk, the whole answer: it is (or is wrapped in) a
        ``messages.WholeAnswer``, to which the engine adds each block as it commits; without
        stop strings the answer carries no text, which the receiver decodes from its ids
        with ``with_answer_text``."""
        direct = not isinstance(request, GenerateRequest)
        if direct:
            prompt_ids = self.encode(request) if isinstance(request, str) else list(request)
            request = GenerateRequest(request_id or f"req-{next(self._ids)}", prompt_ids, params or SamplingParams())
        params = request.params
        problem = request_problem(request.prompt_ids, params.max_tokens, self.spec, self.shape.max_model_len,
                                  self.pool.capacity, params.suffix_ids)
        if problem:
            raise RequestError(problem.message)
        if direct:
            self._check_continuation(request)
        algorithm, algorithm_params = self.algorithm_for(params)
        if params.regex is not None and params.ignore_eos:
            raise RequestError(IGNORE_EOS_UNSTRUCTURED)
        if algorithm.pipelined:
            problem = block_pipeline.refusal(algorithm.name, self.spec, self.shape, params.regex is not None,
                                             params.logprobs is not None)
            if problem:
                raise RequestError(problem)
        constraint, constraint_state = (None, 0) if params.regex is None else self.grammars.begin(
            params.regex, params.max_tokens, params.resume_ids)
        adapter = self._adapter(request.adapter)
        if whole and not isinstance(on_output, WholeAnswer):
            on_output = WholeAnswer(on_output)
        return Request(
            request_id=request.request_id,
            prompt_ids=request.prompt_ids,
            params=params,
            algorithm=algorithm,
            algorithm_params=algorithm_params,
            block_length=self.block_length,
            arrival_time=self.clock(),
            on_output=on_output,
            whole=whole,
            aligned=self.shape.aligned,
            output_ids=list(params.resume_ids),
            detokenizer=None if text_at_end(params, whole) else self.outputs.detokenizer(params),
            block_logprobs=None if params.logprobs is None else [None] * self.block_length,
            constraint=constraint,
            constraint_state=constraint_state,
            adapter=adapter,
        )

    def _adapter(self, name: str | None) -> Adapter | None:
        """The loaded adapter ``name`` (None: the base model); RequestError for one not served."""
        if name is None:
            return None
        if self.adapters is None or name not in self.adapters.paths:
            raise RequestError(f"adapter {name!r} is not served here")
        try:
            return self.adapters.get(name)
        except LoraError as exc:
            raise RequestError(f"adapter {name!r} cannot be loaded: {exc}") from exc

    def _check_continuation(self, request: GenerateRequest) -> None:
        """Raise RequestError where the engine cannot go on from the request's resumed ids or
        fill in before its suffix."""
        params = request.params
        if params.suffix_ids and self.shape.canvas != "full":
            raise RequestError(INFILL_NEEDS)
        resume_error = resume_problem(params.resume_ids, params.max_tokens, self.spec,
                                      len(request.prompt_ids) if self.shape.aligned else 0)
        if resume_error:
            raise RequestError(resume_error)

    def with_answer_text(self, chunk: GenerateChunk, params: SamplingParams | None) -> GenerateChunk:
        """``chunk``, a whole answer asked with ``params``, with its text
        where the engine left that to the receiver (``messages.text_at_end``). Call it on the
        receiving thread: the decoding stays out of the engine's steps."""
        params = params or SamplingParams()
        if chunk.finished and chunk.error is None and text_at_end(params, whole=True):
            chunk.text = self.outputs.answer_text(params, chunk.token_ids)
        return chunk

    def add_request(self, request: GenerateRequest | str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None,
                    on_output: Callable[[GenerateChunk], None] | None = None, whole: bool = False) -> str:
        """Enqueue ``request`` (as ``make_request`` takes it) for the next step; its id."""
        made = self.make_request(request, params, request_id, on_output, whole)
        with self._inbox_lock:
            self._inbox.append(made)
        return made.request_id

    def abort(self, request_id: str) -> None:
        with self._inbox_lock:
            self._inbox.append(Abort(request_id))

    def has_work(self) -> bool:
        return bool(self._inbox or self.scheduler.has_work())

    def hold_s(self) -> float:
        """How long the scheduler chose to wait before its next step (fixed_fill's fill
        wait, fdfo's hold for arrivals), else 0."""
        hold_until = self.scheduler.hold_until
        return max(0.0, hold_until - self.clock()) if hold_until is not None else 0.0

    def _fill_timeout(self) -> float:
        if self.config.fill_timeout_s is not None:
            return self.config.fill_timeout_s
        return self.cost_model.fill_timeout()

    # ---- the step loop -------------------------------------------------------------
    def step(self) -> StepStats | None:
        """One step. A failure outside the forward and the algorithms fails the step's rows
        as a replica fault (their callers may resume them elsewhere) and is counted in
        ``failed_steps_in_a_row``; the engine goes on.

        It runs under ``torch.inference_mode()`` (no autograd bookkeeping on the step's
        many small tensor ops). A loop of steps enters that mode once around the loop, as
        ``generate`` and the async engine's thread do: entering it costs ~20 us a step on
        a CPU host right after a forward."""
        if torch.is_inference_mode_enabled():
            return self._step()
        with torch.inference_mode():
            return self._step()

    def _step(self) -> StepStats | None:
        """Requests in and out, schedule -> execute -> update, the commits streamed."""
        start, cpu_start = time.perf_counter(), time.thread_time()
        self._drain_inbox()
        self._expire()
        step = None
        try:
            step = self.scheduler.schedule()
            if step is None:
                return None
            output = self.executor.execute(step)
            for request, error in output.failed:
                self._fail(request, error)
            commits = self.scheduler.update_from_output(step, output)
            for request, commit in commits:
                self._stream(request, commit)
        except Exception as exc:
            self._fail_step(step, exc)
            return None
        self.failed_steps_in_a_row = 0
        return self._record(step, output, commits, start, cpu_start)

    def _fail_step(self, step: ScheduledStep | None, exc: Exception) -> None:
        """Fail the requests of a step that raised (all running ones where it failed before
        it was scheduled) as a replica fault; a failed forward is not a failed step."""
        concerned = step.requests if step is not None else list(self.scheduler.running)
        if isinstance(exc, ForwardFailed):  # a broken forward fails its rows, never the engine
            log.exception("forward failed; failing %d requests", len(concerned))
            self.failed_steps_in_a_row, error = 0, str(exc)
        else:
            self.failed_steps_in_a_row += 1
            log.exception("engine step failed (%d in a row)", self.failed_steps_in_a_row)
            error = f"the replica's engine step failed: {type(exc).__name__}: {exc}"
        for request in [r for r in concerned if r.finish_reason is None]:
            self._fail(request, error, replica_fault=True)

    def _stream(self, request: Request, commit: BlockCommit) -> None:
        """Count a committed block and stream it (a request it ends leaves the engine)."""
        self.totals.output_tokens += len(commit.token_ids)
        if request.finish_reason is None:
            if request.whole:  # its receiver's, until its end
                request.on_output.add(commit.text, commit.token_ids, commit.logprobs, request.num_steps)
                return
        else:
            self.totals.requests_finished += 1
            self.cost_model.observe_finished(len(request.committed_block_steps))
            self._requests.pop(request.request_id, None)
        self._emit(request, commit.token_ids, commit.text, commit.logprobs)

    def _record(self, step: ScheduledStep, output: StepOutput, commits: list[tuple[Request, BlockCommit]],
                start: float, cpu_start: float) -> StepStats:
        """The step's statistics, into the totals and the cost model."""
        batch = step.batch
        block_steps = tuple(request.committed_block_steps[-1] for request, _ in commits)
        stats = StepStats(
            batch_size=batch.num_rows,
            active_rows=sum(entry.owner is entry for entry in step.stepped),  # rows, not the blocks decoded ahead
            num_tokens=batch.num_tokens,
            forward_s=output.forward_s,
            step_s=time.perf_counter() - start,
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            blocks_committed=len(block_steps),
            block_steps=block_steps,
            prefix_units=batch.prefix_units,
            prompt_pages=batch.prompt_pages,
            forward_cpu_s=output.forward_cpu_s,
            step_cpu_s=time.thread_time() - cpu_start,
        )
        self.totals.record(stats)
        self.cost_model.observe_step(stats.batch_size, stats.step_s, stats.block_steps, stats.prompt_pages)
        return stats

    def _emit(self, request: Request, token_ids: list[int] | None = None, text: str = "", logprobs=None,
              error: str | None = None, error_kind: str | None = None) -> None:
        """Stream a chunk of the request to its caller: a committed block (``token_ids`` and
        ``logprobs``: the commit's own lists, handed on as they are), or its end."""
        reason = request.finish_reason
        request.emit(GenerateChunk(
            text=text, token_ids=[] if token_ids is None else token_ids, finished=reason is not None,
            finish_reason=None if reason is None else reason.value, error=error, error_kind=error_kind,
            # an infill's suffix is on the canvas too
            prompt_tokens=len(request.prompt_ids) + len(request.params.suffix_ids),
            cached_tokens=min(request.cached_tokens, len(request.prompt_ids)),
            completion_tokens=len(request.output_ids),
            steps=request.num_steps, block_steps=list(request.committed_block_steps), replica=self.name,
            engine_s=self.clock() - request.arrival_time,
            logprobs=None if request.params.logprobs is None else logprobs or []))

    def _drain_inbox(self) -> None:
        """Apply queued adds and aborts in order; one that fails is logged (a failed add
        fails its request), the others still apply."""
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            try:
                if isinstance(item, Abort):
                    self._abort_now(item.request_id)
                else:
                    self.cost_model.observe_arrival(item.arrival_time)
                    self._requests[item.request_id] = item
                    if item.deadline is not None:
                        heapq.heappush(self._deadlines, (item.deadline, next(self._arrivals), item.request_id))
                    self.scheduler.add(item)
            except Exception as exc:
                log.exception("engine inbox: the %s of request %s failed",
                              "abort" if isinstance(item, Abort) else "add", item.request_id)
                if not isinstance(item, Abort):
                    self._fail(item, f"the replica could not queue the request: {exc}", replica_fault=True)

    def _expire(self) -> None:
        """End the requests past their deadline (``SamplingParams.timeout_s``) with what they
        committed, finish reason ``timeout`` (not an error); the heap holds their ids, and
        those of requests that ended otherwise just leave it."""
        now = self.clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, _, request_id = heapq.heappop(self._deadlines)
            request = self._requests.get(request_id)
            if request is None or request.deadline != deadline:  # ended, or its id is a later request's now
                continue
            try:  # its committed blocks are its answer: the text held back is final now
                text = self.scheduler.end_at_deadline(request)
            except Exception as exc:  # never left holding its row: it ends as a failure instead
                log.exception("request %s: its end at the deadline failed", request_id)
                self._fail(request, f"the request's end at its deadline failed: {type(exc).__name__}: {exc}")
                continue
            del self._requests[request_id]
            self._emit(request, text=text)
            self.totals.requests_timed_out += 1

    def _abort_now(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return  # already finished or unknown: nothing to do
        self._end(request, FinishReason.ABORT, None)
        self.totals.requests_aborted += 1

    def _fail(self, request: Request, error: str, replica_fault: bool = False) -> None:
        self._requests.pop(request.request_id, None)
        error_kind = "replica_fault" if replica_fault else None
        try:
            self._end(request, FinishReason.ERROR, error, error_kind)
        except Exception:  # state too broken to free its row: the caller still hears of it
            log.exception("could not end request %s cleanly", request.request_id)
            self._emit(request, error=error, error_kind=error_kind)
        self.totals.requests_failed += 1

    def _end(self, request: Request, reason: FinishReason, error: str | None, error_kind: str | None = None) -> None:
        """End ``request`` where it is, and tell its receiver."""
        if self.scheduler.finish(request, reason):
            self._emit(request, error=error, error_kind=error_kind)

    def warm_up(self) -> None:
        """Measure the step cost before serving: closed batches of one-block requests of 1,
        half and all ``max_batch`` rows (after one that pays the first forward's set-up), so
        that the first stats report carries a step-cost fit over the batches admission will
        see. The batches run ``WARM_UP_SWEEPS`` times and each kind of step (rows, prompt
        pages) keeps its fastest measurements, one sweep's worth: a replica starts while
        the rest of the cluster does, and steps slowed down by the other processes would
        have admission refuse what the replica can serve until real steps replace them.
        The step records stay, and the blocks' steps stand in for real ones until a real
        block commits (``OnlineCostModel.prior_steps_per_block``): admission charges a
        request by them, not by the algorithm's worst case, from the first one. The
        requests' other counts and the totals are forgotten."""
        params = SamplingParams(max_tokens=self.block_length, ignore_eos=True)
        prompt = [self.spec.eos_token_id]
        self.generate([prompt], params)
        measured: dict[tuple[int, int], list[float]] = {}
        block_steps: Counter = Counter()

        def observe(stats: StepStats) -> None:
            measured.setdefault((stats.batch_size, stats.prompt_pages), []).append(stats.step_s)
            block_steps.update(stats.block_steps)

        for _ in range(WARM_UP_SWEEPS):
            for rows in sorted({1, max(1, self.config.max_batch // 2), self.config.max_batch}):
                self.generate([prompt] * rows, params, on_step=observe)
        self.cost_model.forget()
        for (rows, pages), seconds in measured.items():
            for fastest in sorted(seconds)[:-(-len(seconds) // WARM_UP_SWEEPS)]:
                self.cost_model.observe_step(rows, fastest, (), pages)
        self.cost_model.prior_steps_per_block(block_steps)
        self.totals = EngineTotals()

    # ---- offline convenience ---------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int] | GenerateRequest],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_step: Callable[[StepStats], None] | None = None) -> list[GenerateChunk]:
        """Run ``prompts`` to completion as one closed batch; one chunk per prompt, its whole
        answer, in order (an engine request runs with its own parameters and adapter).
        ``on_step`` sees every step's statistics."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        params = [prompt.params if isinstance(prompt, GenerateRequest) else p for prompt, p in zip(prompts, params)]
        texts = [prompt for prompt in prompts if isinstance(prompt, str)]
        encoded = iter(self.encode(texts) if texts else ())
        prompts = [next(encoded) if isinstance(prompt, str) else prompt for prompt in prompts]
        chunks: list[list[GenerateChunk]] = [[] for _ in prompts]
        for prompt, p, sink in zip(prompts, params, chunks):
            self.add_request(prompt, p, on_output=sink.append, whole=True)
        with torch.inference_mode():  # once for the loop (see ``step``)
            while self.has_work():
                stats = self.step()
                if stats is None:
                    time.sleep(min(self.hold_s(), 0.01))
                elif on_step is not None:
                    on_step(stats)
        return [self.with_answer_text(sink[-1], p) for sink, p in zip(chunks, params)]
