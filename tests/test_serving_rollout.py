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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.test_serving import KEY, Server, fresh_model
from tests.test_serving_replicas import free_ports, metric, wait_for

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
AUTH = {"Authorization": f"Bearer {KEY}"}


# ------------------------------------------------------------------ cancellation on one server


@pytest.fixture(scope="module")
def server():
    from flows.byte_tokenizer import byte_tokenizer

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
