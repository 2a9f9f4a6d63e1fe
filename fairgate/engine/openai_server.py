"""The emulated vLLM OpenAI server: the same endpoints, SSE chunks, usage and /metrics names as vLLM.

Underneath is the engine model of ``engine/batching.py`` driven in real time (divided by ``speed``). Prompts are
tokenized with the gateway's tokenizer and chat prompts framed as ``accounting/tokenizer.py`` counts them,
so prompt token counts agree with the gateway's and the prefix cache sees real token ids. Generated text is
one word per token. ``ignore_eos`` generates exactly ``max_tokens``; otherwise the length is drawn from a
per-prompt deterministic distribution (mean ``mean_output`` tokens), capped by ``max_tokens``.
"""

from __future__ import annotations

import functools
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from fairgate.accounting.tokenizer import Tokenizer, anthropic_messages, response_messages
from fairgate.engine.answer_shapes import ChunkWriter, ResponseWriter, vector
from fairgate.engine.batching import Engine, EngineRequest, RequestTooLarge
from fairgate.engine.kv_publisher import KVEventPublisher
from fairgate.engine.vllm_metrics import engine_metrics_text
from fairgate.engine.profiles import EngineProfile
from fairgate.engine.runner import DONE, EngineRunner
from fairgate.engine.vllm_engine import ADMISSIONS, PreemptingEngine

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM and OpenAI default for /v1/completions


@dataclass(frozen=True, slots=True)
class SimConfig:
    model: str = "sim-llama"
    speed: float = 1.0
    mean_output: int = 128
    seed: int = 0
    kv_events: str | None = None  # publish KV events on this ZMQ endpoint (tcp://host:0: any free port)
    admission: str = "future"  # future: every running request's future reserved; vllm: vLLM's, it preempts


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def vllm_error(message: str, status: int, param: str | None = None) -> web.Response:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


