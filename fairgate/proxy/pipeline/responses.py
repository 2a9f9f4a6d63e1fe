"""The Responses API's request and answer, as the gateway handles them (docs/guide/responses.md).

fairgate owns a conversation's state: a request naming ``previous_response_id`` has its chain read from the
database (storage/response_store.py) and expanded into the whole input before it queues; the backend is sent
that input with ``store: false``, so any backend behind any replica serves the follow-up. The answer's response
object gets the gateway's id (unguessable, scoped to the app and user), the client's ``previous_response_id``,
``store`` and ``metadata``; a stored response keeps this turn's own input items and the output items. The
turns of a chain share one interaction (the first turn's, unless the client names one), so FairServe never
throttles an agent in the middle of a conversation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from fairgate.proxy.call import utcnow
from fairgate.proxy.errors import APIError, bad_request
from fairgate.proxy.pipeline.caller import MAX_STAGE, Caller
from fairgate.storage.response_store import ChainTooLong, ResponseStore, StoreUnavailable, Turn, new_response_id

if TYPE_CHECKING:
    from fairgate.proxy.config import GatewayConfig
    from fairgate.proxy.pipeline.validate import ParsedRequest

MAX_ITEMS = 2048  # items in one request's input
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
ROLES = ("user", "assistant", "system", "developer")
TERMINAL = (b"response.completed", b"response.incomplete", b"response.failed")
# the events whose "response" object names the response: given the gateway's id and the client's fields
NAMED = frozenset(("response.created", "response.in_progress", "response.queued", "response.completed",
                   "response.incomplete", "response.failed"))
ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id[:80]}' not found.", param="response_id",
                    type="invalid_request_error", code="not_found")


def store_unavailable(e: Exception, retry_after_s: int) -> APIError:
    return APIError(503, f"stored responses cannot be read right now ({e}); retry shortly",
                    code="store_unavailable", headers={"retry-after": str(retry_after_s), "x-should-retry": "true"})


def input_items(value: Any) -> list[dict[str, Any]]:
    """A request's ``input`` as items: a string is one user message; an array holds messages (with or without
    ``type``), function calls and their outputs, and reasoning items. Anything else: a 400 naming it."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string or a non-empty array of input items", param="input")
    if len(value) > MAX_ITEMS:
        raise bad_request(f"'input' holds {len(value)} items; at most {MAX_ITEMS} are allowed", param="input")
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"'{where}' must be an object", param=where)
        kind = item.get("type", "message")
        if not isinstance(kind, str) or kind not in ITEM_TYPES:
            raise bad_request(f"'{where}.type' must be one of {list(ITEM_TYPES)} (fairgate does not resolve "
                              f"item references or run hosted tools)", param=f"{where}.type")
        if kind == "message":
            if not isinstance(item.get("role"), str) or item["role"] not in ROLES:
                raise bad_request(f"'{where}.role' must be one of {list(ROLES)}", param=f"{where}.role")
            content = item.get("content")
            if not (isinstance(content, str) or isinstance(content, list) and all(
                    isinstance(p, dict) and isinstance(p.get("type"), str) for p in content)):
                raise bad_request(f"'{where}.content' must be a string or an array of content parts",
                                  param=f"{where}.content")
        elif kind in ("function_call", "function_call_output") and not isinstance(item.get("call_id"), str):
            raise bad_request(f"'{where}.call_id' must be a string", param=f"{where}.call_id")
        for name, ok, what in (("output", _content_like, "a string or an array of content parts"),
                               ("name", lambda v: isinstance(v, str), "a string"),
                               ("arguments", lambda v: isinstance(v, str), "a string"),
                               ("summary", _parts_like, "an array of parts"),
                               ("content", _parts_like if kind == "reasoning" else _content_like,
                                "an array of parts")):
            if name in item and not ok(item[name]):
                raise bad_request(f"'{where}.{name}' must be {what}", param=f"{where}.{name}")
        if kind == "function_call_output" and "output" not in item:
            raise bad_request(f"'{where}.output' is required", param=f"{where}.output")
    return value


def _parts_like(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(p, dict) for p in v)


def _content_like(v: Any) -> bool:
    return isinstance(v, str) or _parts_like(v)


RESPONSE_ID = re.compile(r"resp_[0-9a-f]{48}")


def known_shape(response_id: Any) -> bool:
    """An id the gateway could have made (``resp_`` and 48 hex digits): no other is looked up."""
    return isinstance(response_id, str) and RESPONSE_ID.fullmatch(response_id) is not None


