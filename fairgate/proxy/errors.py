"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

import orjson

from fairgate.http.messages import HTTPError, Response
from fairgate.printable import printable

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         501: "invalid_request_error",
         502: "server_error", 503: "server_error", 504: "server_error"}


class APIError(HTTPError):
    """The listener's ``HTTPError`` in OpenAI's shape (``fairgate.http`` renders the gateway's errors with it)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(status, message, code=code, headers=headers)
        self.param = param
        self.type = type or TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, request_id: str | None = None) -> Response:
        headers = dict(self.headers)
        if request_id:
            headers["x-request-id"] = request_id
        return Response(status=self.status, body=orjson.dumps(self.body()), headers=headers,
                        content_type="application/json")


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_body(e: APIError) -> dict:
    """An error in the shape of Anthropic's API (for ``/v1/messages``)."""
    kind = ANTHROPIC_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def anthropic_response(e: APIError, request_id: str | None = None) -> Response:
    response = e.response(request_id)
    response.body = orjson.dumps(anthropic_body(e))
    return response


def brief(value: object, limit: int = 60) -> str:
    """A client's value for an error message, at most ``limit`` characters and never walked: an array or object
    (which a client may nest 1,000 deep, past what ``repr`` and ``str`` recurse through) is named, not shown."""
    if isinstance(value, list):
        return f"[…] ({len(value)} items)"
    if isinstance(value, dict):
        return f"{{…}} ({len(value)} fields)"
    if isinstance(value, str):
        return repr(value[:limit]) + ("…" if len(value) > limit else "")
    return repr(value)[:limit]


def model_not_found(model: object) -> APIError:
    shown = printable(model[:80]) if isinstance(model, str) else brief(model)  # (it reaches rows and terminals)
    return APIError(404, f"The model `{shown}` does not exist.", param="model", code="model_not_found")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, retry_after_s: int = 1) -> APIError:
    return APIError(503, message, code="no_backend_available",
                    headers={"retry-after": str(retry_after_s), "x-should-retry": "true"})


class ClientGone(Exception):
    """Writing to the client failed: it disconnected. Carries the response already started, if any."""

    def __init__(self, message: str, response=None):
        super().__init__(message)
        self.response = response  # (a StreamResponse)
