"""Every HTTP response an ingress replica sends, by status code and by time taken.

Whatever carries HTTP to the ingress (its own server, HAProxy or Serve's proxy), the
ingress's ASGI app answers every request, so this middleware sees them all: the numbers
reach the metrics actor with the ingress's report (``IngressReport.responses``,
``response_buckets``) as ``dllm_http_responses_total`` and
``dllm_http_response_seconds``. A streamed response is timed to its last byte.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter

from replicas.telemetry.reports import HTTP_SECONDS_BOUNDS


class Tally:
    """Totals since the process started (a lost report loses nothing)."""

    def __init__(self):
        self.responses: Counter[str] = Counter()
        self.buckets = [0] * len(HTTP_SECONDS_BOUNDS)
        self.seconds = 0.0

    def add(self, status: int, seconds: float) -> None:
        self.responses[str(status)] += 1
        self.buckets[bisect.bisect_left(HTTP_SECONDS_BOUNDS, seconds)] += 1
        self.seconds += seconds

    def report(self) -> dict:
        """The ``IngressReport`` fields of these totals."""
        return {"responses": dict(self.responses), "response_buckets": list(self.buckets),
                "response_seconds": self.seconds}


TALLY = Tally()  # this process's (read it as ``http_tally.TALLY``: Serve ships the Ingress class
# with copies of the objects its module held, modules and classes excepted)


class HttpTally:
    """ASGI middleware adding each HTTP response to ``TALLY``."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.monotonic(), 500  # no response started: the server answers 500

        async def tallied(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, tallied)
        finally:
            TALLY.add(status, time.monotonic() - start)