class EmulatedVLLM:
    def __init__(self, profile: EngineProfile, config: SimConfig = SimConfig()):
        self.profile = profile
        self.config = config
        self.tokenizer = Tokenizer()
        if config.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}")
        engine = PreemptingEngine(profile) if config.admission == "vllm" else Engine(profile, admit_every=1)
        self.runner = EngineRunner(engine, speed=config.speed)
        self.created = int(time.time())
        self.kv_events: KVEventPublisher | None = None
        if config.kv_events:
            self.kv_events = KVEventPublisher(config.kv_events, profile.block_size)
            self.kv_events.attach(self.runner.engine.cache)

    # -- app --------------------------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1/messages", self.messages)
        for path in ("/v1/rerank", "/rerank"):
            app.router.add_post(path, self.rerank)
        for path in ("/v1/score", "/score"):
            app.router.add_post(path, self.score)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.on_startup.append(lambda _: self.runner.start())
        app.on_cleanup.append(lambda _: self.runner.stop())
        if self.kv_events is not None:
            app.on_cleanup.append(self._close_events)
        return app

    async def _close_events(self, _app: web.Application) -> None:
        self.kv_events.close()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0+fairgate-sim"})

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.config.model, "object": "model", "created": self.created, "owned_by": "vllm",
                "root": self.config.model, "parent": None, "max_model_len": self.profile.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def metrics(self, request: web.Request) -> web.Response:
        text = engine_metrics_text(self.runner.engine, self.config.model)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a chat (``messages``, under the chat framing) or a ``prompt``, as token ids."""
        try:
            body = orjson.loads(await request.read())
            if not isinstance(body, dict):
                raise BadRequest("request body must be a JSON object")
            ids = self._prompt_ids(body, "messages" in body)
        except orjson.JSONDecodeError as e:
            return vllm_error(f"invalid JSON: {e}", 400)
        except BadRequest as e:
            return vllm_error(str(e), e.status, e.param)
        return web.json_response({"count": len(ids), "max_model_len": self.profile.max_model_len, "tokens": ids},
                                 dumps=lambda o: orjson.dumps(o).decode())

    async def embeddings(self, request: web.Request) -> web.Response:
        """vLLM's /v1/embeddings for a pooling model: each input's prompt run through the engine (its prefill and
        one step) and answered with a unit vector drawn from its token ids (``dimensions``, else 64, floats or
        base64 float32)."""
        return await self._pool(request, self._embedding_prompts, self._embedded, "input")

    def _embedding_prompts(self, body: dict[str, Any]) -> list[list[int]]:
        dims = body.get("dimensions") or 64
        if not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= 8192:
            raise BadRequest("dimensions must be an integer from 1 to 8192", "dimensions")
        if (body.get("encoding_format") or "float") not in ("float", "base64"):
            raise BadRequest("encoding_format must be float or base64", "encoding_format")
        return self._inputs(body.get("input"))

    def _embedded(self, body: dict[str, Any], inputs: list[list[int]]) -> dict[str, Any]:
        dims, fmt = body.get("dimensions") or 64, body.get("encoding_format") or "float"
        tokens = sum(len(ids) for ids in inputs)
        return {"id": "embd-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()),
                "model": self.config.model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                                                      "completion_tokens": 0},
                "data": [{"index": i, "object": "embedding", "embedding": vector(ids, dims, fmt)}
                         for i, ids in enumerate(inputs)]}

    async def _pool(self, request: web.Request, prompts, answer, param: str) -> web.Response:
        """A pooling request: its body checked and its prompts made (``prompts``), each run through the engine
        as a prefill (and one step), then answered (``answer``); a prompt past the context is a 400 on ``param``."""
        def submit(body: dict[str, Any]):
            ids = prompts(body)
            reqs = [EngineRequest(id=uuid.uuid4().hex, prompt_len=len(one), output_len=1, prompt_ids=one,
                                  cache_salt=body.get("cache_salt")) for one in ids]
            return ids, reqs, [self.runner.submit(r) for r in reqs]

        begun = await self._begin(request, submit, param)
        if isinstance(begun, web.Response):
            return begun
        body, (ids, reqs, queues) = begun
        try:
            for queue in queues:
                while await queue.get() != DONE:
                    pass
        finally:
            for r in reqs:
                self.runner.cancel(r)
        return web.Response(body=orjson.dumps(answer(body, ids)), content_type="application/json")

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """vLLM's Anthropic Messages API: the turns rendered as a chat, an answer of words, whole or as
        Anthropic's events (``message_start`` … ``message_stop``)."""
        def submit(body: dict[str, Any]):
            turns = body.get("messages")
            if not isinstance(turns, list) or not all(isinstance(m, dict) for m in turns):
                raise BadRequest("messages must be a list of messages", "messages")
            return self._generate(body, self.tokenizer.chat_ids(anthropic_messages(body.get("system"), turns)))

        begun = await self._begin(request, submit, "max_tokens")
        if isinstance(begun, web.Response):
            return begun
        body, (req, queue) = begun
        words = ChunkWriter(req, self.config.model, True, {})
        mid, p = "msg_" + req.id, req.prompt_len

        def message(n: int, final: bool) -> dict[str, Any]:
            return {"id": mid, "type": "message", "role": "assistant", "model": self.config.model,
                    "content": [{"type": "text", "text": words.text(0, n)}] if final else [],
                    "stop_reason": ("max_tokens" if n >= body.get("max_tokens", 0) else "end_turn") if final else None,
                    "stop_sequence": None, "usage": {"input_tokens": p, "output_tokens": n,
                                                     "cache_read_input_tokens": req.cached_tokens}}

        def event(kind: str, **fields: Any) -> bytes:
            return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"

        try:
            if not body.get("stream"):
                sent = 0
                while (n := await queue.get()) != DONE:
                    sent = n
                return web.Response(body=orjson.dumps(message(sent, True)), content_type="application/json")
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            try:
                await resp.write(event("message_start", message=message(0, False)) + event(
                    "content_block_start", index=0, content_block={"type": "text", "text": ""}))
                sent = 0
                while (n := await queue.get()) != DONE:
                    await resp.write(event("content_block_delta", index=0,
                                           delta={"type": "text_delta", "text": words.text(sent, n)}))
                    sent = n
                final = message(sent, True)
                await resp.write(event("content_block_stop", index=0) + event(
                    "message_delta", delta={"stop_reason": final["stop_reason"], "stop_sequence": None},
                    usage={"output_tokens": sent}) + event("message_stop"))
                await resp.write_eof()
            except ConnectionError:
                pass
            return resp
        finally:
            self.runner.cancel(req)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """vLLM's /v1/responses without a store (``store`` is ignored: the gateway keeps state): the input
        items rendered as a chat, an answer of words — or, when ``tool_choice`` asks for a function (``required``
        or one named), a function call whose arguments are the words —, whole or as vLLM's SSE events."""
        def submit(body: dict[str, Any]):
            items = body.get("input")
            items = [{"role": "user", "content": items}] if isinstance(items, str) else items
            if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
                raise BadRequest("input must be a string or a list of items", "input")
            return self._generate({**body, "max_tokens": body.get("max_output_tokens")},
                                  self.tokenizer.chat_ids(response_messages(body.get("instructions"), items)))

        begun = await self._begin(request, submit, "max_output_tokens")
        if isinstance(begun, web.Response):
            return begun
        body, (req, queue) = begun
        answer = ResponseWriter(req, self.config.model, body)
        try:
            if body.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await resp.prepare(request)
                try:
                    await resp.write(answer.opening())
                    sent = 0
                    while (n := await queue.get()) != DONE:
                        await resp.write(answer.delta(sent, n))
                        sent = n
                    await resp.write(answer.closing(sent))
                    await resp.write_eof()
                except ConnectionError:
                    pass
                return resp
            sent = 0
            while (n := await queue.get()) != DONE:
                sent = n
            return web.Response(body=orjson.dumps(answer.response(sent)), content_type="application/json")
        finally:
            self.runner.cancel(req)

    async def rerank(self, request: web.Request) -> web.Response:
        """vLLM's rerank for a pooling model: each document scored against the query (its pair run through the
        engine as a prefill), the results by score, ``top_n`` of them (0: all)."""
        return await self._pool(request, functools.partial(self._pair_prompts, rerank=True), self._ranked,
                                "documents")

    async def score(self, request: web.Request) -> web.Response:
        return await self._pool(request, functools.partial(self._pair_prompts, rerank=False), self._scored,
                                "text_2")

    @staticmethod
    def _sides(body: dict[str, Any], rerank: bool) -> tuple[list[Any], list[Any]]:
        if rerank:
            firsts, seconds = body.get("query"), body.get("documents")
        else:
            firsts, seconds = ((body.get("text_1"), body.get("text_2")) if "text_1" in body
                               else (body.get("queries"), body.get("documents")))
        seconds = [seconds] if isinstance(seconds, str) else seconds
        firsts = [firsts] * len(seconds or ()) if isinstance(firsts, str) else firsts
        if not (isinstance(seconds, list) and isinstance(firsts, list) and seconds and len(firsts) == len(seconds)
                and all(isinstance(t, str) and t for t in firsts + seconds)):
            raise BadRequest("the texts to pair must be strings, one or as many on each side", "documents")
        return firsts, seconds

    def _pair_prompts(self, body: dict[str, Any], rerank: bool) -> list[list[int]]:
        return [self._inputs(a)[0] + self._inputs(b)[0] for a, b in zip(*self._sides(body, rerank))]

    @staticmethod
    def _pair_scores(pairs: list[list[int]]) -> list[float]:
        return [(vector(ids, 2, "float")[0] + 1) / 2 for ids in pairs]  # (in [0, 1], drawn from the pair)

    def _ranked(self, body: dict[str, Any], pairs: list[list[int]]) -> dict[str, Any]:
        tokens = sum(len(ids) for ids in pairs)
        results = sorted(({"index": i, "document": {"text": t}, "relevance_score": sc} for i, (t, sc) in
                          enumerate(zip(self._sides(body, True)[1], self._pair_scores(pairs)))),
                         key=lambda r: -r["relevance_score"])
        return {"id": "rerank-" + uuid.uuid4().hex, "model": self.config.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "results": results[:body.get("top_n") or len(results)]}

    def _scored(self, body: dict[str, Any], pairs: list[list[int]]) -> dict[str, Any]:
        tokens = sum(len(ids) for ids in pairs)
        return {"id": "score-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()),
                "model": self.config.model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                                                      "completion_tokens": 0},
                "data": [{"index": i, "object": "score", "score": sc}
                         for i, sc in enumerate(self._pair_scores(pairs))]}

    def _inputs(self, value: Any) -> list[list[int]]:
        """An embeddings ``input`` as token ids per input, each within the model's context."""
        def ids(one: Any) -> list[int] | None:
            if isinstance(one, str) and one:
                return self.tokenizer.encode(one)
            if isinstance(one, list) and one and all(isinstance(t, int) and not isinstance(t, bool) for t in one):
                return list(one)
            return None

        single = ids(value)
        many = [ids(v) for v in value] if single is None and isinstance(value, list) and value else [None]
        out = [single] if single is not None else many
        if any(x is None for x in out):
            raise BadRequest("input must be a non-empty string, a list of token ids, or a list of either", "input")
        for x in out:
            if len(x) > self.profile.max_model_len:
                raise BadRequest(f"This model's maximum context length is {self.profile.max_model_len} tokens. "
                                 f"However, you requested {len(x)} tokens in the input.", "input")
        return out

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: token ids back to text."""
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            return vllm_error(f"invalid JSON: {e}", 400)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < 100_256 for t in tokens):
            return vllm_error("tokens must be a list of token ids", 400, "tokens")
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    # -- request handling -------------------------------------------------------------------------------
    def _prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list", "messages")
            if not all(isinstance(m, dict) for m in messages):
                raise BadRequest("each message must be an object", "messages")
            return self.tokenizer.chat_ids(messages)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise BadRequest("prompt must be a string or a list of token ids (batched prompts are not emulated)",
                         "prompt")

    def _lengths(self, body: dict[str, Any], prompt_ids: list[int], chat: bool) -> int:
        max_len = self.profile.max_model_len
        max_tokens = body.get("max_completion_tokens") if chat else None
        max_tokens = max_tokens if max_tokens is not None else body.get("max_tokens")
        if max_tokens is None:
            max_tokens = max_len - len(prompt_ids) if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadRequest("max_tokens must be at least 1", "max_tokens")
        if len(prompt_ids) + max_tokens > max_len:
            raise BadRequest(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.", "max_tokens")
        if body.get("ignore_eos"):
            return max_tokens
        rng = random.Random(hash((self.config.seed, tuple(prompt_ids[-64:]), len(prompt_ids))))
        return max(1, min(max_tokens, int(rng.expovariate(1 / self.config.mean_output))))

    async def _begin(self, request: web.Request, submit, param: str):
        """The body read and checked (a JSON object naming the served model), then ``submit(body)``: (the body,
        what it returned), or the refusal vLLM would answer (a prompt past the context: a 400 on ``param``)."""
        try:
            body = orjson.loads(await request.read())
            if not isinstance(body, dict):
                raise BadRequest("request body must be a JSON object")
            if body.get("model") != self.config.model:
                raise BadRequest(f"The model `{body.get('model')}` does not exist.", "model", 404)
            return body, submit(body)
        except orjson.JSONDecodeError as e:
            return vllm_error(f"invalid JSON: {e}", 400)
        except BadRequest as e:
            return vllm_error(str(e), e.status, e.param)
        except RequestTooLarge as e:
            return vllm_error(str(e), 400, param)

    def _generate(self, body: dict[str, Any], prompt_ids: list[int], chat: bool = True):
        """A generation of the prompt, its length as ``_lengths`` draws it, submitted: (the request, its queue)."""
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise BadRequest("cache_salt must be a non-empty string", "cache_salt")  # as vLLM checks it
        req = EngineRequest(id=uuid.uuid4().hex, prompt_len=len(prompt_ids),
                            output_len=self._lengths(body, prompt_ids, chat), prompt_ids=prompt_ids, cache_salt=salt)
        return req, self.runner.submit(req)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        def submit(body: dict[str, Any]):
            if body.get("n", 1) != 1:
                raise BadRequest("the emulator serves n=1 only", "n")
            return self._generate(body, self._prompt_ids(body, chat), chat)

        begun = await self._begin(request, submit, "max_tokens")
        if isinstance(begun, web.Response):
            return begun
        body, (req, queue) = begun
        chunks = ChunkWriter(req, self.config.model, chat, body)
        try:
            if body.get("stream"):
                return await self._stream(request, queue, chunks)
            sent = 0
            while (n := await queue.get()) != DONE:
                sent = n
            return web.Response(body=orjson.dumps(chunks.full(sent)), content_type="application/json")
        finally:
            self.runner.cancel(req)  # no-op once finished; aborts the engine request on client disconnect

    async def _stream(self, request: web.Request, queue, chunks: ChunkWriter) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
            sent = 0
            while (n := await queue.get()) != DONE:
                await resp.write(chunks.delta(sent, n))
                sent = n
            await resp.write(chunks.final(sent))
            await resp.write_eof()
        except ConnectionError:  # the client went away; _serve's finally aborts the engine request
            pass
        return resp
