"""What the load generator records about one request."""

from __future__ import annotations

from dataclasses import asdict, dataclass

OK, REFUSED, ERROR = "ok", "refused", "error"


class LoadgenError(Exception):
    """Bad input or an unusable endpoint; the message is shown to the user as is."""


@dataclass(frozen=True)
class Arrival:
    """One planned request: when to send it (seconds from the start) and what to ask."""

    time_s: float
    prompt: str  # a chat's later turn: its new message only
    max_tokens: int | None = None  # None: the run's --max-tokens
    after: int | None = None  # a chat's later turn: the index of its previous turn (see ``loops``)
    history: tuple[str, ...] = ()  # the chat's earlier messages, user and assistant in turn

    @property
    def text(self) -> str:
        """What a completion request sends: the chat's earlier messages, then the prompt."""
        return "".join(self.history) + self.prompt


@dataclass
class Record:
    """The outcome of one request; times are seconds from the start of the run.

    ``status`` is ``ok`` (streamed to ``[DONE]``), ``refused`` (HTTP 429) or ``error``.
    ``latency_s`` is from the actual send to the end of the response (for every status);
    ``ttfb_s`` from the send to the first streamed chunk that carries text.
    ``tokens_from`` says where ``output_tokens`` came from: ``usage`` (the server's final
    usage chunk) or ``characters`` (non-whitespace characters of the streamed text, exact
    for the tiny model's character tokenizer, an approximation for other models).
    """

    index: int
    planned_s: float
    sent_s: float
    status: str = ERROR
    http_status: int | None = None
    latency_s: float | None = None
    ttfb_s: float | None = None
    output_tokens: int = 0
    tokens_from: str | None = None
    prompt_tokens: int | None = None  # from the server's usage
    cached_tokens: int | None = None  # of those, found in a prefix cache (usage.prompt_tokens_details)
    steps: int | None = None
    replica: str | None = None
    engine_s: float | None = None  # the server's time in its engine (dllm-serve reports it)
    quality_level: int | None = None  # the server's load-knob level the request ran at (dllm-serve reports it)
    retry_after_s: float | None = None
    error: str | None = None
    text: str = ""  # the answer (a chat's next turn sends it back)

    @property
    def end_s(self) -> float | None:
        return None if self.latency_s is None else self.sent_s + self.latency_s

    def to_dict(self) -> dict:
        return asdict(self)
