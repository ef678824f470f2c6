"""Serving without dropping work: a request whose client goes away is aborted in the engine (its KV
blocks freed, no more decode steps), on one real server in this process; and a rolling update of
two real replicas (`posttrain serve-model A --replicas 2`, then `POST /admin/reload` to B) under
continuous load, with no failed request and every answer A's or B's greedy output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.stages.test_serving import KEY, Server, fresh_model
from tests.stages.test_serving_replicas import free_ports, metric, wait_for

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
AUTH = {"Authorization": f"Bearer {KEY}"}


# ------------------------------------------------------------------ cancellation on one server


@pytest.fixture(scope="module")
def server():
    from posttrain.registry.byte_tokenizer import byte_tokenizer

    s = Server(fresh_model(), byte_tokenizer(512))
    yield s
    s.close()


def engine_metrics(server) -> dict[str, float]:
    text = server.get("/metrics").text
    names = ("running_requests", "queue_length", "inflight_requests", "cancelled_requests", "kv_blocks_free",
             "kv_blocks")
    return {n: metric(text, f"posttrain_serve_{n}") for n in names}


def wait_idle(server, free0: float, cancelled: float) -> dict:
    def idle():
        m = engine_metrics(server)
        return m["running_requests"] == m["queue_length"] == m["inflight_requests"] == 0 and \
            m["kv_blocks_free"] == free0 and m["cancelled_requests"] == cancelled

    wait_for(idle, 5, "the engine idle, its blocks back and the cancel counted")
    return engine_metrics(server)


BODY = {"model": "debug", "prompt": "tell me a very long story", "max_tokens": 900, "temperature": 0}


def test_a_closed_stream_is_aborted_in_the_engine(server):
    m0 = engine_metrics(server)
    assert m0["kv_blocks_free"] == m0["kv_blocks"] and m0["running_requests"] == 0
    chunks = 0
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**BODY, "stream": True}, headers=AUTH,
                      timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                busy = engine_metrics(server)
                assert busy["running_requests"] == 1 and busy["kv_blocks_free"] < m0["kv_blocks_free"]
                break  # closes the connection mid-stream (httpcore drops it)
    t0 = time.time()
    wait_idle(server, m0["kv_blocks_free"], m0["cancelled_requests"] + 1)
    print(f"aborted {time.time() - t0:.2f} s after the client closed the stream")
    # the server goes on: a request after it is answered in full
    r = server.post("/v1/completions", {**BODY, "max_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_a_client_that_gives_up_on_a_json_answer_is_aborted(server):
    m0 = engine_metrics(server)
    with pytest.raises(httpx.ReadTimeout):  # httpx drops the connection at its timeout
        httpx.post(f"{server.url}/v1/completions", json=BODY, headers=AUTH, timeout=0.5)
    wait_idle(server, m0["kv_blocks_free"], m0["cancelled_requests"] + 1)


def test_requests_that_finish_are_not_counted_as_cancelled(server):
    m0 = engine_metrics(server)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    client.completions.create(model="debug", prompt="hi", max_tokens=8, temperature=0)
    list(client.completions.create(model="debug", prompt="hi", max_tokens=8, temperature=0, stream=True))
    assert wait_idle(server, m0["kv_blocks_free"], m0["cancelled_requests"])["cancelled_requests"] == \
        m0["cancelled_requests"]


# ------------------------------------------------------------------ the rollout logic, stand-in replicas


class FakeFrontend:
    """The front end in this process over tests/support/fake_replica.py processes; the 'model' a replica
    runs is its MODE, and only the modes below resolve."""

    MODES = {"ok", "full", "exit"}

    def __init__(self, model="ok", n=2):
        import uvicorn

        from posttrain.stages.serving.frontend import Supervisor, build_frontend
        from posttrain.stages.serving.routing import Router

        def resolve(ref):
            if ref not in self.MODES:
                raise ValueError(f"no model {ref!r}")
            return ref, f"{ref}-v1"

        self.sup = Supervisor(lambda port, mode: [sys.executable, str(ROOT / "tests" / "support" / "fake_replica.py"), str(port),
                                                  mode], free_ports(n), Router(n), health_interval=0.2, ref=model,
                              model=model, version=f"{model}-v1", resolve=resolve, ready_timeout_s=10)
        (port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(build_frontend(self.sup), port=port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: all(r.state == "ready" for r in self.sup.replicas), 20, "every replica ready")

    def health(self):
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def reload(self, body=None):
        return httpx.post(f"{self.url}/admin/reload", json=body, timeout=30)

    def wait_rollout(self, timeout=30):
        wait_for(lambda: self.health()["rollout"]["state"] in ("done", "failed"), timeout, "the rollout to end")
        return self.health()

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture()
def fake():
    fe = FakeFrontend()
    yield fe
    fe.close()


@pytest.mark.slow
def test_a_reload_that_does_not_resolve_changes_nothing(fake):
    before = fake.health()
    r = fake.reload({"model": "no-such-model"})
    assert r.status_code == 400 and "no-such-model" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "model_unavailable"
    for bad in (b"[1]", b'{"model": 3}', b"{not json"):
        r = httpx.post(f"{fake.url}/admin/reload", content=bad, timeout=10)
        assert r.status_code == 400, bad
    after = fake.health()
    assert after["status"] == "ok" and after["rollout"]["state"] == "idle"
    assert [(x["pid"], x["version"], x["reloads"], x["state"]) for x in after["replicas"]] == \
        [(x["pid"], "ok-v1", 0, "ready") for x in before["replicas"]]
    assert httpx.post(f"{fake.url}/v1/completions", json={"prompt": "x"}, timeout=10).status_code == 200
    text = httpx.get(f"{fake.url}/metrics", timeout=10).text
    assert metric(text, "posttrain_frontend_reloads_total", '{result="refused"}') == 1
    assert metric(text, "posttrain_frontend_replica_model", '{replica="0",version="ok-v1"}') == 1


@pytest.mark.slow
def test_a_reload_rolls_one_replica_at_a_time(fake):
    pids = [x["pid"] for x in fake.health()["replicas"]]
    assert fake.reload().json()["state"] == "unchanged"  # the same reference, the same version
    seen = []  # the replicas' states while it rolls: never both out of service
    r = fake.reload({"model": "full"})
    assert r.status_code == 202 and r.json()["state"] == "rolling" and r.json()["from"] == ["ok-v1", "ok-v1"]
    while fake.health()["rollout"]["state"] == "rolling":
        seen.append(tuple(x["state"] for x in fake.health()["replicas"]))
    h = fake.wait_rollout()
    assert h["rollout"]["state"] == "done" and h["model"] == "full"
    assert [(x["version"], x["reloads"], x["state"]) for x in h["replicas"]] == [("full-v1", 1, "ready")] * 2
    assert all(x["pid"] != p for x, p in zip(h["replicas"], pids))
    assert all("ready" in states for states in seen), seen
    assert httpx.post(f"{fake.url}/v1/completions", json={"prompt": "x"}, timeout=10).status_code == 429  # B answers
    text = httpx.get(f"{fake.url}/metrics", timeout=10).text
    assert metric(text, "posttrain_frontend_replica_model", '{replica="1",version="full-v1"}') == 1
    assert 'version="ok-v1"' not in text
    assert metric(text, "posttrain_frontend_reloads_total", '{result="rolled"}') == 1


@pytest.mark.slow
def test_a_model_that_does_not_come_up_is_rolled_back(fake):
    r = fake.reload({"model": "exit"})  # resolves, but every replica on it exits at once
    assert r.status_code == 202
    h = fake.wait_rollout()
    assert h["rollout"]["state"] == "failed" and "replica 0 did not come up" in h["rollout"]["error"]
    assert h["model"] == "ok"
    wait_for(lambda: all(x["state"] == "ready" for x in fake.health()["replicas"]), 20, "both serving again")
    assert [x["version"] for x in fake.health()["replicas"]] == ["ok-v1", "ok-v1"]
    assert fake.health()["replicas"][1]["reloads"] == 0  # never touched
    assert httpx.post(f"{fake.url}/v1/completions", json={"prompt": "x"}, timeout=10).status_code == 200


# ------------------------------------------------------------------ a real rollout under load, via the CLI


def save_checkpoint(path: Path, seed: int) -> Path:
    from posttrain.core.model import build_model, get_preset
    from posttrain.registry.byte_tokenizer import byte_tokenizer
    from posttrain.registry.hf import save_pretrained

    save_pretrained(build_model(get_preset("debug", initializer_range=0.2), seed=seed), path)
    byte_tokenizer(512).save_pretrained(path)
    return path


def greedy_texts(checkpoint: Path, prompts: list[str], max_tokens: int) -> dict[str, str]:
    from posttrain.core.generation import Engine, RequestParams
    from posttrain.registry.hf import load_pretrained
    from posttrain.registry.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(checkpoint)
    engine = Engine(load_pretrained(checkpoint).eval(), max_num_seqs=4, block_size=16)
    outs = engine.generate([tok.encode(p, add_special_tokens=False) for p in prompts],
                           RequestParams(max_tokens=max_tokens, temperature=0, stop_token_ids=tuple(tok.eos_ids)))
    return {p: tok.decode(o.completions[0].tokens, skip_special_tokens=True) for p, o in zip(prompts, outs)}


@pytest.mark.slow
def test_a_rolling_update_under_load_fails_no_request(tmp_path):
    """`serve-model current --replicas 2`, `current` a symlink to checkpoint A; 4 clients (one
    streaming) send greedy requests without pause; a bad reload is refused; then `current` is
    pointed at B and the front end gets SIGHUP. No request fails, each answer is A's or B's,
    every request sent after the roll is B's, each replica restarted once (none crashed)."""
    a, b = save_checkpoint(tmp_path / "A", 0), save_checkpoint(tmp_path / "B", 1)
    current = tmp_path / "current"
    current.symlink_to(a)
    prompts, max_tokens = [f"rolling {i}: " for i in range(6)], 8
    want_a, want_b = greedy_texts(a, prompts, max_tokens), greedy_texts(b, prompts, max_tokens)
    assert all(want_a[p] != want_b[p] for p in prompts)  # tell them apart
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    logf = open(tmp_path / "serve.log", "w+")
    env = {**os.environ, "POSTTRAIN_API_KEY": KEY, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.flows.cli", "serve-model", str(current), "--replicas", "2",
                             "--port", str(port), "--served-model-name", "debug", "--drain-timeout", "20"],
                            env=env, stdout=logf, stderr=subprocess.STDOUT)

    def health():
        try:
            r = httpx.get(f"{url}/health", timeout=2)
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    results, threads, stop, lock = [], [], threading.Event(), threading.Lock()

    def client_loop(k: int):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        i = k
        while not stop.is_set():
            p, t0 = prompts[i % len(prompts)], time.time()
            i += 1
            try:
                if k == 0:
                    chunks = client.completions.create(model="debug", prompt=p, max_tokens=max_tokens,
                                                       temperature=0, stream=True)
                    text = "".join(c.choices[0].text for c in chunks)
                else:
                    text = client.completions.create(model="debug", prompt=p, max_tokens=max_tokens,
                                                     temperature=0).choices[0].text
            except Exception as e:  # noqa: BLE001 - a failed request is what this test counts
                text = e
            with lock:
                results.append((p, t0, text))

    try:
        wait_for(lambda: (h := health()) is not None and all(x["state"] == "ready" for x in h["replicas"])
                 or proc.poll() is not None, 120, "both replicas ready")
        assert proc.poll() is None, open(logf.name).read()[-3000:]
        h0 = health()
        assert [x["version"] for x in h0["replicas"]] == [str(a)] * 2 and h0["model"] == str(current)
        pids = [x["pid"] for x in h0["replicas"]]
        threads += [threading.Thread(target=client_loop, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: len(results) >= 8, 30, "load running")

        # a reload needs the key; one whose model does not resolve is refused and changes nothing
        assert httpx.post(f"{url}/admin/reload", timeout=30).status_code == 401
        r = httpx.post(f"{url}/admin/reload", json={"model": str(tmp_path / "nope")}, headers=AUTH, timeout=30)
        assert r.status_code == 400 and "nope" in r.json()["error"]["message"], r.text
        assert [x["pid"] for x in health()["replicas"]] == pids

        t_roll = time.time()
        (tmp_path / "next").symlink_to(b)
        os.replace(tmp_path / "next", current)  # the alias moves ...
        proc.send_signal(signal.SIGHUP)  # ... and the front end is told
        wait_for(lambda: (h := health()) is not None and h["rollout"]["state"] in ("done", "failed"), 60,
                 "the rollout to end")
        t_done = time.time()
        h = health()
        assert h["rollout"]["state"] == "done", h
        wait_for(lambda: sum(t0 > t_done for _, t0, _ in results) >= 8, 30, "load after the roll")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(40)
        logf.seek(0)
        log = logf.read()
    print(f"rolled in {t_done - t_roll:.1f} s; {len(results)} requests")
    assert rc in (0, -signal.SIGTERM), log[-3000:]
    assert "Traceback" not in log, log[-5000:]
    failed = [(p, text) for p, _, text in results if not isinstance(text, str)]
    assert not failed, failed[:3]
    wrong = [(p, text) for p, _, text in results if text not in (want_a[p], want_b[p])]
    assert not wrong, wrong[:3]
    assert all(text == want_a[p] for p, t0, text in results if t0 < t_roll)
    assert all(text == want_b[p] for p, t0, text in results if t0 > t_done)
    assert any(text == want_b[p] for p, t0, text in results if t0 < t_done)  # B served while it rolled
    assert [(x["version"], x["reloads"], x["restarts"]) for x in h["replicas"]] == [(str(b), 1, 0)] * 2
    assert all(x["pid"] != p for x, p in zip(h["replicas"], pids)) and h["model"] == str(current)
