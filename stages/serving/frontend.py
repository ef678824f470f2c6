"""Data-parallel serving: N replica processes behind one front end (docs/serving.md, "Replicas").

Each replica is a whole single-replica server (`posttrain serve-model ... --port P` on 127.0.0.1)
in its own process. The front end is a FastAPI app that

- checks the API key (the same rule as a replica: `app.authorized`) and passes the client's
  `Authorization` header on; the replicas run with the same key (given in their environment, not
  their argv), so a replica port reached directly on the host is no open door;
- picks a replica per request (`routing.Router`), proxies the body and the answer (one JSON body,
  or the server-sent events as they come), every call under a timeout;
- retries a non-streaming request whose replica's connection failed on another replica (at most
  `max_retries` times); a broken stream ends with an SSE error event and `data: [DONE]`;
- passes a 429 on (with Retry-After) only when every live replica refused the request;
- supervises the replicas (`Supervisor`): a replica whose process exited is restarted on the same
  port (with a backoff while it keeps dying), one whose connection failed stops getting requests
  until its /health answers again, one that stays unhealthy is killed and restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from stages.serving.app import authorized, unauthorized
from stages.serving.protocol import APIError
from stages.serving.routing import Router, estimate_cost

log = logging.getLogger(__name__)

# a replica's connection broke (it died, or was never there): safe to send the request elsewhere
RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
             httpx.WriteError)


@dataclass
class Replica:
    index: int
    port: int
    proc: subprocess.Popen | None = None
    state: str = "starting"  # starting -> ready <-> suspect; dead while its process is gone
    restarts: int = 0
    started: float = 0.0
    since: float = 0.0  # when it entered its state
    quick_deaths: int = 0  # deaths in a row before it became ready (the restart backoff)
    next_start: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _die_with_parent() -> None:
    """In the child: SIGTERM when the front end dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Metrics:
    def __init__(self, sup: Supervisor):
        self.registry = r = CollectorRegistry()
        label = ["replica"]
        ready = Gauge("posttrain_frontend_replica_ready", "1 while the replica takes requests", label, registry=r)
        tokens = Gauge("posttrain_frontend_outstanding_tokens",
                       "estimated prompt + max_tokens*n of the requests in flight on the replica", label, registry=r)
        inflight = Gauge("posttrain_frontend_inflight_requests", "requests in flight on the replica", label,
                         registry=r)
        for rep in sup.replicas:
            i = str(rep.index)
            ready.labels(i).set_function(lambda rep=rep: float(rep.state == "ready"))
            tokens.labels(i).set_function(lambda rep=rep: sup.router.loads[rep.index].tokens)
            inflight.labels(i).set_function(lambda rep=rep: sup.router.loads[rep.index].requests)
        self.routed = Counter("posttrain_frontend_routed", "requests sent to the replica (retries included)", label,
                              registry=r)
        self.retried = Counter("posttrain_frontend_retried", "requests sent again after the replica's connection "
                               "failed", label, registry=r)
        self.refused = Counter("posttrain_frontend_refused", "429s from the replica (queue full)", label, registry=r)
        self.failed = Counter("posttrain_frontend_failed", "requests the front end could not complete: no replica, "
                              "retries used up, timeout, a stream broken", ["reason"], registry=r)
        self.restarts = Counter("posttrain_frontend_replica_restarts", "replica processes started again", label,
                                registry=r)
        self.requests = Counter("posttrain_frontend_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        for rep in sup.replicas:  # every series exists from the start
            for c in (self.routed, self.retried, self.refused, self.restarts):
                c.labels(str(rep.index))


class Supervisor:
    """Starts the replica processes, watches them, restarts the dead, tells the router who is live."""

    def __init__(self, command: Callable[[int], list[str]], ports: list[int], router: Router,
                 env: dict[str, str] | None = None, health_interval: float = 1.0, unhealthy_kill_s: float = 30.0,
                 max_backoff_s: float = 30.0):
        self.command, self.router, self.env = command, router, env
        self.replicas = [Replica(i, p) for i, p in enumerate(ports)]
        self.health_interval, self.unhealthy_kill_s, self.max_backoff_s = health_interval, unhealthy_kill_s, max_backoff_s
        self.metrics = Metrics(self)
        self.stopping = False
        self._last_check = [0.0] * len(ports)

    def _set(self, rep: Replica, state: str) -> None:
        if rep.state != state:
            log.info("replica %d (port %d, pid %s): %s -> %s", rep.index, rep.port,
                     rep.proc.pid if rep.proc else "-", rep.state, state)
            rep.state, rep.since = state, time.monotonic()
        self.router.set_live(rep.index, state == "ready")

    def start(self, rep: Replica) -> None:
        rep.proc = subprocess.Popen(self.command(rep.port), env=self.env, start_new_session=True,
                                    preexec_fn=_die_with_parent)
        rep.started = time.monotonic()
        self._set(rep, "starting")

    def start_all(self) -> None:
        for rep in self.replicas:
            self.start(rep)

    def suspect(self, index: int) -> None:
        """A connection to the replica failed: no requests until its /health answers (or it is restarted)."""
        rep = self.replicas[index]
        if rep.state == "ready":
            self._set(rep, "suspect")

    async def watch(self, client: httpx.AsyncClient) -> None:
        while not self.stopping:
            await asyncio.gather(*(self._check(rep, client) for rep in self.replicas))
            await asyncio.sleep(0.2)

    async def _check(self, rep: Replica, client: httpx.AsyncClient) -> None:
        now = time.monotonic()
        if rep.proc is not None and rep.proc.poll() is not None:  # the process is gone
            if rep.state != "dead":
                log.warning("replica %d (pid %d) exited with %s", rep.index, rep.proc.pid, rep.proc.returncode)
                rep.quick_deaths = rep.quick_deaths + 1 if rep.state == "starting" else 0
                rep.next_start = now + min(self.max_backoff_s, 0.5 * 2 ** rep.quick_deaths)
                self._set(rep, "dead")
            if now >= rep.next_start and not self.stopping:
                rep.restarts += 1
                self.metrics.restarts.labels(str(rep.index)).inc()
                self.start(rep)
            return
        if rep.state == "ready" and now - self._last_check[rep.index] < self.health_interval:
            return
        self._last_check[rep.index] = now
        try:
            ok = (await client.get(f"{rep.url}/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            rep.quick_deaths = 0
            self._set(rep, "ready")
        elif rep.state == "ready":
            self._set(rep, "suspect")
        elif rep.state == "suspect" and now - rep.since > self.unhealthy_kill_s:
            log.warning("replica %d has not answered /health for %.0f s: killing it", rep.index, now - rep.since)
            rep.proc.kill()

    def stop(self, timeout: float = 15.0) -> None:
        self.stopping = True
        procs = [r.proc for r in self.replicas if r.proc is not None and r.proc.poll() is None]
        for p in procs:
            p.terminate()
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def describe(self) -> list[dict]:
        return [{"replica": r.index, "port": r.port, "state": r.state, "pid": r.proc.pid if r.proc else None,
                 "restarts": r.restarts, "outstanding_tokens": self.router.loads[r.index].tokens,
                 "inflight": self.router.loads[r.index].requests} for r in self.replicas]


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def sse_error(e: APIError) -> bytes:
    return f"data: {json.dumps(e.body())}\n\ndata: [DONE]\n\n".encode()


def build_frontend(sup: Supervisor, api_key: str | None = None, max_retries: int = 2,
                   request_timeout: float = 300.0) -> FastAPI:
    router, metrics = sup.router, sup.metrics
    timeout = httpx.Timeout(request_timeout, connect=5.0)
    holder: dict[str, httpx.AsyncClient] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        holder["client"] = client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(
            max_connections=1000, max_keepalive_connections=100))
        if all(r.proc is None for r in sup.replicas):
            sup.start_all()
        watcher = asyncio.create_task(sup.watch(client))
        try:
            yield
        finally:
            sup.stopping = True
            watcher.cancel()
            await asyncio.to_thread(sup.stop)
            await client.aclose()

    app = FastAPI(title="posttrain serve-model (replicas)", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        route = path if path in ("/health", "/metrics", "/v1/models", "/v1/completions",
                                 "/v1/chat/completions") else "other"
        if not authorized(request, api_key):
            response = unauthorized()
        else:
            try:
                response = await call_next(request)
            except Exception as e:  # noqa: BLE001 - never let a request take the front end down
                log.exception("request to %s failed", path)
                response = _error(APIError(500, f"internal error: {type(e).__name__}", type="server_error"))
        metrics.requests.labels(route, str(response.status_code)).inc()
        return response

    @app.exception_handler(404)
    async def not_found(request: Request, e):
        return _error(APIError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def not_allowed(request: Request, e):
        return _error(APIError(405, f"method {request.method} not allowed on {request.url.path}"))

    @app.get("/health")
    async def health():
        ready = any(r.state == "ready" for r in sup.replicas)
        return JSONResponse({"status": "ok" if ready else "unavailable", "replicas": sup.describe()},
                            status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def forward_headers(request: Request) -> dict[str, str]:
        h = {"content-type": "application/json"}
        if "authorization" in request.headers:
            h["authorization"] = request.headers["authorization"]
        return h

    @app.get("/v1/models")
    async def models(request: Request):
        for rep in sup.replicas:
            if rep.state != "ready":
                continue
            try:
                r = await holder["client"].get(f"{rep.url}/v1/models", headers=forward_headers(request), timeout=10)
            except httpx.HTTPError:
                sup.suspect(rep.index)
                continue
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        return no_replica()

    def no_replica() -> JSONResponse:
        metrics.failed.labels("no_replica").inc()
        return _error(APIError(503, "no replica is ready; retry later", type="server_error", code="no_replica",
                               headers={"Retry-After": "1"}))

    async def proxy(request: Request, path: str):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        key, cost = estimate_cost(body) if isinstance(body, dict) else ("", 1)
        stream = isinstance(body, dict) and body.get("stream") is True
        headers, client = forward_headers(request), holder["client"]
        tried: set[int] = set()
        retries, refusals = 0, []
        while True:
            i = router.choose(key, exclude=tried)
            if i is None:
                break
            tried.add(i)
            rep = sup.replicas[i]
            router.start(i, cost)
            metrics.routed.labels(str(i)).inc()
            handed_off = False
            try:
                req = client.build_request("POST", rep.url + path, content=raw, headers=headers)
                resp = await client.send(req, stream=stream)
                if resp.status_code == 429:
                    metrics.refused.labels(str(i)).inc()
                    refusals.append(resp.headers.get("retry-after", "1"))
                    await resp.aclose()
                    continue
                if stream and resp.status_code == 200:
                    handed_off = True
                    return StreamingResponse(relay(resp, i, cost), media_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache"})
                content = await resp.aread()
                await resp.aclose()
                keep = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
                return Response(content, status_code=resp.status_code, headers=keep,
                                media_type=resp.headers.get("content-type", "application/json"))
            except RETRYABLE as e:
                sup.suspect(i)
                if retries >= max_retries:
                    metrics.failed.labels("retries_exhausted").inc()
                    return _error(APIError(502, f"replica {i} failed ({type(e).__name__}) and the "
                                                f"{max_retries} retries are used up", type="server_error",
                                           code="replica_failed"))
                retries += 1
                metrics.retried.labels(str(i)).inc()
                log.warning("replica %d failed a request (%s: %s); retrying elsewhere", i, type(e).__name__, e)
            except httpx.TimeoutException:
                metrics.failed.labels("timeout").inc()
                return _error(APIError(504, f"replica {i} did not answer within {request_timeout:g} s",
                                       type="server_error", code="timeout"))
            finally:
                if not handed_off:
                    router.finish(i, cost)
        if refusals:
            metrics.failed.labels("all_refused").inc()
            return _error(APIError(429, "every replica is at its request limit; retry later", type="rate_limit_error",
                                   code="queue_full", headers={"Retry-After": max(refusals, key=_seconds)}))
        return no_replica()

    async def relay(resp: httpx.Response, i: int, cost: int):
        """The replica's events, whole ones only; a broken stream ends with an error event."""
        buf, done = b"", False
        try:
            async for chunk in resp.aiter_bytes():
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    done = done or ev.strip() == b"data: [DONE]"
                    yield ev + b"\n\n"
            if not done:
                raise httpx.RemoteProtocolError("the stream ended before data: [DONE]")
        except httpx.HTTPError as e:
            if isinstance(e, RETRYABLE):
                sup.suspect(i)
            metrics.failed.labels("stream_broken").inc()
            log.warning("replica %d broke a stream (%s: %s)", i, type(e).__name__, e)
            yield sse_error(APIError(502, f"replica {i} failed mid-stream ({type(e).__name__}); the answer is "
                                          "incomplete", type="server_error", code="replica_failed"))
        finally:
            router.finish(i, cost)
            await resp.aclose()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await proxy(request, "/v1/chat/completions")

    return app


def _seconds(v: str) -> float:
    try:
        return float(v)
    except ValueError:
        return 1.0


def serve_replicas(command: Callable[[int], list[str]], ports: list[int], router: Router, host: str = "127.0.0.1",
                   port: int = 8000, api_key: str | None = None, max_retries: int = 2, request_timeout: float = 300.0,
                   log_level: str = "info") -> None:
    """Run the front end (and, through its lifespan, the replicas) until uvicorn is told to stop."""
    import uvicorn

    if not logging.getLogger().handlers:  # the replicas' state changes, retries, restarts
        logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health check
    env = dict(os.environ)
    env.pop("POSTTRAIN_API_KEY", None)
    if api_key is not None:
        env["POSTTRAIN_API_KEY"] = api_key
    sup = Supervisor(command, ports, router, env=env)
    app = build_frontend(sup, api_key=api_key, max_retries=max_retries, request_timeout=request_timeout)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                  lifespan="on", timeout_graceful_shutdown=10)).run()
