"""Data-parallel serving: N replica processes behind one front end (docs/serving.md, "Replicas").

Why this file is long: the proxy, the replica supervisor (restarts, health) and the rolling
reload share one replica table and its lock; split apart they would pass it back and forth.

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
  until its /health answers again, one that stays unhealthy is killed and restarted;
- rolls a new model version out without downtime (`POST /admin/reload`, SIGHUP): the new MODEL
  reference is resolved first (a registry alias fetched; a bad one is refused and nothing
  changes), then one replica at a time is drained (no new requests; its in-flight ones finish,
  within `drain_timeout_s`), restarted on the new model and waited for until its /health
  answers; a replica that does not come up is put back on its old model and the replicas
  already rolled are rolled back. /health and /metrics say which version each replica runs.
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

from posttrain.stages.serving.app import authorized, client_gone, unauthorized
from posttrain.stages.serving.protocol import APIError
from posttrain.stages.serving.routing import Router, estimate_cost

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
    model: str = ""  # what its process loads (a local path or preset)
    version: str = ""  # which version that is (a registry "name/v3 run ...", else the reference)
    reloads: int = 0  # restarts by a rollout
    held: bool = False  # a rollout is stopping / starting it: the watcher leaves it alone

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
        self.model = Gauge("posttrain_frontend_replica_model", "1 for the model version the replica runs",
                           ["replica", "version"], registry=r)
        self.replica_reloads = Counter("posttrain_frontend_replica_reloads", "replica restarts by a rollout",
                                       label, registry=r)
        self.reloads = Counter("posttrain_frontend_reloads", "reload requests by outcome: rolled, unchanged, "
                               "refused (the model did not resolve), failed (a replica did not come up)",
                               ["result"], registry=r)
        self.routed = Counter("posttrain_frontend_routed", "requests sent to the replica (retries included)", label,
                              registry=r)
        self.retried = Counter("posttrain_frontend_retried", "requests sent again after the replica's connection "
                               "failed", label, registry=r)
        self.refused = Counter("posttrain_frontend_refused", "429s from the replica (queue full)", label, registry=r)
        self.failed = Counter("posttrain_frontend_failed", "requests the front end could not complete: no replica, "
                              "retries used up, timeout, a stream broken", ["reason"], registry=r)
        self.restarts = Counter("posttrain_frontend_replica_restarts", "replica processes started again", label,
                                registry=r)
        self.cancelled = Counter("posttrain_frontend_cancelled", "JSON answers whose client went away first: "
                                 "the call to the replica is dropped, which aborts it there", label, registry=r)
        self.requests = Counter("posttrain_frontend_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        for rep in sup.replicas:  # every series exists from the start
            for c in (self.routed, self.retried, self.refused, self.restarts, self.replica_reloads, self.cancelled):
                c.labels(str(rep.index))
            self.model.labels(str(rep.index), rep.version).set(1)
        for result in ("rolled", "unchanged", "refused", "failed"):
            self.reloads.labels(result)


class RolloutError(RuntimeError):
    """A replica did not come up on the new model."""


class Supervisor:
    """Starts the replica processes, watches them, restarts the dead, tells the router who is live,
    rolls new model versions out.

    command(port, model): a replica's argv. resolve(ref) -> (model, version): what a MODEL
    reference names now (run in a thread: it may download); ValueError when it names nothing
    servable. `ref`, `model`, `version`: what the replicas start on."""

    def __init__(self, command: Callable[[int, str], list[str]], ports: list[int], router: Router,
                 env: dict[str, str] | None = None, health_interval: float = 1.0, unhealthy_kill_s: float = 30.0,
                 max_backoff_s: float = 30.0, ref: str = "", model: str = "", version: str = "",
                 resolve: Callable[[str], tuple[str, str]] | None = None, drain_timeout_s: float = 60.0,
                 ready_timeout_s: float = 180.0):
        self.command, self.router, self.env = command, router, env
        self.replicas = [Replica(i, p, model=model, version=version or model) for i, p in enumerate(ports)]
        self.health_interval, self.unhealthy_kill_s, self.max_backoff_s = health_interval, unhealthy_kill_s, max_backoff_s
        self.ref, self.resolve = ref or model, resolve or (lambda ref: (ref, ref))
        self.drain_timeout_s, self.ready_timeout_s = drain_timeout_s, ready_timeout_s
        self.rollout: dict = {"state": "idle"}
        self._rolling: asyncio.Task | None = None
        self._reloading = False
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
        rep.proc = subprocess.Popen(self.command(rep.port, rep.model), env=self.env, start_new_session=True,
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
        if rep.held:
            return
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

    # ------------------------------------------------------------ rolling updates

    async def reload(self, ref: str | None = None, force: bool = False) -> dict:
        """Resolve `ref` (default: the current reference again, e.g. an alias that has moved) and
        start rolling it out; the rollout's status. APIError when it cannot start: 409 while
        another reload runs, 400 when the reference does not resolve (nothing changes then).
        Unless `force`, a reference that resolves to what every replica runs rolls nothing."""
        if self._reloading:
            raise APIError(409, f"a reload is already under way: {self.rollout}", code="reload_in_progress")
        self._reloading = True
        try:
            ref = ref or self.ref
            try:
                model, version = await asyncio.to_thread(self.resolve, ref)
            except Exception as e:  # noqa: BLE001 - any failure to resolve leaves the replicas alone
                self.metrics.reloads.labels("refused").inc()
                log.warning("reload of %s refused: %s", ref, e)
                status = 400 if isinstance(e, ValueError) else 502
                raise APIError(status, f"cannot reload {ref!r}: {e}; the replicas keep serving "
                                       f"{self.versions()}", type="invalid_request_error" if status == 400
                               else "server_error", code="model_unavailable") from None
            if not force and all(r.model == model and r.version == version for r in self.replicas):
                self.metrics.reloads.labels("unchanged").inc()
                self.ref = ref
                return {"state": "unchanged", "ref": ref, "version": version}
            self.rollout = {"state": "rolling", "ref": ref, "version": version, "from": self.versions(),
                            "replica": None, "error": None, "started": time.time(), "finished": None}
            self._rolling = asyncio.create_task(self._roll(ref, model, version))
            return dict(self.rollout)
        finally:
            if self._rolling is None or self._rolling.done():
                self._reloading = False

    def versions(self) -> list[str]:
        return [r.version for r in self.replicas]

    async def _roll(self, ref: str, model: str, version: str) -> None:
        rolled: list[tuple[Replica, str, str]] = []
        try:
            for rep in self.replicas:
                self.rollout["replica"] = rep.index
                old = (rep.model, rep.version)
                await self._replace(rep, model, version)
                rolled.append((rep, *old))
            self.ref = ref
            self.rollout.update(state="done", replica=None, finished=time.time())
            self.metrics.reloads.labels("rolled").inc()
            log.info("rolled %s (%s) out to every replica", ref, version)
        except Exception as e:  # noqa: BLE001 - report it; the replicas go back to what they ran
            log.error("rollout of %s failed: %s; rolling %d replicas back", ref, e, len(rolled))
            self.rollout.update(state="failed", error=str(e))
            self.metrics.reloads.labels("failed").inc()
            for rep, old_model, old_version in reversed(rolled):
                with contextlib.suppress(Exception):
                    await self._replace(rep, old_model, old_version)
            self.rollout.update(replica=None, finished=time.time())
        finally:
            self._reloading = False

    async def _replace(self, rep: Replica, model: str, version: str) -> None:
        """Drain the replica, restart it on `model`, wait until it is ready (RolloutError when it is
        not: it is started on its old model again)."""
        others = [r for r in self.replicas if r is not rep]
        await self._wait(lambda: not others or any(r.state == "ready" for r in others), self.ready_timeout_s)
        old = (rep.model, rep.version)
        await self._restart(rep, model, version)
        proc, deadline = rep.proc, time.monotonic() + self.ready_timeout_s
        while rep.state != "ready":
            if proc.poll() is not None or time.monotonic() > deadline or self.stopping:
                why = f"exited with {proc.returncode}" if proc.poll() is not None else \
                    f"not ready after {self.ready_timeout_s:g} s"
                await self._restart(rep, *old)
                raise RolloutError(f"replica {rep.index} did not come up on {version} ({why}); it is back on "
                                   f"{old[1]}")
            await asyncio.sleep(0.1)
        log.info("replica %d (port %d) serves %s", rep.index, rep.port, version)

    async def _restart(self, rep: Replica, model: str, version: str) -> None:
        rep.held = True  # the watcher would mark it ready again, or restart it on its own
        try:
            self._set(rep, "draining")  # no new requests
            load = self.router.loads[rep.index]
            await self._wait(lambda: load.requests == 0, self.drain_timeout_s)
            if load.requests:
                log.warning("replica %d still has %d requests after %g s of draining; stopping it anyway",
                            rep.index, load.requests, self.drain_timeout_s)
            if rep.proc is not None:
                await asyncio.to_thread(_terminate, [rep.proc])
            with contextlib.suppress(KeyError):
                self.metrics.model.remove(str(rep.index), rep.version)
            rep.model, rep.version = model, version
            self.metrics.model.labels(str(rep.index), version).set(1)
            rep.reloads += 1
            self.metrics.replica_reloads.labels(str(rep.index)).inc()
            rep.quick_deaths = 0
            self.start(rep)
        finally:
            rep.held = False

    @staticmethod
    async def _wait(cond: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not cond() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def stop(self, timeout: float = 15.0) -> None:
        self.stopping = True
        _terminate([r.proc for r in self.replicas if r.proc is not None], timeout)

    def describe(self) -> list[dict]:
        return [{"replica": r.index, "port": r.port, "state": r.state, "pid": r.proc.pid if r.proc else None,
                 "restarts": r.restarts, "reloads": r.reloads, "model": r.model, "version": r.version,
                 "outstanding_tokens": self.router.loads[r.index].tokens,
                 "inflight": self.router.loads[r.index].requests} for r in self.replicas]


def _terminate(procs: list[subprocess.Popen], timeout: float = 15.0) -> None:
    """SIGTERM (a replica finishes what it has), SIGKILL after `timeout`."""
    procs = [p for p in procs if p.poll() is None]
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def sse_error(e: APIError) -> bytes:
    return f"data: {json.dumps(e.body())}\n\ndata: [DONE]\n\n".encode()


def build_frontend(sup: Supervisor, api_key: str | None = None, max_retries: int = 2,
                   request_timeout: float = 300.0, reload_on_sighup: bool = False) -> FastAPI:
    """reload_on_sighup: SIGHUP reloads the current reference (needs the main thread's loop)."""
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
        if reload_on_sighup:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, lambda: asyncio.create_task(on_sighup()))
        try:
            yield
        finally:
            sup.stopping = True
            watcher.cancel()
            await asyncio.to_thread(sup.stop)
            await client.aclose()

    async def on_sighup():
        log.info("SIGHUP: reloading %s", sup.ref)
        try:
            await sup.reload()
        except APIError as e:
            log.error("SIGHUP reload: %s", e.body()["error"]["message"])

    app = FastAPI(title="posttrain serve-model (replicas)", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        route = path if path in ("/health", "/metrics", "/v1/models", "/v1/completions",
                                 "/v1/chat/completions", "/admin/reload") else "other"
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
        return JSONResponse({"status": "ok" if ready else "unavailable", "model": sup.ref, "rollout": sup.rollout,
                             "replicas": sup.describe()}, status_code=200 if ready else 503)

    @app.post("/admin/reload")
    async def reload(request: Request):
        """Body (optional): {"model": "<MODEL reference>", "force": false}. 202 and the rollout's
        status once the reference resolved (the roll goes on in the background: GET this route or
        /health to follow it); 200 when nothing changed."""
        raw = await request.body()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("model", ""), str) \
                or not isinstance(body.get("force", False), bool):
            return _error(APIError(400, 'the body is optional; else {"model": "<MODEL reference>", "force": bool}',
                                   code="invalid_body"))
        try:
            status = await sup.reload(body.get("model") or None, force=body.get("force", False))
        except APIError as e:
            return _error(e)
        return JSONResponse(status, status_code=200 if status["state"] == "unchanged" else 202)

    @app.get("/admin/reload")
    async def reload_status():
        return {**sup.rollout, "versions": sup.versions()}

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
                resp = await sent_unless_gone(request, client.send(req, stream=stream), stream)
                if resp is None:  # the client went away waiting for a JSON answer: the replica's call was dropped
                    metrics.cancelled.labels(str(i)).inc()
                    return Response(status_code=499)  # nobody reads it
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

    async def sent_unless_gone(request: Request, sending, stream: bool) -> httpx.Response | None:
        """The replica's response; for a JSON answer (not a stream, which Starlette cancels itself on
        http.disconnect) None once the client has gone away first: the call is cancelled, which
        closes its connection, and the replica aborts the request (posttrain.stages.serving.app)."""
        if stream:
            return await sending
        task, gone = asyncio.ensure_future(sending), asyncio.ensure_future(client_gone(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this handler cancelled (shutdown): the call goes with it
            task.cancel()
            raise
        finally:
            gone.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await task
        return None

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


def serve_replicas(command: Callable[[int, str], list[str]], ports: list[int], router: Router, host: str = "127.0.0.1",
                   port: int = 8000, api_key: str | None = None, max_retries: int = 2, request_timeout: float = 300.0,
                   log_level: str = "info", ref: str = "", model: str = "", version: str = "",
                   resolve: Callable[[str], tuple[str, str]] | None = None, drain_timeout_s: float = 60.0) -> None:
    """Run the front end (and, through its lifespan, the replicas) until uvicorn is told to stop."""
    import uvicorn

    if not logging.getLogger().handlers:  # the replicas' state changes, retries, restarts
        logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health check
    env = dict(os.environ)
    env.pop("POSTTRAIN_API_KEY", None)
    if api_key is not None:
        env["POSTTRAIN_API_KEY"] = api_key
    sup = Supervisor(command, ports, router, env=env, ref=ref, model=model, version=version, resolve=resolve,
                     drain_timeout_s=drain_timeout_s)
    app = build_frontend(sup, api_key=api_key, max_retries=max_retries, request_timeout=request_timeout,
                         reload_on_sighup=True)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                  lifespan="on", timeout_graceful_shutdown=10)).run()
