"""`posttrain serve-model --tp K` (posttrain.stages.serving.tp): one replica split by tensor parallelism over
K processes. A real server with --tp 2 on CPU (gloo), started by the CLI as a user starts it and
talked to with the official `openai` client. Its answers are compared token for token with the
engine run in one process on the same checkpoint: greedy, through a LoRA adapter, streamed,
chat, seeded n=2 sampling, and two requests interleaved in one batch. A follower killed
mid-request fails the request with a clean error and rank 0 exits 1; SIGTERM stops every rank
with exit 0. Plus the fast checks: a --tp that does not divide the heads is refused before
anything starts, and the messages' encoding of RequestParams round-trips."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from posttrain.core.generation import RequestParams

KEY = "tp-key-1"


# ------------------------------------------------------------------ fast checks


@pytest.mark.parametrize("argv,msg", [
    (["--tp", "3"], "--tp 3: tp=3 does not divide the model's n_heads=4"),
    (["--tp", "4"], "does not divide the model's n_kv_heads=2"),
    (["--tp", "0"], "--tp must be at least 1"),
    (["--tp", "3", "--replicas", "2"], "--tp 3: tp=3 does not divide"),
])
def test_a_tp_that_does_not_split_the_model_is_refused_before_anything_starts(argv, msg, capsys):
    from posttrain.flows.cli import main

    t0 = time.time()
    assert main(["serve-model", "debug", *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err
    assert time.time() - t0 < 10


def test_request_params_survive_the_message_encoding():
    from posttrain.stages.serving.tp import decode_params, encode_params

    p = RequestParams(max_tokens=7, temperature=0.7, top_k=3, top_p=0.9, min_p=0.05, stop_token_ids=(1, 2),
                      stop=("\n\n", "END"), seed=2 ** 62 + 5, n=2, logprobs=False, top_logprobs=2, adapter="a")
    import json

    assert decode_params(json.loads(json.dumps(encode_params(p)))) == p


# ------------------------------------------------------------------ a real --tp 2 server

openai = pytest.importorskip("openai")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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
def adapter(checkpoint, tmp_path_factory):
    """A LoRA adapter with random B (so it changes the answers), saved in PEFT format."""
    import torch

    from posttrain.core.lora import apply_lora
    from posttrain.registry.adapters import save_adapter
    from posttrain.registry.hf import load_pretrained

    model = load_pretrained(checkpoint)
    torch.manual_seed(1)
    apply_lora(model, rank=4, alpha=8.0, targets="all-linear", adapter_name="a")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    return save_adapter(model, tmp_path_factory.mktemp("adapters") / "a", "a")


@pytest.fixture(scope="module")
def reference(checkpoint, adapter):
    """The single-process engine on the same checkpoint: (token lists, log-prob lists, texts) of
    one request."""
    from posttrain.core.generation import Engine
    from posttrain.registry.hf import load_pretrained
    from posttrain.registry.tokenizer import Tokenizer

    from posttrain.stages.serving.server import load_adapters

    tok = Tokenizer.from_pretrained(checkpoint)
    model = load_pretrained(checkpoint)
    load_adapters(model, {"a": adapter})
    engine = Engine(model.eval(), max_num_seqs=4, block_size=16,
                    decode=lambda ids: tok.decode(ids, skip_special_tokens=True))

    def run(prompt_ids, max_tokens, temperature=0.0, seed=None, n=1, adapter=None):
        (out,) = engine.generate([prompt_ids], RequestParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                                             n=n, stop_token_ids=tuple(tok.eos_ids), adapter=adapter))
        return ([c.tokens for c in out.completions], [c.logprobs for c in out.completions],
                [tok.decode(c.tokens, skip_special_tokens=True) for c in out.completions])

    run.tok = tok
    return run


class TPServer:
    """`posttrain serve-model CKPT --tp 2` (or `flags`) in its own process, its output in a log file."""

    def __init__(self, checkpoint, log_path: Path, adapter: Path | None = None, flags=("--tp", "2")):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w+")
        env = {**os.environ, "POSTTRAIN_API_KEY": KEY, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "posttrain.flows.cli", "serve-model", str(checkpoint), *flags,
                                      "--port", str(self.port), "--served-model-name", "debug", "--max-num-seqs", "8",
                                      *(["--adapters", f"a={adapter}"] if adapter else [])],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError(f"the {' '.join(flags)} server did not come up:\n{self.text()[-3000:]}")

    def client(self):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=60)

    def followers(self) -> list[int]:
        return descendants(self.proc.pid)

    def text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(40)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def server(checkpoint, adapter, tmp_path_factory):
    s = TPServer(checkpoint, tmp_path_factory.mktemp("tp") / "serve.log", adapter)
    followers = s.followers()
    assert len(followers) == 1
    yield s
    rc = s.stop()
    log = s.text()
    assert rc == 0, log[-3000:]
    assert "Traceback" not in log and "stopped:" not in log, log[-5000:]
    time.sleep(0.5)
    assert not [p for p in followers if running(p)], "a follower outlived SIGTERM on rank 0"


@pytest.mark.slow
def test_a_tp2_server_answers_token_for_token_like_one_process(server, reference):
    client = server.client()
    tok = reference.tok
    assert [m.id for m in client.models.list().data] == ["debug", "a"]
    answers = {}
    for p, model in (("the quick brown fox", "debug"), ("tensor parallel serving: ", "debug"),
                     ("the quick brown fox", "a")):  # the adapter, split with its base layers
        tokens, logps, texts = reference(tok.encode(p, add_special_tokens=False), 12,
                                         adapter=None if model == "debug" else model)
        got = client.completions.create(model=model, prompt=p, max_tokens=12, temperature=0, logprobs=0).choices[0]
        assert got.text == texts[0]
        assert len(got.logprobs.token_logprobs) == len(tokens[0])  # the same tokens: same count, same log-probs
        assert max(abs(a - b) for a, b in zip(got.logprobs.token_logprobs, logps[0])) < 1e-4
        answers[model, p] = got.text
    assert answers["a", "the quick brown fox"] != answers["debug", "the quick brown fox"]

    p = "streamed "
    _, _, texts = reference(tok.encode(p, add_special_tokens=False), 16)
    chunks = client.completions.create(model="debug", prompt=p, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == texts[0]

    messages = [{"role": "user", "content": "hi there"}]
    _, _, texts = reference(tok.apply_chat_template(messages, add_generation_prompt=True), 10)
    chat = client.chat.completions.create(model="debug", messages=messages, max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == texts[0]

    p = "sample me twice "
    tokens, logps, texts = reference(tok.encode(p, add_special_tokens=False), 10, temperature=1.0, seed=1234, n=2)
    got = client.completions.create(model="debug", prompt=p, max_tokens=10, temperature=1.0, seed=1234, n=2,
                                    logprobs=0)
    by_index = sorted(got.choices, key=lambda c: c.index)
    assert [c.text for c in by_index] == texts and texts[0] != texts[1]
    for c, want in zip(by_index, logps):
        assert max(abs(a - b) for a, b in zip(c.logprobs.token_logprobs, want)) < 1e-4

    # no seed: rank 0 picks one for every rank; the answer comes back whole
    got = client.completions.create(model="debug", prompt=p, max_tokens=10, temperature=1.0, n=2)
    assert len(got.choices) == 2 and all(c.finish_reason in ("stop", "length") for c in got.choices)


@pytest.mark.slow
def test_two_requests_interleave_in_the_tp_engine(server, reference):
    """A long stream is running when a short request arrives: the short one is admitted into the
    running batch and finishes first; both equal the one-process engine's answers."""
    client = server.client()
    tok = reference.tok
    long_p, short_p = "a long answer: ", "short: "
    long_tokens, _, long_want = reference(tok.encode(long_p, add_special_tokens=False), 200)
    assert len(long_tokens[0]) == 200  # no early stop: it is still running when the short one ends
    _, _, short_want = reference(tok.encode(short_p, add_special_tokens=False), 6)
    events: list[str] = []
    pieces: list[str] = []
    started = threading.Event()

    def stream_long():
        for i, c in enumerate(client.completions.create(model="debug", prompt=long_p, max_tokens=200, temperature=0,
                                                        stream=True)):
            pieces.append(c.choices[0].text)
            if i == 2:
                started.set()
        events.append("long done")

    t = threading.Thread(target=stream_long)
    t.start()
    assert started.wait(60)
    short = client.completions.create(model="debug", prompt=short_p, max_tokens=6, temperature=0)
    events.append("short done")
    t.join(60)
    assert events == ["short done", "long done"]
    assert short.choices[0].text == short_want[0]
    assert "".join(pieces) == long_want[0]


