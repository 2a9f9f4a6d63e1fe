"""A request that is not queued — a token count, a tokenization, a cancel — still leaves its usage row, as
every request with a valid key does (no tokens: nothing was served), and is held to its limits on requests:
per minute and in flight (a tenant's loop of tokenizations is a cost like any other)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Awaitable, Callable

from fairgate.http.messages import Request, Response
from fairgate.proxy.call import Call, Status, new_request_id
from fairgate.proxy.errors import APIError
from fairgate.proxy.pipeline.caller import KeyIdentity, authenticate
from fairgate.proxy.pipeline.validate import ParsedRequest

if TYPE_CHECKING:
    from fairgate.proxy.app import Gateway

Handler = Callable[[Request, KeyIdentity, Call], Awaitable[Response]]


async def audited(gateway: Gateway, request: Request, endpoint: str, handler: Handler) -> Response:
    """Authenticate, run ``handler`` with the key and the request's ``Call``, and end it as any request ends
    (``Gateway.settle``) whatever it did."""
    key = await authenticate(request, gateway.keys)
    request.trust()
    call = Call(new_request_id(), endpoint, app=key.app, user=key.user, key_id=key.key_id)
    try:
        await gateway.quotas.admit(call, ParsedRequest(endpoint, {}, "", False, False, 0, None), key.user_shared,
                                   request_limits=gateway.config.policy != "fairserve", requests_only=True)
        response = await handler(request, key, call)
        call.http_status = response.status
        return response
    except APIError as e:
        call.fail(Status.THROTTLED if e.status == 429 else Status.REJECTED if e.status < 500 else Status.ERROR,
                  e.status, e.message)
        if e.status == 429:
            call.throttle_reason = e.code
        raise
    except asyncio.CancelledError:
        call.fail(Status.CANCELLED, 499, "client disconnected")
        raise
    except Exception as e:  # (a bug: the edge answers 500, and so does the row)
        call.fail(Status.ERROR, 500, f"internal error: {type(e).__name__}")
        raise
    finally:
        gateway.settle(call)  # (its row, its limits, its access record and metrics: as any request's end)
