"""The Responses API's routes on stored responses: ``GET /v1/responses/{id}``, ``GET …/{id}/input_items``,
``DELETE /v1/responses/{id}``, ``POST …/{id}/cancel`` and ``POST /v1/responses/input_tokens``. Each needs a key
and sees only what its app (and user) stored: another tenant's id answers exactly as an unknown one does. Cheap
reads, not queued behind generation; each leaves its usage row and is held to the key's request limits
(proxy/audit.py). A component of ``Gateway`` (``proxy/app.py``), reading its parts."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

import orjson

from fairgate.accounting.tokenizer import off_the_loop, response_messages
from fairgate.http.messages import Request, Response, json_response
from fairgate.proxy.audit import audited
from fairgate.proxy.call import Call, utcnow
from fairgate.proxy.errors import APIError, bad_request, brief, model_not_found
from fairgate.proxy.pipeline.caller import resolve
from fairgate.proxy.pipeline.responses import input_items, item_ids, known_shape, not_found, store_unavailable
from fairgate.proxy.pipeline.validate import body_of
from fairgate.storage.response_store import ChainTooLong, StoreUnavailable

if TYPE_CHECKING:
    from fairgate.proxy.app import Gateway

MAX_QUERY = 2048  # bytes of a query string


class StoredResponses:
    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    def _caller(self, request: Request, key, call: Call):
        """The key's app and user (a user named by header, as for a request; none in a GET's body)."""
        caller = resolve(request, key, None, call.request_id, self.gateway.stages, self.gateway.tenants.is_shared)
        call.user = caller.user
        return caller

    async def _store(self, reading):
        """A read or deletion of the store; the database not answering is a 503 with retry-after."""
        try:
            return await reading
        except StoreUnavailable as e:
            raise store_unavailable(e, self.gateway.config.retry_after_s) from None

    @staticmethod
    def _parts(request: Request) -> tuple[str, str]:
        rest = request.match_info["rest"]
        response_id, _, tail = rest.partition("/")
        if not known_shape(response_id):  # (no id the gateway made: nothing to look up)
            raise not_found(response_id)
        return response_id, tail

    async def read(self, request: Request) -> Response:
        return await audited(self.gateway, request, "responses.get", self._read)

    async def _read(self, request: Request, key, call: Call) -> Response:
        response_id, tail = self._parts(request)
        if tail not in ("", "input_items"):
            raise APIError(404, f"no route for GET {request.path[:200]}", code="not_found")
        caller = self._caller(request, key, call)
        query = self._query(request)
        if query.get("stream") in ("true", "1"):
            raise bad_request("'stream': fairgate streams a response as it is made, not again from the store "
                              "(no background responses)", param="stream", code="unsupported_parameter")
        stored = await self._store(self.gateway.responses.get(caller.app, caller.user, response_id, utcnow(),
                                                               tail or "response"))
        if stored is None:
            raise not_found(response_id)
        if tail == "":
            return Response(body=stored.encode(), content_type="application/json")
        return json_response(self._page(response_id, orjson.loads(stored), query))

    @staticmethod
    def _query(request: Request) -> dict[str, str]:
        raw = request.query_string or ""
        if len(raw) > MAX_QUERY:
            raise bad_request("the query string is too long")
        return dict(parse_qsl(raw, keep_blank_values=True))

    @staticmethod
    def _page(response_id: str, items: list[Any], query: dict[str, str]) -> dict[str, Any]:
        """OpenAI's list of input items: ``limit`` (1-100, 20), ``order`` (``desc`` first, or ``asc``), ``after``."""
        raw_limit = query.get("limit", "20")
        if not (raw_limit.isascii() and raw_limit.isdigit() and 1 <= int(raw_limit) <= 100):
            raise bad_request("'limit' must be an integer from 1 to 100", param="limit")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("'order' must be 'asc' or 'desc'", param="order")
        listed = item_ids(response_id, items)
        if order == "desc":
            listed.reverse()
        after = query.get("after")
        if after is not None:
            at = next((i for i, item in enumerate(listed) if item["id"] == after), None)
            if at is None:
                raise bad_request(f"'after': no input item {after[:80]!r} in this response", param="after")
            listed = listed[at + 1:]
        page = listed[:int(raw_limit)]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(listed) > len(page)}

    async def delete(self, request: Request) -> Response:
        return await audited(self.gateway, request, "responses.delete", self._delete)

    async def _delete(self, request: Request, key, call: Call) -> Response:
        response_id, tail = self._parts(request)
        if tail:
            raise APIError(404, f"no route for DELETE {request.path[:200]}", code="not_found")
        caller = self._caller(request, key, call)
        if not await self._store(self.gateway.responses.delete(caller.app, caller.user, response_id, utcnow())):
            raise not_found(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def cancel(self, request: Request) -> Response:
        return await audited(self.gateway, request, "responses.cancel", self._cancel)

    async def _cancel(self, request: Request, key, call: Call) -> Response:
        response_id, tail = self._parts(request)
        if tail != "cancel":
            raise APIError(404, f"no route for POST {request.path[:200]}", code="not_found")
        caller = self._caller(request, key, call)
        if await self._store(self.gateway.responses.get(caller.app, caller.user, response_id, utcnow(),
                                                        "turn")) is None:
            raise not_found(response_id)
        raise bad_request("only a background response can be cancelled, and fairgate runs none: a response is "
                          "stored once it has finished", param="response_id", code="not_background")

    async def input_tokens(self, request: Request) -> Response:
        """``POST /v1/responses/input_tokens``: the tokens a request's whole input (its chain included) would
        take, counted by the gateway as it counts a request before queueing it."""
        return await audited(self.gateway, request, "responses.input_tokens", self._input_tokens)

    async def _input_tokens(self, request: Request, key, call: Call) -> Response:
        g = self.gateway
        try:
            body = orjson.loads(await body_of(request, g.config.max_body_bytes, g.config.body_timeout_s))
        except orjson.JSONDecodeError as e:
            raise bad_request(f"the body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or model not in g.pool.known_models():
            raise model_not_found(model)
        instructions, tools = body.get("instructions"), body.get("tools")
        if instructions is not None and not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string", param="instructions")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise bad_request("'tools' must be an array of tools", param="tools")
        items = input_items(body["input"]) if body.get("input") is not None else []
        user = body.get("user")
        caller = resolve(request, key, user if isinstance(user, str) else None, call.request_id, g.stages,
                         g.tenants.is_shared)
        call.user, call.model = caller.user, model
        history: list[Any] = []
        chain: list[Any] = []
        if (previous := body.get("previous_response_id")) is not None:
            if not known_shape(previous):
                raise not_found(brief(previous))
            try:
                chain = await self._store(g.responses.chain(caller.app, caller.user, previous, utcnow()))
            except ChainTooLong:
                chain = None
            if chain is None:
                raise not_found(previous)
            history = [item for turn in chain for item in (*turn.input_items, *turn.output_items)]
        counting = functools.partial(g.tokenizer(model).count_chat, response_messages(instructions, history + items),
                                     None, {"tools": tools} if tools else None)
        counted = await off_the_loop(counting, sum(t.chain_bytes for t in chain[-1:]) + len(str(items)))
        return json_response({"object": "response.input_tokens", "input_tokens": counted.prompt_tokens})
