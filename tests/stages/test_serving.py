"""`posttrain serve-model` (posttrain.stages.serving): a real uvicorn server on 127.0.0.1, talked to with the
official `openai` client and raw HTTP. The debug preset with random weights (a large init, so
greedy ties are unlikely) and the byte-level tokenizer; two LoRA adapters with random B saved in
PEFT format and loaded back onto one base. Greedy answers are compared token for token with the
engine run in-process on an identical copy of the model."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttrain.core.generation import Engine, RequestParams
from posttrain.core.lora import apply_lora
from posttrain.core.model import build_model, get_preset
from posttrain.registry.byte_tokenizer import byte_tokenizer
from posttrain.registry.adapters import save_adapter
from posttrain.stages.serving.server import EngineSettings, load_adapters, make_state, parse_adapters, serve
from tests.support.serve_model import start_serve_model

openai = pytest.importorskip("openai")

KEY = "test-key-123"
BASE_ID = "debug"


def fresh_model():
    return build_model(get_preset("debug", initializer_range=0.2), seed=0).eval()


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    model = fresh_model()
    torch.manual_seed(1)
    apply_lora(model, rank=4, alpha=8.0, targets="all-linear", adapter_name=["a", "b"])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    return {name: save_adapter(model, root / name, name) for name in ("a", "b")}


def served_model(adapter_dirs):
    model = fresh_model()
    load_adapters(model, adapter_dirs)
    return model


class Server:
    def __init__(self, model, tokenizer, max_queue=64, api_key=KEY):
        self.state = make_state(model, tokenizer, BASE_ID, _adapter_list(model), api_key=api_key, max_queue=max_queue,
                                engine=EngineSettings(max_num_seqs=16))
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.uvicorn = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("the server did not come up")

    def _run(self):
        import uvicorn

        from posttrain.stages.serving.app import build_app

        self.uvicorn = uvicorn.Server(uvicorn.Config(build_app(self.state), log_level="warning", lifespan="off"))
        try:
            self.uvicorn.run(sockets=[self.sock])
        finally:
            self.state.worker.stop()

    def close(self):
        while self.uvicorn is None:
            time.sleep(0.01)
        self.uvicorn.should_exit = True
        self.thread.join(20)

    def post(self, path, body=None, key=KEY, raw=None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if raw is not None:
            headers["Content-Type"] = "application/json"
            return httpx.post(self.url + path, content=raw, headers=headers, timeout=60)
        return httpx.post(self.url + path, json=body, headers=headers, timeout=60)

    def get(self, path, key=KEY):
        return httpx.get(self.url + path, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)


def _adapter_list(model):
    from posttrain.core.lora.model import adapter_names

    return adapter_names(model)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer(512)


@pytest.fixture(scope="module")
def server(adapter_dirs, tok):
    s = Server(served_model(adapter_dirs), tok)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(adapter_dirs, tok):
    """Greedy tokens of the in-process engine on an identical model: (prompt ids, adapter, n) -> tokens."""
    model = served_model(adapter_dirs)
    engine = Engine(model, max_num_seqs=4, block_size=16, decode=lambda ids: tok.decode(ids, skip_special_tokens=True))

    def run(prompt, max_tokens, adapter=None):
        (out,) = engine.generate([prompt], RequestParams(max_tokens=max_tokens, temperature=0, adapter=adapter,
                                                         stop_token_ids=tuple(tok.eos_ids)))
        return out.completions[0].tokens

    return run


def text_of(tok, tokens):
    return tok.decode(tokens, skip_special_tokens=True)


def error_of(r, status):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# ------------------------------------------------------------------ the API through the official client


def test_completion_greedy_matches_the_engine_and_streams_the_same(client, tok, reference):
    prompt = "Hello there"
    ids = tok.encode(prompt, add_special_tokens=False)
    want = reference(ids, 24)
    r = client.completions.create(model=BASE_ID, prompt=prompt, max_tokens=24, temperature=0)
    assert r.object == "text_completion" and r.model == BASE_ID and len(r.choices) == 1
    assert r.choices[0].text == text_of(tok, want)
    assert r.choices[0].finish_reason == ("stop" if want[-1] in tok.eos_ids else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (len(ids), len(want), len(ids) + len(want))
    same = client.completions.create(model=BASE_ID, prompt=ids, max_tokens=24, temperature=0)  # token ids
    assert same.choices[0].text == r.choices[0].text
    chunks = list(client.completions.create(model=BASE_ID, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(want)


def test_chat_greedy_matches_the_engine_and_streams_the_same(client, tok, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    want = reference(ids, 20)
    r = client.chat.completions.create(model=BASE_ID, messages=messages, max_tokens=20, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text_of(tok, want)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)
    chunks = list(client.chat.completions.create(model=BASE_ID, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    lp = client.chat.completions.create(model=BASE_ID, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                        top_logprobs=3)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob <= 0 and abs(c.logprob - c.top_logprobs[0].logprob) < 1e-5 for c in content)  # greedy


def test_n_samples_with_a_seed_are_reproducible(client):
    kw = dict(model=BASE_ID, prompt="Once upon", max_tokens=12, temperature=1.0, n=2, seed=42)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == b.usage.completion_tokens <= 24 and a.usage.completion_tokens >= 2
    other = client.completions.create(**{**kw, "seed": 43})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]
    streamed = ["", ""]
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in a.choices]
    lp = client.completions.create(model=BASE_ID, prompt="Once upon", max_tokens=4, temperature=0, logprobs=2)
    assert len(lp.choices[0].logprobs.token_logprobs) == 4 and all(len(d) <= 2 for d in lp.choices[0].logprobs.top_logprobs)


def test_stop_strings_end_the_text(client, tok, reference):
    ids = tok.encode("abc", add_special_tokens=False)
    full = text_of(tok, reference(ids, 40))
    cut = next((i for i in range(2, len(full) - 1) if full[i:i + 2].isprintable() and full[i:i + 2].strip()), None)
    # the model is fixed (seed 0), so its greedy text is too: it has such a pair (an error, not a skip)
    assert cut is not None, f"the model's text {full!r} has no printable pair to stop at"
    stop = full[cut:cut + 2]
    want = full[:full.index(stop)]
    r = client.completions.create(model=BASE_ID, prompt=ids, max_tokens=40, temperature=0, stop=[stop, "\x00never"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=BASE_ID, prompt=ids, max_tokens=40, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == want


def test_models_lists_the_base_and_the_adapters(client):
    assert [m.id for m in client.models.list().data] == [BASE_ID, "a", "b"]


# ------------------------------------------------------------------ multi-LoRA


def test_each_adapter_answers_with_its_own_weights(client, tok, reference):
    ids = tok.encode("The adapter says", add_special_tokens=False)
    want = {m: reference(ids, 16, None if m == BASE_ID else m) for m in (BASE_ID, "a", "b")}
    assert len({tuple(v) for v in want.values()}) == 3  # the adapters really differ
    got = {m: client.completions.create(model=m, prompt=ids, max_tokens=16, temperature=0).choices[0].text
           for m in want}
    assert got == {m: text_of(tok, v) for m, v in want.items()}
    # interleaved, concurrent: they share the engine's batches and give the sequential answers
    from concurrent.futures import ThreadPoolExecutor

    order = [BASE_ID, "a", "b", "a", "b", BASE_ID, "b", "a"]
    with ThreadPoolExecutor(len(order)) as pool:
        outs = list(pool.map(lambda m: (m, client.completions.create(model=m, prompt=ids, max_tokens=16,
                                                                     temperature=0).choices[0].text), order))
    assert all(text == got[m] for m, text in outs)


def test_unknown_model_is_404(server):
    err = error_of(server.post("/v1/completions", {"model": "nope", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"


# ------------------------------------------------------------------ bad input, auth, backpressure


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x"}, "model"),
    ({"model": BASE_ID}, "prompt"),
    ({"model": BASE_ID, "prompt": "x", "temperature": -0.5}, "temperature"),
    ({"model": BASE_ID, "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": BASE_ID, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": BASE_ID, "prompt": "x", "max_tokens": 5000}, "max_tokens"),
    ({"model": BASE_ID, "prompt": "x", "n": 17}, "n"),
    ({"model": BASE_ID, "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": BASE_ID, "prompt": "x", "stop": [1, 2]}, "stop"),
    ({"model": BASE_ID, "prompt": [5, 512]}, "prompt"),
    ({"model": BASE_ID, "prompt": [-1]}, "prompt"),
    ({"model": BASE_ID, "prompt": [3] * 1024}, "prompt"),
    ({"model": BASE_ID, "prompt": []}, "prompt"),
    ({"model": BASE_ID, "prompt": "x", "presence_penalty": 1.0}, "presence_penalty"),
])
def test_bad_completion_requests_are_400(server, body, param):
    assert error_of(server.post("/v1/completions", body), 400)["param"] == param


@pytest.mark.parametrize("body,param", [
    ({"model": BASE_ID}, "messages"),
    ({"model": BASE_ID, "messages": []}, "messages"),
    ({"model": BASE_ID, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": BASE_ID, "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"model": BASE_ID, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": BASE_ID, "messages": [{"role": "user", "content": "x" * 1100}]}, "prompt"),
])
def test_bad_chat_requests_are_400(server, body, param):
    assert error_of(server.post("/v1/chat/completions", body), 400)["param"] == param


def test_malformed_json_and_wrong_routes(server):
    assert error_of(server.post("/v1/completions", raw=b"{not json"), 400)["code"] == "invalid_json"
    error_of(server.post("/v1/completions", raw=b"[1, 2]"), 400)
    error_of(server.post("/v1/nothing", {}), 404)
    error_of(server.get("/v1/completions"), 405)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-10 ** 6, 10 ** 6) | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=8), lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                    max_leaves=8)
FIELDS = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from([BASE_ID, "a", "zzz"]) | JSON,
    "prompt": st.text(max_size=12) | st.lists(st.integers(-5, 600), max_size=6) | JSON,
    "max_tokens": st.integers(-3, 2000) | JSON, "temperature": st.floats(-1, 3) | JSON,
    "top_p": st.floats(-0.5, 1.5) | JSON, "n": st.integers(-1, 20) | JSON, "stop": st.text(max_size=3) | JSON,
    "seed": st.integers(-10 ** 20, 10 ** 20) | JSON, "logprobs": st.integers(-2, 30) | JSON, "stream": JSON,
    "echo": JSON, "stream_options": JSON})


def test_fuzzed_bodies_never_get_a_5xx(server):
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=FIELDS | JSON)
    def check(body):
        if isinstance(body, dict) and isinstance(body.get("max_tokens"), int):
            body["max_tokens"] = min(body["max_tokens"], 4)  # keep the valid ones quick
        r = server.post("/v1/completions", body)
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    check()
    assert server.get("/health", key=None).json() == {"status": "ok"}


def test_api_key_required_except_on_health(server):
    assert server.get("/health", key=None).status_code == 200
    for path in ("/v1/models", "/metrics"):
        assert error_of(server.get(path, key=None), 401)["type"] == "authentication_error"
        error_of(server.get(path, key="wrong"), 401)
    error_of(server.post("/v1/completions", {"model": BASE_ID, "prompt": "x"}, key="wrong"), 401)


@pytest.mark.slow
def test_queue_full_is_429_with_retry_after(adapter_dirs, tok):
    s = Server(served_model(adapter_dirs), tok, max_queue=1)
    gate, entered = threading.Event(), threading.Event()
    engine = s.state.worker.engine
    real = engine.step

    def held_step():
        entered.set()
        gate.wait(30)
        return real()

    engine.step = held_step
    try:
        first = threading.Thread(target=lambda: s.post("/v1/completions", {"model": BASE_ID, "prompt": "x",
                                                                          "max_tokens": 3}))
        first.start()
        assert entered.wait(20)
        r = s.post("/v1/completions", {"model": BASE_ID, "prompt": "y", "max_tokens": 3})
        assert error_of(r, 429)["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"
        gate.set()
        first.join(30)
        assert s.post("/v1/completions", {"model": BASE_ID, "prompt": "y", "max_tokens": 3}).status_code == 200
    finally:
        gate.set()
        s.close()


def test_an_engine_failure_fails_its_requests_and_the_server_goes_on(server):
    worker = server.state.worker
    broken = worker.engine

    def boom():
        raise RuntimeError("injected fault")

    broken.step = boom
    err = error_of(server.post("/v1/completions", {"model": BASE_ID, "prompt": "x", "max_tokens": 3}), 500)
    assert err["type"] == "server_error" and "injected fault" in err["message"]
    assert worker.engine is not broken  # a fresh engine
    assert server.post("/v1/completions", {"model": BASE_ID, "prompt": "x", "max_tokens": 3}).status_code == 200
    assert server.get("/health", key=None).status_code == 200


# ------------------------------------------------------------------ metrics, CLI pieces


def metric(text, name, labels=""):
    for line in text.splitlines():
        if line.startswith(name + labels + " ") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_move_after_requests(server):
    before = server.get("/metrics").text
    for name in ("posttrain_serve_queue_length", "posttrain_serve_running_requests",
                 "posttrain_serve_generated_tokens_total", "posttrain_serve_time_to_first_token_seconds_count"):
        assert name in before
    server.post("/v1/completions", {"model": BASE_ID, "prompt": "metrics", "max_tokens": 5, "temperature": 0})
    server.post("/v1/completions", {"model": BASE_ID, "prompt": "x", "max_tokens": 0})
    after = server.get("/metrics").text
    assert metric(after, "posttrain_serve_generated_tokens_total") >= metric(before, "posttrain_serve_generated_tokens_total") + 1
    assert metric(after, "posttrain_serve_time_to_first_token_seconds_count") > \
        metric(before, "posttrain_serve_time_to_first_token_seconds_count")
    ok = '{route="/v1/completions",status="200"}'
    bad = '{route="/v1/completions",status="400"}'
    assert metric(after, "posttrain_serve_requests_total", ok) > metric(before, "posttrain_serve_requests_total", ok)
    assert metric(after, "posttrain_serve_requests_total", bad) > metric(before, "posttrain_serve_requests_total", bad)


def test_cli_parses_serve_model_and_binds_localhost():
    from posttrain.flows.cli import build_parser

    args = build_parser().parse_args(["serve-model", "debug"])
    assert (args.host, args.port, args.max_queue, args.adapters) == ("127.0.0.1", 8000, 64, None)
    from pathlib import Path

    assert parse_adapters("a=/x, b=rel/y") == {"a": Path("/x"), "b": Path("rel/y")}
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_adapters("oops")


@pytest.mark.slow
def test_the_cli_serves_a_model_until_sigterm(adapter_dirs, tmp_path):
    """`posttrain serve-model debug --adapters ...` as a user starts it: it answers the `openai`
    client for the base and an adapter, refuses a missing key, and stops cleanly on SIGTERM."""
    import signal

    adapters = ",".join(f"{name}={path}" for name, path in adapter_dirs.items())
    proc, port = start_serve_model(["debug", "--adapters", adapters], tmp_path, {"POSTTRAIN_API_KEY": KEY})
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY)
        assert {m.id for m in client.models.list().data} == {"debug", "a", "b"}
        for model in ("debug", "a"):
            out = client.completions.create(model=model, prompt="copy: x y", max_tokens=4, temperature=0)
            assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason in ("stop", "length")
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    log = proc.stdout.read()
    # uvicorn shuts down gracefully, then re-raises the signal it caught (exit by SIGTERM, as is usual)
    assert rc in (0, -signal.SIGTERM) and "Finished server process" in log, (rc, log[-3000:])