@dataclass(slots=True)
class Conversation:
    """One Responses request's place in its conversation: what the gateway answers and stores."""

    response_id: str  # the gateway's id for this response
    own_items: list[dict[str, Any]]  # this turn's input
    chain: list[Turn] = field(default_factory=list)  # the turns before it, oldest first
    previous_id: str | None = None  # as the client named it
    store: bool = True
    metadata: Any = None
    interaction: str = ""

    @property
    def previous(self) -> Turn | None:
        return self.chain[-1] if self.chain else None

    def expanded(self) -> list[dict[str, Any]]:
        """The whole conversation's input: every earlier turn's input and output, then this turn's."""
        items: list[dict[str, Any]] = []
        for turn in self.chain:
            items += turn.input_items
            items += turn.output_items
        return items + self.own_items

    def named(self, response: dict[str, Any]) -> dict[str, Any]:
        """The backend's response object as the client's: the gateway's id and the client's fields."""
        response["id"] = self.response_id
        response["previous_response_id"] = self.previous_id
        response["store"] = self.store
        response["metadata"] = self.metadata or {}
        return response


def item_ids(response_id: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored input items as listed (``GET …/input_items``): each with an id, its own or one derived from the
    response's id and its place (the same at every listing, so ``after`` pages stay put)."""
    out = []
    for i, item in enumerate(items):
        item = dict(item)
        if "id" not in item:
            digest = hashlib.sha256(f"{response_id}/{i}".encode()).hexdigest()[:32]
            item["id"] = f"{ID_PREFIX.get(item.get('type', 'message'), 'item')}_{digest}"
        item.setdefault("type", "message")
        if item["type"] == "message" and isinstance(item.get("content"), str):  # (as OpenAI lists it: parts)
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        out.append(item)
    return out


def events(data: bytes) -> list[tuple[bytes, dict[str, Any], bytes]]:
    """A read's SSE events as (the event's type, its JSON data, the data as it came); comments and blank lines
    skipped. A data line that is not a JSON object is a ValueError (an upstream failure)."""
    out = []
    for line in data.split(b"\n"):
        if line[:5] != b"data:":
            continue
        payload = line[5:].strip()
        ev = orjson.loads(payload)
        if not isinstance(ev, dict):
            raise ValueError(f"an event that is not a JSON object: {payload[:80]!r}")
        if b"\r" in payload:  # (JSON allows a raw CR as whitespace; an SSE client reads it as a line's end)
            payload = orjson.dumps(ev)
        kind = ev.get("type")  # (a backend's: what is not a short printable name is not written as one)
        ok = isinstance(kind, str) and len(kind) <= 100 and kind.isascii() and kind.isprintable()
        out.append((kind.encode() if ok else b"unknown", ev, payload))
    return out


def event_bytes(kind: bytes, ev: dict[str, Any] | None, payload: bytes = b"") -> bytes:
    """An SSE event: its data ``ev`` written anew, or ``payload`` as it came (a JSON text holds no newline)."""
    return b"event: " + kind + b"\ndata: " + (orjson.dumps(ev) if ev is not None else payload) + b"\n\n"


async def converse(parsed: ParsedRequest, caller: Caller, store: ResponseStore, config: GatewayConfig) -> Caller:
    """A Responses request's conversation: the turns it continues, read from the store (another tenant's, an
    unknown or an expired id: 404; a chain past its caps: 400; the store not answering: 503), and its
    interaction — the chain's first turn's, unless the client names one —, one its turns all share."""
    body, c = parsed.body, config
    conv = parsed.conversation = Conversation(new_response_id(), input_items(body["input"]),
                                              previous_id=body.get("previous_response_id"),
                                              store=body.get("store") is not False, metadata=body.get("metadata"))
    if conv.store and (have := store.over_cap(caller.app, c.response_max_app_bytes)) is not None:
        raise APIError(429, f"this app's stored responses take {have:,} bytes, its cap (response_max_app_bytes) "
                       f"is {c.response_max_app_bytes:,}: delete some (DELETE /v1/responses/{{id}}), let them pass "
                       "their retention, or send 'store': false", param="store", type="insufficient_quota",
                       code="stored_bytes_exceeded", headers={"x-should-retry": "false"})
    if conv.previous_id is not None:
        if not known_shape(conv.previous_id):  # (no id the gateway made: nothing to look up)
            raise not_found(conv.previous_id)
        try:
            chain = await store.chain(caller.app, caller.user, conv.previous_id, utcnow())
        except StoreUnavailable as e:
            raise store_unavailable(e, c.retry_after_s) from None
        except ChainTooLong:
            raise APIError(400, f"the conversation reached {c.response_max_turns} turns (response_max_turns): "
                           "start a new one", param="previous_response_id", code="conversation_too_long") from None
        if chain is None:
            raise not_found(conv.previous_id)
        if chain[-1].chain_bytes > c.response_max_chain_bytes:
            raise APIError(400, f"the conversation's items passed {c.response_max_chain_bytes} bytes "
                           "(response_max_chain_bytes): start a new one", param="previous_response_id",
                           code="conversation_too_long")
        conv.chain = chain
        if not caller.named_interaction:
            caller = dataclasses.replace(caller, interaction=chain[0].interaction, stage=min(len(chain), MAX_STAGE))
    caller = dataclasses.replace(caller, named_interaction=True)  # (every turn keys it alike)
    conv.interaction = caller.interaction
    return caller
