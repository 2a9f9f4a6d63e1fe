"""vLLM's ``POST /tokenize`` and ``/detokenize`` through the gateway: keyed, bounded, and sent to a backend that
serves the model — cheap, so not queued behind generation — with the answer as that backend gave it (within
``max_event_bytes``). Each leaves its usage row (proxy/audit.py). A component of ``Gateway``."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import orjson

from fairgate.accounting.tokenizer import anthropic_messages, off_the_loop
from fairgate.http.messages import Request, Response, json_response
from fairgate.proxy.audit import audited
from fairgate.proxy.call import Call
from fairgate.proxy.errors import APIError, anthropic_response, bad_request, model_not_found
from fairgate.proxy.pipeline.caller import KeyIdentity
from fairgate.proxy.pipeline.forward import refuse_remote_media
from fairgate.proxy.pipeline.upstream import UPSTREAM_ERRORS, LineTooLong, error_body, read_whole
from fairgate.proxy.pipeline.validate import MAX_TOKEN_ID, body_of, parse

if TYPE_CHECKING:
    from fairgate.proxy.app import Gateway

TOKENIZE_FIELDS = frozenset(("model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                             "continue_final_message", "return_token_strs", "tools"))
DETOKENIZE_FIELDS = frozenset(("model", "tokens"))
MAX_TOKENS = 1 << 20  # token ids one detokenize may hold


class TokenRoutes:
    """``/tokenize``, ``/detokenize`` and Anthropic's ``/v1/messages/count_tokens``."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    async def tokenize(self, request: Request) -> Response:
        return await audited(self.gateway, request, "tokenize", self._tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await audited(self.gateway, request, "detokenize", self._detokenize)

    async def count_message_tokens(self, request: Request) -> Response:
        """Anthropic's ``POST /v1/messages/count_tokens``: the prompt's tokens as the gateway counts a message
        request before queueing it (``{"input_tokens": N}``); errors in Anthropic's shape."""
        try:
            return await audited(self.gateway, request, "messages.count_tokens", self._count_message_tokens)
        except APIError as e:
            return anthropic_response(e)

    async def _count_message_tokens(self, request: Request, key: KeyIdentity, call: Call) -> Response:
        c = self.gateway.config
        raw = await body_of(request, c.max_body_bytes, c.body_timeout_s)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise bad_request(f"the body is not valid JSON: {e}", code="invalid_json") from None
        if isinstance(body, dict):
            body.setdefault("max_tokens", 1)  # (not asked here: the count is of the prompt)
        try:
            parsed = parse(orjson.dumps(body) if isinstance(body, dict) else raw, "messages")
        except TypeError:  # (nesting past what JSON is written with: 254 levels)
            raise bad_request("the body is nested too deeply") from None
        if parsed.model not in self.gateway.pool.known_models():
            raise model_not_found(parsed.model)
        call.model = parsed.model
        messages = anthropic_messages(parsed.body.get("system"), parsed.body["messages"])
        tok = self.gateway.tokenizer(parsed.model)
        count = await off_the_loop(functools.partial(tok.count_chat, messages, None, parsed.body), len(raw))
        return json_response({"input_tokens": count.prompt_tokens})

    async def _body(self, request: Request, call: Call, fields: frozenset[str]) -> dict[str, Any]:
        c = self.gateway.config
        try:
            body = orjson.loads(await body_of(request, c.max_body_bytes, c.body_timeout_s))
        except orjson.JSONDecodeError as e:
            raise bad_request(f"the body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        for name in body:
            if name not in fields:
                raise APIError(400, f"'{name[:80]}' is not a parameter fairgate forwards to {request.path}",
                               param=name[:80], code="unsupported_parameter")
        model = body.get("model")
        if not isinstance(model, str) or model not in self.gateway.pool.known_models():
            raise model_not_found(model)
        call.model = model
        return body

    async def _tokenize(self, request: Request, key: KeyIdentity, call: Call) -> Response:
        body = await self._body(request, call, TOKENIZE_FIELDS)
        prompt, messages = body.get("prompt"), body.get("messages")
        if (prompt is None) == (messages is None):
            raise bad_request("send 'prompt' (a string) or 'messages' (an array of messages)", param="prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise bad_request("'prompt' must be a string", param="prompt")
        if messages is not None and not (isinstance(messages, list) and messages
                                         and all(isinstance(m, dict) for m in messages)):
            raise bad_request("'messages' must be a non-empty array of messages", param="messages")
        refuse_remote_media(body, self.gateway.tenants.allowed_fields(key.app))
        return await self._forward(call, "/tokenize", body)

    async def _detokenize(self, request: Request, key: KeyIdentity, call: Call) -> Response:
        body = await self._body(request, call, DETOKENIZE_FIELDS)
        tokens = body.get("tokens")
        if not (isinstance(tokens, list) and len(tokens) <= MAX_TOKENS and all(
                type(t) is int and 0 <= t < MAX_TOKEN_ID for t in tokens)):
            raise bad_request(f"'tokens' must be an array of at most {MAX_TOKENS} token ids", param="tokens")
        return await self._forward(call, "/detokenize", body)

    async def _forward(self, call: Call, path: str, body: dict[str, Any]) -> Response:
        """To the first backend up that serves the model, then the next if it fails."""
        g = self.gateway
        last = "no backend serves this model right now"
        try:
            sent = orjson.dumps(body)
        except TypeError:  # (nesting past what JSON is written with)
            raise bad_request("the body is nested too deeply") from None
        for backend in g.pool.candidates(call.model):
            try:
                resp = await g.relay.upstream.post(backend.url, path, sent)
            except UPSTREAM_ERRORS as e:
                last = f"backend {backend.name}: {e or type(e).__name__}"
                continue
            try:
                if 400 <= resp.status < 500 and resp.status != 404:
                    err = (await error_body(resp))["error"]
                    raise APIError(resp.status, str(err.get("message"))[:500], code="backend_rejected")
                if resp.status != 200:
                    last = f"backend {backend.name}: HTTP {resp.status}"
                    resp.close()
                    continue
                raw = await read_whole(resp, g.config.max_event_bytes)
                resp.release()
            except LineTooLong:  # (every backend would answer the same: not tried again)
                resp.close()
                raise APIError(502, f"the backend's answer to {path} passed max_event_bytes "
                               f"({g.config.max_event_bytes})", code="bad_gateway") from None
            except UPSTREAM_ERRORS as e:
                resp.close()
                last = f"backend {backend.name}: {e or type(e).__name__}"
                continue
            except BaseException:  # (the client left, or a refusal: the connection is not reused)
                resp.close()
                raise
            call.backend = backend.name
            return Response(body=raw, content_type="application/json")
        raise APIError(503, f"no backend could answer {path}: {last}"[:500], code="backend_unavailable",
                       headers={"retry-after": str(g.config.retry_after_s)})