@pytest.mark.slow
def test_a_closed_stream_is_aborted_on_every_rank(server, reference):
    """A client leaves a long stream while another request runs: rank 0 aborts it and tells the
    followers (an `abort` op), so the ranks stay in step; the request beside it, and one after,
    still answer token for token like one process, and the aborted request's blocks come back."""
    from tests.stages.test_serving_replicas import metric

    client = server.client()
    tok = reference.tok

    def blocks_free():
        return metric(httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text,
                      "posttrain_serve_kv_blocks_free")

    free0 = blocks_free()
    beside_p = "beside the abort: "
    _, _, beside_want = reference(tok.encode(beside_p, add_special_tokens=False), 40)
    beside: list = []
    t = threading.Thread(target=lambda: beside.append(
        client.completions.create(model="debug", prompt=beside_p, max_tokens=40, temperature=0).choices[0].text))
    with httpx.stream("POST", f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "debug", "prompt": "leave me early: ", "max_tokens": 400, "temperature": 0,
                            "stream": True}, timeout=60) as r:
        for i, _line in enumerate(r.iter_lines()):
            if i == 2:
                t.start()
            if i == 6:
                break  # the connection drops mid-stream
    t.join(60)
    assert beside == beside_want
    _, _, after_want = reference(tok.encode("after: ", add_special_tokens=False), 8)
    assert client.completions.create(model="debug", prompt="after: ", max_tokens=8,
                                     temperature=0).choices[0].text == after_want[0]
    deadline = time.time() + 10
    while blocks_free() != free0 and time.time() < deadline:
        time.sleep(0.1)
    assert blocks_free() == free0
    assert "Traceback" not in server.text()


