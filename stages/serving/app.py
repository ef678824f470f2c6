"""The ASGI app: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus /health and
/metrics, over one EngineWorker.

Each request is checked (posttrain.stages.serving.protocol), counted against `max_queue` (429 beyond it),
submitted to the worker, and answered from the events the engine thread posts back onto the
event loop (`loop.call_soon_threadsafe` into an asyncio.Queue per request): one JSON body, or
server-sent events (`data: {...}` chunks, then `data: [DONE]`). A client that goes away before
its answer (the stream cancelled by Starlette on `http.disconnect`, or, waiting for one JSON
body, an `http.disconnect` from `request.receive()`) has its request aborted in the engine (`Pending.cancel`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from posttrain.core.generation import RequestOutput
from posttrain.stages.serving.protocol import APIError, Limits, Parsed, parse_chat, parse_completion, parse_json
from posttrain.stages.serving.text import TextStream, final_text
from posttrain.stages.serving.worker import EngineWorker, Sink

log = logging.getLogger(__name__)


class Metrics:
    def __init__(self, worker: EngineWorker, state: ServerState):
        self.registry = r = CollectorRegistry()
        Gauge("posttrain_serve_queue_length", "requests waiting for the engine (not yet running)",
              registry=r).set_function(lambda: worker.stats()["waiting"])
        Gauge("posttrain_serve_running_requests", "sequences the engine is running",
              registry=r).set_function(lambda: worker.stats()["running"])
        Gauge("posttrain_serve_inflight_requests", "admitted requests not finished (what max_queue bounds)",
              registry=r).set_function(lambda: state.inflight)
        self.tokens = Counter("posttrain_serve_generated_tokens", "tokens generated", registry=r)
        self.prompt_tokens = Counter("posttrain_serve_prompt_tokens", "prompt tokens admitted", registry=r)
        self.requests = Counter("posttrain_serve_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.ttft = Histogram("posttrain_serve_time_to_first_token_seconds", "admission to first token",
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30), registry=r)
        self.engine_failures = Gauge("posttrain_serve_engine_failures", "engine steps that raised",
                                     registry=r)
        self.engine_failures.set_function(lambda: worker.num_failures)
        Gauge("posttrain_serve_cancelled_requests", "requests aborted in the engine because the client went away",
              registry=r).set_function(lambda: worker.num_cancelled)
        Gauge("posttrain_serve_kv_blocks_free", "KV cache blocks free (or cached and evictable)",
              registry=r).set_function(lambda: worker.engine.blocks.num_free)
        Gauge("posttrain_serve_kv_blocks", "KV cache blocks in the pool",
              registry=r).set_function(lambda: worker.engine.blocks.num_blocks)


@dataclass
class ServerState:
    model_id: str
    adapters: list[str]
    tokenizer: Any
    worker: EngineWorker
    limits: Limits
    api_key: str | None = None
    max_queue: int = 64
    stop_token_ids: tuple[int, ...] = ()
    inflight: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: Metrics | None = None

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class Pending:
    """One request in the engine, seen from the event loop."""

    def __init__(self, state: ServerState, parsed: Parsed):
        self.state, self.parsed = state, parsed
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.start, self.first = time.perf_counter(), True
        self.ended = False
        state.inflight += 1
        state.metrics.prompt_tokens.inc(len(parsed.prompt))
        post = self.loop.call_soon_threadsafe
        self.sink = Sink(tokens=lambda ev: post(self._on, "tokens", ev), done=lambda out: post(self._on, "done", out),
                         error=lambda e: post(self._on, "error", e))
        state.worker.submit(parsed.prompt, parsed.params, self.sink)

    def cancel(self) -> None:
        """The client went away: abort the request in the engine (nothing once it has ended)."""
        if not self.ended:
            self.ended = True
            self.state.inflight -= 1
            self.state.worker.cancel(self.sink)

    def _on(self, kind: str, payload) -> None:
        if kind == "tokens":
            if self.first:
                self.state.metrics.ttft.observe(time.perf_counter() - self.start)
                self.first = False
            self.state.metrics.tokens.inc(len(payload))
        elif not self.ended:
            self.ended = True
            self.state.inflight -= 1
        self.events.put_nowait((kind, payload))

    async def result(self, request: Request) -> RequestOutput | None:
        """The request's output; None (and the request aborted) once the client has disconnected."""
        waiter, listener = asyncio.ensure_future(self._result()), asyncio.ensure_future(client_gone(request))
        try:
            await asyncio.wait({waiter, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this task is cancelled
            listener.cancel()
            if not waiter.done():
                waiter.cancel()
                self.cancel()
        return waiter.result() if waiter.done() and not waiter.cancelled() else None

    async def _result(self) -> RequestOutput:
        while True:
            kind, payload = await self.events.get()
            if kind == "done":
                return payload
            if kind == "error":
                raise _engine_error(payload)


async def client_gone(request: Request) -> None:
    """Returns when the client has gone away (the body is read: nothing else can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _engine_error(e: BaseException) -> APIError:
    if isinstance(e, ValueError):  # the engine refused the request (a check protocol.py does not make)
        return APIError(400, str(e))
    return APIError(500, f"the engine failed while running this request: {type(e).__name__}: {e}",
                    type="server_error", code="engine_error")


def _usage(out: RequestOutput) -> dict:
    done = sum(len(c.tokens) for c in out.completions)
    return {"prompt_tokens": len(out.prompt), "completion_tokens": done, "total_tokens": len(out.prompt) + done}


def _token_str(state: ServerState, t: int) -> str:
    return state.tokenizer.decode([t], skip_special_tokens=False)


def _completion_logprobs(state: ServerState, tokens: list[int], logps: list[float], tops: list[dict]) -> dict:
    strs = [_token_str(state, t) for t in tokens]
    offsets, pos = [], 0
    for s in strs:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": strs, "token_logprobs": list(logps), "text_offset": offsets,
            "top_logprobs": [{_token_str(state, t): lp for t, lp in d.items()} for d in tops] if tops else None}


def _chat_logprobs(state: ServerState, tokens: list[int], logps: list[float], tops: list[dict]) -> dict:
    def entry(t: int, lp: float) -> dict:
        s = _token_str(state, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in (tops[i] if tops else {}).items()]}
                        for i, (t, lp) in enumerate(zip(tokens, logps))]}


def authorized(request: Request, api_key: str | None) -> bool:
    """Every route but /health needs `Authorization: Bearer KEY` when a key is set (constant-time
    compare). The replicas' front end (posttrain.stages.serving.frontend) applies the same rule."""
    if request.url.path == "/health" or api_key is None:
        return True
    auth = request.headers.get("authorization", "")
    given = auth[7:] if auth[:7].lower() == "bearer " else ""
    return hmac.compare_digest(given.encode(), api_key.encode())


def unauthorized() -> JSONResponse:
    return _error(APIError(401, "a valid API key is required (Authorization: Bearer KEY)",
                           type="authentication_error", code="invalid_api_key"))


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="posttrain serve-model", docs_url=None, redoc_url=None, openapi_url=None)
    state.metrics = state.metrics or Metrics(state.worker, state)
    metrics = state.metrics

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        route = path if path in ("/health", "/metrics", "/v1/models", "/v1/completions",
                                 "/v1/chat/completions") else "other"
        if not authorized(request, state.api_key):
            metrics.requests.labels(route, "401").inc()
            return unauthorized()
        try:
            response = await call_next(request)
        except Exception as e:  # noqa: BLE001 - never let a request take the server down
            log.exception("request to %s failed", path)
            response = _error(APIError(500, f"internal error: {type(e).__name__}", type="server_error"))
        metrics.requests.labels(route, str(response.status_code)).inc()
        return response

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return _error(e)

    @app.exception_handler(404)
    async def not_found(request: Request, e):
        return _error(APIError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def not_allowed(request: Request, e):
        return _error(APIError(405, f"method {request.method} not allowed on {request.url.path}"))

    @app.get("/health")
    async def health():
        if not state.worker.alive:
            return _error(APIError(503, "the engine thread is not running", type="server_error"))
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        data = [{"id": m, "object": "model", "created": state.created, "owned_by": "posttrain",
                 **({"parent": state.model_id} if m != state.model_id else {})}
                for m in (state.model_id, *state.adapters)]
        return {"object": "list", "data": data}

    def admit(parsed: Parsed) -> None:
        if parsed.model != state.model_id and parsed.model not in state.adapters:
            raise APIError(404, f"the model {parsed.model!r} does not exist; served: "
                                f"{', '.join([state.model_id, *state.adapters])}",
                           param="model", code="model_not_found")
        parsed.params.adapter = None if parsed.model == state.model_id else parsed.model
        parsed.params.stop_token_ids = tuple(state.stop_token_ids)
        if state.inflight >= state.max_queue:
            raise APIError(429, f"the server is at its limit of {state.max_queue} requests in flight; retry later",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        parsed = parse_completion(parse_json(await request.body()), state.limits,
                                  lambda text: state.tokenizer.encode(text, add_special_tokens=False))
        admit(parsed)
        return await answer(request, parsed, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        render = lambda messages: state.tokenizer.apply_chat_template(messages, add_generation_prompt=True)  # noqa: E731
        parsed = parse_chat(parse_json(await request.body()), state.limits, render)
        admit(parsed)
        return await answer(request, parsed, chat=True)

    async def answer(request: Request, parsed: Parsed, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        pending = Pending(state, parsed)
        if parsed.stream:
            return StreamingResponse(stream(pending, rid, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        out = await pending.result(request)
        if out is None:  # nobody to answer
            return Response(status_code=499)
        choices = []
        for c in out.completions:
            text, reason = final_text(c.tokens, state.decode, parsed.stops, c.finish_reason)
            choice: dict[str, Any] = {"index": c.index, "finish_reason": reason, "logprobs": None}
            if parsed.logprobs is not None:
                fmt = _chat_logprobs if chat else _completion_logprobs
                choice["logprobs"] = fmt(state, c.tokens, c.logprobs, c.top_logprobs)
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": parsed.model, "choices": choices, "usage": _usage(out)}

    async def stream(pending: Pending, rid: str, chat: bool) -> AsyncIterator[str]:
        parsed = pending.parsed
        n = parsed.params.n
        texts = [TextStream(state.decode, parsed.stops) for _ in range(n)]
        created, kind = int(time.time()), "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body = {"id": rid, "object": kind, "created": created, "model": parsed.model, "choices": choices}
            if usage is not None or parsed.include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        def choice(i: int, text: str | None, reason: str | None, lp: dict | None = None, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
            return {"index": i, "text": text or "", "logprobs": lp, "finish_reason": reason}

        try:
            if chat:
                yield chunk([choice(i, None, None, role=True) for i in range(n)])
            while True:
                kind_, payload = await pending.events.get()
                if kind_ == "error":
                    err = _engine_error(payload)
                    yield f"data: {json.dumps(err.body())}\n\n"
                    break
                if kind_ == "tokens":
                    out = []
                    for index, token, logp, tops in payload:
                        text = texts[index].push(token)
                        lp = None
                        if parsed.logprobs is not None:
                            fmt = _chat_logprobs if chat else _completion_logprobs
                            lp = fmt(state, [token], [logp], [tops] if parsed.logprobs else [])
                        if text or lp is not None:
                            out.append(choice(index, text, None, lp))
                    if out:
                        yield chunk(out)
                    continue
                result: RequestOutput = payload
                ends = []
                for c in result.completions:
                    text, reason = final_text(c.tokens, state.decode, parsed.stops, c.finish_reason)
                    ends.append(choice(c.index, texts[c.index].finish(text) or (None if chat else ""), reason))
                yield chunk(ends)
                if parsed.include_usage:
                    yield chunk([], _usage(result))
                break
        finally:  # the client went away (Starlette cancels the stream) or it ended: a no-op then
            pending.cancel()
        yield "data: [DONE]\n\n"

    return app


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
