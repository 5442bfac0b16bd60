"""Errors as OpenAI error bodies: `{"error": {"message", "type", "param", "code"}}`.

Every failure an HTTP client can see goes through `error_body`: user errors from
`sits.core.errors` become 400 with `param` naming the field, pydantic validation errors become
400 (not FastAPI's 422), a body that is not UTF-8 a 400 that says so, unknown models 404, bad
API keys 401, rate limits 429 (with Retry-After), draining, overload shedding, an open circuit
breaker or a dead engine 503.
Only unexpected exceptions are 500, and their message never carries a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sits.core.errors import EngineDeadError, InvalidParameterError, PromptTooLongError, SitsError
from sits.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"


class ServerError(Exception):
    """An error with its HTTP status and OpenAI error fields.

    Attributes:
        status: HTTP status code.
        message: human-readable message.
        type: OpenAI error type ("invalid_request_error", "service_unavailable_error", ...).
        param: the request field at fault, or None.
        code: a short machine-readable code, or None.
        headers: extra response headers (Retry-After, rate limits), or None.
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


def model_not_found(name: str) -> ServerError:
    """404 for a `model` this server does not serve."""
    return ServerError(
        404,
        f"The model `{name}` does not exist.",
        param="model",
        code="model_not_found",
    )


def unavailable(message: str, code: str) -> ServerError:
    """503: the server is draining or the engine is down; the client should retry elsewhere."""
    return ServerError(503, message, type="service_unavailable_error", code=code)


DRAINING_RETRY_AFTER_S = 1  # another replica (or this one's successor) can take it now


def draining_error() -> ServerError:
    """503 for requests that arrive (or are cut) while the server shuts down, with
    Retry-After (`DRAINING_RETRY_AFTER_S`): clients and gateways that honour it retry soon,
    behind a load balancer on another replica."""
    err = unavailable("The server is shutting down; retry on another replica.", "draining")
    err.headers = {"Retry-After": str(DRAINING_RETRY_AFTER_S)}
    return err


def unsupported(param: str, message: str) -> ServerError:
    """400 for a field sits does not implement and will not ignore."""
    return ServerError(400, message, param=param, code="unsupported_parameter")


def to_server_error(exc: BaseException) -> ServerError:
    """Map any exception to a `ServerError` (500 for unexpected ones, logged with traceback)."""
    if isinstance(exc, ServerError):
        return exc
    if isinstance(exc, PromptTooLongError):  # OpenAI's code for a prompt over the context
        return ServerError(400, str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, InvalidParameterError):
        return ServerError(400, str(exc), param=exc.param, code="invalid_value")
    if isinstance(exc, EngineDeadError):
        return unavailable(f"The engine is not running: {exc}", "engine_dead")
    if isinstance(exc, SitsError):
        return ServerError(400, str(exc))
    logger.error("unexpected error while serving a request", exc_info=exc)
    return ServerError(
        500, f"Internal server error ({type(exc).__name__}).", type="internal_server_error"
    )


def error_body(err: ServerError) -> dict[str, Any]:
    """The OpenAI error body of `err` as a JSON-ready dict."""
    info = ErrorInfo(message=err.message, type=err.type, param=err.param, code=err.code)
    return ErrorResponse(error=info).model_dump()