@pytest.mark.slow
def test_a_follower_dying_fails_its_requests_cleanly_and_rank0_exits_1(checkpoint, tmp_path):
    s = TPServer(checkpoint, tmp_path / "serve.log")
    try:
        (follower,) = s.followers()
        client = s.client()
        got: dict = {}
        started = threading.Event()

        def stream_long():
            try:
                for i, _ in enumerate(client.completions.create(model="debug", prompt="doomed ", max_tokens=400,
                                                                temperature=0, stream=True)):
                    if i == 1:
                        started.set()
                got["stream"] = "ended without an error"
            except openai.APIError as e:
                got["stream"] = e

        t = threading.Thread(target=stream_long)
        t.start()
        assert started.wait(60)
        os.kill(follower, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive()
        assert isinstance(got["stream"], openai.APIError), got
        assert "tensor-parallel group failed" in str(got["stream"])
        assert s.proc.wait(40) == 1
        log = s.text()
        assert "serve-model: the tensor-parallel group failed" in log and "Traceback" not in log, log[-3000:]
    finally:
        s.stop()


@pytest.mark.slow
def test_tp_composes_with_replicas(checkpoint, reference, tmp_path):
    """--tp 2 --replicas 2: the front end starts two replicas of two ranks each (both become ready:
    their ranks met); they answer like the one-process engine, and SIGTERM on the front end takes
    every process down."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")
    env = {**os.environ, "POSTTRAIN_API_KEY": KEY, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.flows.cli", "serve-model", str(checkpoint), "--tp", "2",
                             "--replicas", "2", "--port", str(port), "--served-model-name", "debug"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        ready = False
        while not ready and time.time() < deadline and proc.poll() is None:
            try:
                ready = all(r["state"] == "ready" for r in httpx.get(f"{url}/health", timeout=2).json()["replicas"])
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.3)
        assert ready, Path(log.name).read_text()[-3000:]
        pids = descendants(proc.pid)
        assert len(pids) >= 4  # two replicas' rank 0s and their followers
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        tok = reference.tok
        for i in range(3):
            p = f"replica prompt {i} "
            _, _, want = reference(tok.encode(p, add_special_tokens=False), 8)
            got = client.completions.create(model="debug", prompt=p, max_tokens=8, temperature=0)
            assert got.choices[0].text == want[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(40)
    assert rc in (0, -signal.SIGTERM), Path(log.name).read_text()[-3000:]
    time.sleep(1)
    assert not [p for p in pids if running(p)], "processes left after SIGTERM"
    assert "Traceback" not in Path(log.name).read_text()
