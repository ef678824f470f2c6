"""`posttrain serve-model --replicas N`: the routing policy (pure, fast), the front end's fault
handling against stand-in replica processes (tests/support/fake_replica.py: queue full, dying mid-request,
hanging), and two real model replicas behind the front end started by the CLI, talked to with the
official `openai` client; their greedy answers are compared with the engine run in-process on the
same checkpoint, and one replica is SIGKILLed under load. Plus the infra manifests' probes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from posttrain.stages.serving.frontend import Supervisor, build_frontend
from posttrain.stages.serving.routing import Router, estimate_cost

ROOT = Path(__file__).resolve().parents[2]
KEY = "replica-key-1"


# ------------------------------------------------------------------ the routing policy


def test_least_loaded_picks_the_live_replica_with_the_fewest_outstanding_tokens():
    r = Router(3)
    assert r.choose("x") is None  # nothing live yet
    for i in range(3):
        r.set_live(i, True)
    assert r.choose() == 0  # a tie: the lowest index
    r.start(0, 100)
    r.start(1, 30)
    assert r.choose() == 2
    r.start(2, 30)
    r.start(2, 1)
    assert r.choose() == 1  # 30 < 31
    r.finish(0, 100)
    assert r.choose() == 0 and r.loads[0].tokens == 0 and r.loads[0].requests == 0
    assert r.choose(exclude={0}) == 1
    r.set_live(1, False)
    assert r.choose(exclude={0}) == 2
    assert r.choose(exclude={0, 2}) is None
    r.start(1, 0)  # equal tokens: fewer requests in flight wins
    r.set_live(1, True)
    r.finish(2, 1)
    assert r.loads[1].tokens == r.loads[2].tokens == 30 and r.choose(exclude={0}) == 2


def test_prefix_routing_is_sticky_spread_and_falls_back():
    r = Router(4, "prefix", prefix_chars=8, slack=50)
    for i in range(4):
        r.set_live(i, True)
    homes = {r.home(f"prompt {k}") for k in range(200)}
    assert homes == {0, 1, 2, 3}  # the hash spreads prefixes over every replica
    key = "SYSTEM: you are helpful. user: hi"
    home = r.choose(key)
    assert home == r.home(key) == r.choose(key[:8] + " anything after the prefix")
    assert Router(4, "prefix", prefix_chars=8).home(key) == home  # stable across instances (processes)
    r.start(home, 40)  # a little busier than the others: still home (within slack)
    assert r.choose(key) == home
    r.start(home, 100)  # 140 > 2 * 0 + 50: too loaded, the least-loaded one instead
    other = r.choose(key)
    assert other != home
    for i in range(4):
        if i != home:
            r.start(i, 60)
    assert r.choose(key) == home  # 140 <= 2 * 60 + 50
    r.set_live(home, False)
    assert r.choose(key) != home
    r.set_live(home, True)
    assert r.choose(key, exclude={home}) != home
    assert Router(4, "least-loaded").choose(key) is None  # nobody live


def test_router_refuses_bad_settings():
    with pytest.raises(ValueError, match="at least one replica"):
        Router(0)
    with pytest.raises(ValueError, match="routing policy"):
        Router(2, "random")
    with pytest.raises(ValueError, match="prefix_chars"):
        Router(2, "prefix", prefix_chars=0)


def test_cost_estimates():
    assert estimate_cost({"prompt": [1, 2, 3], "max_tokens": 10, "n": 2}) == ("1 2 3", 3 + 20)
    assert estimate_cost({"prompt": "abcdefgh", "max_tokens": 5}) == ("abcdefgh", 3 + 5)
    key, cost = estimate_cost({"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}],
                               "max_completion_tokens": 7})
    assert key == "sys\nhi" and cost == 1 + 1 + 7
    assert estimate_cost({"prompt": "x", "max_tokens": "lots", "n": -1}) == ("x", 1 + 16)  # refused later


# ------------------------------------------------------------------ the CLI refuses bad numbers up front


@pytest.mark.parametrize("argv,msg", [
    (["--replicas", "0"], "--replicas must be at least 1"),
    (["--replicas", "2", "--max-queue", "0"], "--max-queue must be at least 1"),
    (["--replicas", "2", "--port", "70000"], "not a TCP port"),
    (["--replicas", "2", "--request-timeout", "0"], "--request-timeout must be positive"),
    (["--replicas", "2", "--adapters", "a=/no/such/adapter"], "no such directory"),
])
def test_bad_serve_model_flags_fail_before_anything_starts(argv, msg, capsys):
    from posttrain.flows.cli import main

    t0 = time.time()
    assert main(["serve-model", "debug", *argv]) == 2
    assert msg in capsys.readouterr().err and time.time() - t0 < 10


def test_an_unknown_routing_policy_is_an_argparse_error(capsys):
    from posttrain.flows.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve-model", "debug", "--routing", "random"])
    assert "invalid choice" in capsys.readouterr().err


# ------------------------------------------------------------------ the front end against stand-in replicas


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_for(cond, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Frontend:
    """The front end in this process (uvicorn on a thread), its replicas `fake_replica.py MODE`."""

    def __init__(self, modes, api_key=None, **kw):
        ports = free_ports(len(modes))
        mode_of = dict(zip(ports, modes))
        self.sup = Supervisor(lambda port, model: [sys.executable, str(ROOT / "tests" / "support" / "fake_replica.py"), str(port),
                                            mode_of[port]], ports, Router(len(modes)), health_interval=0.2)
        self.app = build_frontend(self.sup, api_key=api_key, **kw)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.uvicorn = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.wait_all_ready()

    def _run(self):
        import uvicorn

        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on"))
        self.uvicorn.run(sockets=[self.sock])

    def wait_all_ready(self, timeout=20):
        wait_for(lambda: all(r.state == "ready" for r in self.sup.replicas), timeout, "every replica ready")

    def post(self, body, **kw):
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=30, **kw)

    def metric(self, name, labels=""):
        return metric(httpx.get(f"{self.url}/metrics", headers=self.auth, timeout=10).text, name, labels)

    auth: dict = {}

    def close(self):
        self.uvicorn.should_exit = True
        self.thread.join(30)
        assert all(r.proc.poll() is not None for r in self.sup.replicas)  # the replicas stop with it


def metric(text, name, labels=""):
    for line in text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name + labels)


def sse_events(response):
    return [line[6:] for line in response.text.split("\n\n") if line.startswith("data: ")]


BODY = {"model": "fake", "prompt": "hello", "max_tokens": 4}


@pytest.mark.slow
def test_a_request_on_a_dead_replica_is_retried_and_the_replica_restarts():
    fe = Frontend(["die", "ok"])
    try:
        r = fe.post(BODY)  # idle: replica 0 gets it, dies mid-request; replica 1 answers
        assert r.status_code == 200, r.text
        assert r.json()["port"] == fe.sup.replicas[1].port
        assert fe.metric("posttrain_frontend_retried_total", '{replica="0"}') == 1
        assert fe.metric("posttrain_frontend_routed_total", '{replica="1"}') == 1
        wait_for(lambda: fe.sup.replicas[0].restarts == 1 and fe.sup.replicas[0].state == "ready", 20,
                 "replica 0 restarted on its port")
        assert fe.metric("posttrain_frontend_replica_restarts_total", '{replica="0"}') == 1
        health = httpx.get(f"{fe.url}/health", timeout=5).json()
        assert [x["state"] for x in health["replicas"]] == ["ready", "ready"] and health["status"] == "ok"

        # a stream whose replica dies after its first event: that event, an error event, [DONE]
        r = fe.post({**BODY, "stream": True})
        events = sse_events(r)
        assert r.status_code == 200 and len(events) == 3, r.text
        assert json.loads(events[0])["choices"][0]["text"] == "hi"
        err = json.loads(events[1])["error"]
        assert err["code"] == "replica_failed" and err["type"] == "server_error" and events[2] == "[DONE]"
        assert fe.metric("posttrain_frontend_failed_total", '{reason="stream_broken"}') == 1
        assert fe.metric("posttrain_frontend_inflight_requests", '{replica="0"}') == 0  # its load given back
    finally:
        fe.close()


@pytest.mark.slow
def test_retries_are_bounded():
    fe = Frontend(["die", "die", "die"], max_retries=1)
    try:
        r = fe.post(BODY)
        assert r.status_code == 502 and r.json()["error"]["code"] == "replica_failed"
        assert fe.metric("posttrain_frontend_failed_total", '{reason="retries_exhausted"}') == 1
        assert sum(fe.metric("posttrain_frontend_routed_total", f'{{replica="{i}"}}') for i in range(3)) == 2
    finally:
        fe.close()


@pytest.mark.slow
def test_429_only_when_every_live_replica_refuses():
    fe = Frontend(["full", "full"])
    try:
        r = fe.post(BODY)
        assert r.status_code == 429 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert [fe.metric("posttrain_frontend_refused_total", f'{{replica="{i}"}}') for i in (0, 1)] == [1, 1]
    finally:
        fe.close()
    fe = Frontend(["full", "ok"])
    try:
        assert fe.post(BODY).status_code == 200  # one refusal, then the replica with room
    finally:
        fe.close()


@pytest.mark.slow
def test_a_replica_that_never_answers_times_out():
    fe = Frontend(["hang"], request_timeout=1.0)
    try:
        t0 = time.time()
        r = fe.post(BODY)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout" and time.time() - t0 < 10
        r = fe.post({**BODY, "stream": True})  # no headers either: a 504 too, not a hang
        assert r.status_code == 504
    finally:
        fe.close()


@pytest.mark.slow
def test_a_client_that_gives_up_on_a_json_answer_is_dropped_at_its_replica():
    """A non-streaming caller that goes away: the front end cancels its call to the replica, whose
    connection closes (a real replica then aborts the request in its engine: tests/stages/test_serving_rollout.py)."""
    fe = Frontend(["watch"])
    try:
        replica = fe.sup.replicas[0].url
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{fe.url}/v1/completions", json=BODY, timeout=0.5)
        wait_for(lambda: httpx.get(f"{replica}/stats", timeout=5).json()["dropped"] == 1, 10,
                 "the replica to see its connection closed")
        assert fe.metric("posttrain_frontend_cancelled_total", '{replica="0"}') == 1
        wait_for(lambda: fe.metric("posttrain_frontend_inflight_requests", '{replica="0"}') == 0, 5,
                 "the request to leave the router's count")
    finally:
        fe.close()


@pytest.mark.slow
def test_the_front_end_checks_the_key_and_health_shows_each_replica():
    fe = Frontend(["ok", "ok"], api_key=KEY)
    fe.auth = {"Authorization": f"Bearer {KEY}"}
    try:
        health = httpx.get(f"{fe.url}/health", timeout=5)
        assert health.status_code == 200
        assert [(x["replica"], x["state"]) for x in health.json()["replicas"]] == [(0, "ready"), (1, "ready")]
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(fe.url + path, timeout=5).status_code == 401
            assert httpx.get(fe.url + path, headers={"Authorization": "Bearer wrong"}, timeout=5).status_code == 401
        assert fe.post(BODY).json()["error"]["code"] == "invalid_api_key"
        assert fe.post(BODY, headers=fe.auth).status_code == 200
        assert httpx.get(f"{fe.url}/v1/models", headers=fe.auth, timeout=5).json()["data"][0]["id"] == "fake"
        for rep in fe.sup.replicas:  # no replica: 503 health, requests refused at once
            rep.proc.send_signal(signal.SIGSTOP)
        wait_for(lambda: all(r.state != "ready" for r in fe.sup.replicas), 10, "replicas unready")
        assert httpx.get(f"{fe.url}/health", timeout=5).status_code == 503
        r = fe.post(BODY, headers=fe.auth)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica"
        for rep in fe.sup.replicas:
            rep.proc.send_signal(signal.SIGCONT)
        fe.wait_all_ready()
    finally:
        fe.close()


# ------------------------------------------------------------------ infra manifests


def _port_of(command: list[str]) -> int:
    return int(command[command.index("--port") + 1])


def test_infra_manifests_probe_health_on_the_served_port():
    compose = yaml.safe_load((ROOT / "infra" / "serve-compose.yaml").read_text())
    svc = compose["services"]["serve"]
    port = _port_of(svc["command"])
    assert "--replicas" in svc["command"] and svc["command"][svc["command"].index("--host") + 1] == "0.0.0.0"
    test = " ".join(svc["healthcheck"]["test"])
    assert f"http://127.0.0.1:{port}/health" in test
    assert any(p.endswith(f":{port}") for p in svc["ports"])
    assert "POSTTRAIN_API_KEY" in svc["environment"]

    docs = [d for d in yaml.safe_load_all((ROOT / "infra" / "kubernetes" / "serving.yaml").read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Deployment", "Service"}
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    port = _port_of(c["args"])
    assert c["ports"][0]["containerPort"] == port
    for probe in ("readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health" and get["port"] in (port, c["ports"][0]["name"]), probe
    env = {e["name"]: e for e in c["env"]}
    assert env["POSTTRAIN_API_KEY"]["valueFrom"]["secretKeyRef"]["name"]
    assert env["MODEL_URI"]["value"].startswith("models:/") and "$(MODEL_URI)" in c["args"]
    svc = kinds["Service"]["spec"]
    assert svc["selector"] == kinds["Deployment"]["spec"]["selector"]["matchLabels"]
    assert svc["ports"][0]["targetPort"] in (port, c["ports"][0]["name"])


# ------------------------------------------------------------------ two real replicas via the CLI

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The debug preset with a large init (no greedy ties) and the byte tokenizer, saved as a checkpoint."""
    from posttrain.core.model import build_model, get_preset
    from posttrain.registry.byte_tokenizer import byte_tokenizer
    from posttrain.registry.hf import save_pretrained

    path = tmp_path_factory.mktemp("ckpt") / "model"
    save_pretrained(build_model(get_preset("debug", initializer_range=0.2), seed=0), path)
    byte_tokenizer(512).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Greedy tokens of the in-process engine on the same checkpoint."""
    from posttrain.core.generation import Engine, RequestParams
    from posttrain.registry.hf import load_pretrained
    from posttrain.registry.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(checkpoint)
    engine = Engine(load_pretrained(checkpoint).eval(), max_num_seqs=4, block_size=16,
                    decode=lambda ids: tok.decode(ids, skip_special_tokens=True))

    def run(prompt_ids, max_tokens):
        (out,) = engine.generate([prompt_ids], RequestParams(max_tokens=max_tokens, temperature=0,
                                                             stop_token_ids=tuple(tok.eos_ids)))
        return tok.decode(out.completions[0].tokens, skip_special_tokens=True)

    run.tok = tok
    return run


@pytest.fixture(scope="module")
def replicas(checkpoint, tmp_path_factory):
    """`posttrain serve-model CKPT --replicas 2` as a user starts it; stopped by SIGTERM."""
    (port,) = free_ports(1)
    logf = open(tmp_path_factory.mktemp("serve") / "serve.log", "w+")
    env = {**os.environ, "POSTTRAIN_API_KEY": KEY, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.flows.cli", "serve-model", str(checkpoint), "--replicas", "2",
                             "--port", str(port), "--served-model-name", "debug", "--max-queue", "32"],
                            env=env, stdout=logf, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def all_ready():
        try:
            r = httpx.get(f"{url}/health", timeout=2)
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and all(x["state"] == "ready" for x in r.json()["replicas"])

    try:
        wait_for(lambda: all_ready() or proc.poll() is not None, 120, "both replicas ready")
        assert proc.poll() is None, open(logf.name).read()[-3000:]
        yield url, all_ready
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(40)
        logf.seek(0)
        log = logf.read()
        assert rc in (0, -signal.SIGTERM), log[-3000:]
        assert "Traceback" not in log, log[-5000:]  # no exception escaped the front end or a replica


def health(url):
    return httpx.get(f"{url}/health", timeout=5).json()["replicas"]


def routed(url):
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).text
    return [metric(text, "posttrain_frontend_routed_total", f'{{replica="{i}"}}') for i in (0, 1)]


def test_two_replicas_answer_like_the_engine_and_share_the_load(replicas, reference):
    url, _ = replicas
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["debug"]
    tok = reference.tok
    prompts = [f"prompt number {i}: " for i in range(12)]
    want = {p: reference(tok.encode(p, add_special_tokens=False), 12) for p in prompts}
    before = routed(url)

    def ask(p):
        return client.completions.create(model="debug", prompt=p, max_tokens=12, temperature=0).choices[0].text

    with ThreadPoolExecutor(6) as pool:
        got = dict(zip(prompts, pool.map(ask, prompts)))
    assert got == want
    after = routed(url)
    assert all(a > b for a, b in zip(after, before)), (before, after)  # both replicas served

    p = prompts[0]
    chunks = client.completions.create(model="debug", prompt=p, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == want[p]
    messages = [{"role": "user", "content": "hi"}]
    chat_want = reference(tok.apply_chat_template(messages, add_generation_prompt=True), 10)
    chat = client.chat.completions.create(model="debug", messages=messages, max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == chat_want
    stream = client.chat.completions.create(model="debug", messages=messages, max_tokens=10, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat_want

    # the replicas' own answers pass through: a bad body is their 400, no key is the front end's 401
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", timeout=10,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()


@pytest.mark.slow
def test_a_replica_killed_under_load(replicas, reference):
    """40 non-streaming requests, 8 at a time, and one longer stream; the stream's replica is
    SIGKILLed while it also holds non-streaming requests. Every non-streaming request succeeds
    (the killed ones retried on the other replica), the stream ends with an error event, the
    replica is restarted on its port and serves again."""
    url, all_ready = replicas
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    tok = reference.tok
    prompts = [f"load {i % 5} " for i in range(40)]
    want = {p: reference(tok.encode(p, add_special_tokens=False), 128) for p in set(prompts)}
    auth = {"Authorization": f"Bearer {KEY}"}
    text = httpx.get(f"{url}/metrics", headers=auth, timeout=5).text
    retried0 = sum(metric(text, "posttrain_frontend_retried_total", f'{{replica="{i}"}}') for i in (0, 1))
    counts = {"sent": 0, "succeeded": 0, "failed": 0}
    lock = threading.Lock()

    def ask(p):
        with lock:
            counts["sent"] += 1
        try:
            text = client.completions.create(model="debug", prompt=p, max_tokens=128, temperature=0).choices[0].text
            ok = text == want[p]
        except openai.APIError:
            ok = False
        with lock:
            counts["succeeded" if ok else "failed"] += 1

    stream_events = []

    def stream():
        # 600 greedy tokens without an EOS (checked): ~0.8 s of decoding alone, more beside the load,
        # so it outlasts the start of the load on a busy machine (200 tokens, ~0.3 s, did not)
        body = {"model": "debug", "prompt": "a long story", "max_tokens": 600, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    stream_events.append(line[6:])

    streamer = threading.Thread(target=stream)
    streamer.start()
    wait_for(lambda: stream_events, 30, "the stream's first event")
    # its replica: the one carrying the stream's 600+ outstanding tokens; least-loaded routing sends
    # it non-streaming requests once the other holds more: 8 in flight x 131 tokens > 603, from the 6th
    victim = max(health(url), key=lambda x: x["outstanding_tokens"])
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(ask, p) for p in prompts]
        # kill it while it also runs non-streaming requests (the stream has to be still going)
        wait_for(lambda: health(url)[victim["replica"]]["inflight"] >= 2 or not streamer.is_alive(), 30,
                 "the victim busy")
        assert streamer.is_alive(), "the stream ended before the kill: make it longer"
        os.kill(victim["pid"], signal.SIGKILL)
        t_kill = time.time()
        for f in futures:
            f.result()
    streamer.join(30)
    assert not streamer.is_alive()  # no hang
    text = httpx.get(f"{url}/metrics", headers=auth, timeout=5).text
    retried = sum(metric(text, "posttrain_frontend_retried_total", f'{{replica="{i}"}}') for i in (0, 1)) - retried0
    print(f"sent {counts['sent']} succeeded {counts['succeeded']} retried {retried:.0f} failed {counts['failed']}")
    assert counts == {"sent": 40, "succeeded": 40, "failed": 0}
    assert retried >= 1  # the killed replica's requests went elsewhere
    assert stream_events[-1] == "[DONE]" and json.loads(stream_events[-2])["error"]["code"] == "replica_failed"
    assert not any('"finish_reason": "length"' in e for e in stream_events)  # cut short, not finished

    wait_for(all_ready, 60, "the killed replica restarted and ready")
    back = health(url)[victim["replica"]]
    assert back["restarts"] == 1 and back["pid"] != victim["pid"] and back["port"] == victim["port"]
    print(f"replica {victim['replica']} back after {time.time() - t_kill:.1f} s")
    before = routed(url)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(ask, prompts[:8]))
    assert routed(url)[victim["replica"]] > before[victim["replica"]] and counts["failed"] == 0
