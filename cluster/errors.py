"""OpenAI-style error envelopes for every failure the API can answer.

A client's own mistakes are told in full (4xx, naming the field in ``param``); a failure
of ours never shows its text, exception class or traceback to the client: a 500 carries
a generic message and a request id (``internal_error``), and the details go to the log
under that id. A client that leaves while it sends its body (Starlette's ``ClientDisconnect``)
is no failure: a 499, logged at debug level.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from cluster.disconnects import client_closed
from cluster.protocol import new_id


log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def internal_error(request_id: str) -> APIError:
    """The 500 for a failure of ours: a generic message with the request id, nothing else
    (log the details under ``request_id``)."""
    return APIError(500, f"internal error; request id {request_id}", type_="server_error", code="internal_error")


def validation_error(errors: list[dict]) -> APIError:
    """The 400 for pydantic's (or FastAPI's) validation errors: the first one, named by its field."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(),
                           code="invalid_json")
    location = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(location) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "value_error" and "error" in first.get("ctx", {}):
        message = str(first["ctx"]["error"])  # our own validators' words, without pydantic's "Value error, "
    if first.get("type") == "missing":
        message = f"'{param}' is a required field"
    elif param:
        message = f"{param}: {message}"
    return bad_request(message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type_=kind).response()

    # a handler of its own: the catch-all's (Starlette's outermost middleware) raises the
    # exception again for the server to log, after the 500
    @app.exception_handler(ClientDisconnect)
    async def _left(request: Request, exc: ClientDisconnect):
        return client_left(request.method, request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return logged_failure(request.method, request.url.path, exc).response()


def client_left(method: str, path: str) -> Response:
    """The 499 for a request whose client left while sending its body."""
    log.debug("%s %s: the client left while sending the body", method, path)
    return client_closed()


def logged_failure(method: str, path: str, exc: BaseException) -> APIError:
    """The 500 for anything else a route raised: a bug of ours, told to the log under a new
    request id, not to the client."""
    request_id = new_id("req")
    log.error("request %s (%s %s) failed", request_id, method, path, exc_info=exc)
    return internal_error(request_id)