def error_response(err: ServerError, headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSONResponse carrying `err` with its status and `headers` (default: err.headers)."""
    return JSONResponse(
        error_body(err),
        status_code=err.status,
        headers=headers if headers is not None else err.headers,
    )


_SEND_JSON = "send a JSON object with the header Content-Type: application/json"


def validation_error(exc: RequestValidationError, content_type: str | None = None) -> ServerError:
    """400 for a body pydantic refused; `param` is the first field at fault.

    Unknown fields read as OpenAI's "Unrecognized request argument supplied: NAME". A body that
    is no JSON object because it was not sent as JSON (`content_type`, the request's header, is
    not application/json) says so, instead of calling the body itself wrong.
    """
    errors = exc.errors()
    if not errors:
        return ServerError(400, "Invalid request body.")
    first = errors[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    param = str(loc[0]) if loc and isinstance(loc[0], str) else None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return ServerError(400, f"The body is not valid JSON: {first.get('msg', '')}.")
    if kind == "extra_forbidden" and len(loc) == 1:
        return ServerError(
            400, f"Unrecognized request argument supplied: {param}", param=param, code=None
        )
    if not loc:
        if kind == "missing":
            return ServerError(400, f"The request has no body: {_SEND_JSON}.")
        if kind in ("model_attributes_type", "dict_type", "model_type"):
            media_type = (content_type or "").split(";")[0].strip().lower()
            if media_type != "application/json":
                shown = f"'{media_type}'" if media_type else "missing"
                return ServerError(
                    400,
                    f"The request's Content-Type is {shown}, not application/json: {_SEND_JSON}.",
                )
            return ServerError(400, f"The request body is not a JSON object: {_SEND_JSON}.")
        return ServerError(400, f"Invalid request body: {first.get('msg', '')}.")
    union_at, branches = _union_branches(errors, loc)
    if len(branches) > 1:  # pydantic tried each type of a union field: name them all
        return ServerError(400, f"{union_at}: expected one of {', '.join(branches)}.", param=param)
    where = ".".join(str(part) for part in loc)
    return ServerError(400, f"{where}: {first.get('msg', 'invalid value')}.", param=param)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def _is_type_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part)


def _union_branches(errors: list[Any], loc: list[Any]) -> tuple[str, list[str]]:
    """Where the first error's union field is ("prompt", "messages.0.content") and the member
    types pydantic tried for it (the location part after it that names a type, e.g. "str",
    "list[int]", "list[ContentPart]"), in order; no branches, or one, when the first error
    is not in a union."""
    index = next((i for i, part in enumerate(loc) if i and _is_type_tag(part)), None)
    if index is None:
        return "", []
    prefix = loc[:index]
    branches: list[str] = []
    for error in errors:
        other = [part for part in error.get("loc", ()) if part != "body"]
        tag = other[index] if len(other) > index and other[:index] == prefix else None
        if _is_type_tag(tag) and tag not in branches:
            branches.append(tag)
    return ".".join(str(part) for part in prefix), branches


InvalidBodyHook = Callable[[Request, ServerError], Awaitable[ServerError]]


def install_error_handlers(app: FastAPI, on_invalid_body: InvalidBodyHook | None = None) -> None:
    """Make every error `app` raises an OpenAI error body.

    Args:
        app: the application.
        on_invalid_body: called with a request whose body was refused before its handler ran
            and the 400 made for it; returns the error to answer (the 400, or a 401 when the
            request has no tenant) after counting it.
    """

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc, request.headers.get("content-type"))
        if on_invalid_body is not None:
            err = await on_invalid_body(request, err)
        return error_response(err, headers=err.headers)

    @app.exception_handler(ServerError)
    async def _on_server_error(request: Request, exc: ServerError) -> JSONResponse:
        return error_response(exc, headers=exc.headers)

    @app.exception_handler(SitsError)
    async def _on_sits_error(request: Request, exc: SitsError) -> JSONResponse:
        return error_response(to_server_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = undecodable_body(exc)
        if err is not None:  # a refused body, as invalid JSON is
            if on_invalid_body is not None:
                err = await on_invalid_body(request, err)
            return error_response(err, headers=err.headers)
        phrase = _status_phrase(exc.status_code)
        message = exc.detail if isinstance(exc.detail, str) else phrase
        code = phrase.lower().replace(" ", "_") or None
        err = ServerError(exc.status_code, message or phrase, code=code)
        return error_response(err, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(to_server_error(exc))


def undecodable_body(exc: StarletteHTTPException) -> ServerError | None:
    """400 saying the body is not UTF-8, for FastAPI's generic "There was an error parsing
    the body" raised from a `UnicodeDecodeError` (JSON bytes that do not decode); None for any
    other HTTP error."""
    cause = exc.__cause__
    if exc.status_code != 400 or not isinstance(cause, UnicodeDecodeError):
        return None
    return ServerError(
        400,
        f"The body is not valid UTF-8 ({cause.reason} at byte {cause.start}): send the JSON "
        "encoded as UTF-8.",
    )


def _status_phrase(status_code: int) -> str:
    """The HTTP reason phrase ("Not Found"), or "" for a non-standard code."""
    try:
        return HTTPStatus(status_code).phrase
    except ValueError:
        return ""
