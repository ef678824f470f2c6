"""Serving under load: `posttrain serve-model` (one or more replicas, optionally tensor-parallel)
driven over loopback by the official `openai` client, beside transformers' `generate` called once
per request (what a hand-rolled server does), on the same checkpoint and prompts.

    python -m posttrain.benchmarks.serve [--models debug] [--layouts r1 r2] [--concurrency 1 8 32]
                               [--requests 32] [--max-tokens 16] [--out file.json]
    posttrain bench serve [...]

Model: a posttrain.core.model preset with random weights (seed 0, initializer_range 0.2), saved as an HF
checkpoint with the byte tokenizer sized to its vocabulary. Prompts: seeded random lowercase text
of 40-200 characters, distinct per request. Greedy decoding, stopping at the tokenizer's EOS or
`max_tokens`: both sides produce the same tokens (greedy parity), so the same work.

Layouts: `rR` is R replicas behind the front end, `rRtpK` R replicas of K tensor-parallel ranks
each. Each layout is one server process tree started as a user starts it; the threads of this
machine's cores are split between the replicas (OMP_NUM_THREADS = cores // (R x K), at least 1).

Per case (layout x concurrency C): C client threads send `requests` streamed completions in all,
each thread one request at a time. Figures: tokens_per_s (completion tokens / wall seconds),
requests_per_s, latency p50/p99 (request sent -> last byte) and time to first token p50/p99 (request
sent -> first streamed chunk with text), failed (requests that raised). The baseline runs the same
requests from C threads against one in-process transformers model, one `generate` at a time (a
lock: the model serves one request at a time), latency including the wait for the lock; its time
to first token is its latency (`generate` returns the whole completion). speedup = the server's
tokens/s over the baseline's at the same C. Run it alone on the machine: it times things.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from posttrain.benchmarks import emit

KEY = "bench-key"
LAYOUT = re.compile(r"^r(\d+)(?:tp(\d+))?$")


def parse_layout(text: str) -> tuple[int, int]:
    """`r2` -> (2 replicas, tp 1); `r1tp2` -> (1, 2)."""
    m = LAYOUT.match(text)
    if not m or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
        raise argparse.ArgumentTypeError(f"layout {text!r}: expected rR or rRtpK with R, K >= 1 (e.g. r2, r1tp2)")
    return int(m.group(1)), int(m.group(2) or 1)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"{i} " + "".join(rng.choice(string.ascii_lowercase + "  ") for _ in range(rng.randint(40, 200)))
            for i in range(n)]


def make_checkpoint(preset: str, root: Path) -> Path:
    from posttrain.core.model import build_model, get_preset
    from posttrain.registry.byte_tokenizer import byte_tokenizer
    from posttrain.registry.hf import save_pretrained

    cfg = get_preset(preset, initializer_range=0.2)
    path = root / preset
    save_pretrained(build_model(cfg, seed=0), path)
    byte_tokenizer(cfg.vocab_size).save_pretrained(path)
    return path


def summarize(latency: list[float], ttft: list[float], tokens: int, wall: float, failed: int) -> dict:
    return {"requests": len(latency) + failed, "failed": failed, "completion_tokens": tokens,
            "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2) if wall else 0.0,
            "requests_per_s": round(len(latency) / wall, 3) if wall else 0.0,
            "latency_p50_s": round(percentile(latency, 50), 4), "latency_p99_s": round(percentile(latency, 99), 4),
            "ttft_p50_s": round(percentile(ttft, 50), 4), "ttft_p99_s": round(percentile(ttft, 99), 4)}


def drive(send, texts: list[str], concurrency: int) -> dict:
    """Send every text through `send(text) -> (completion tokens, ttft s)` from `concurrency`
    threads, one request at a time each; the case's figures."""
    latency, ttft, tokens, failed = [], [], [0], [0]
    lock = threading.Lock()

    def one(text: str) -> None:
        t0 = time.perf_counter()
        try:
            n, first = send(text)
        except Exception as e:  # counted, and the first few shown: a failure is a figure here
            with lock:
                failed[0] += 1
                if failed[0] <= 3:
                    print(f"serve bench: request failed: {e!r}", file=sys.stderr)
            return
        with lock:
            latency.append(time.perf_counter() - t0)
            ttft.append(first)
            tokens[0] += n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, texts))
    return summarize(latency, ttft, tokens[0], time.perf_counter() - t0, failed[0])


class Served:
    """`posttrain serve-model CKPT --replicas R [--tp K]` on a free loopback port, until closed."""

    def __init__(self, checkpoint: Path, replicas: int, tp: int, log: Path, max_num_seqs: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        threads = max(1, (os.cpu_count() or 1) // (replicas * tp))
        env = {**os.environ, "POSTTRAIN_API_KEY": KEY, "OMP_NUM_THREADS": str(threads)}
        cmd = [sys.executable, "-m", "posttrain.flows.cli", "serve-model", str(checkpoint), "--port", str(self.port),
               "--served-model-name", "bench", "--max-queue", "1024", "--max-num-seqs", str(max_num_seqs)]
        if replicas > 1:
            cmd += ["--replicas", str(replicas)]
        if tp > 1:
            cmd += ["--tp", str(tp)]
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait_ready(300)

    def _wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve-model exited with {self.proc.returncode}; see {self.log.name}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=2)
                body = r.json() if r.status_code == 200 else {}
                if r.status_code == 200 and all(x.get("state") == "ready" for x in body.get("replicas", [])):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"serve-model did not become ready in {timeout:.0f} s; see {self.log.name}")

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def server_sender(url: str, max_tokens: int):
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=600)

    def send(text: str) -> tuple[int, float]:
        t0 = time.perf_counter()
        first, tokens = None, 0
        stream = client.completions.create(model="bench", prompt=text, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text and first is None:
                first = time.perf_counter() - t0
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens, first if first is not None else time.perf_counter() - t0

    return send


def transformers_sender(checkpoint: Path, max_tokens: int):
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.registry.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32, attn_implementation="sdpa").eval()
    eos = list(tok.eos_ids)
    lock = threading.Lock()

    def send(text: str) -> tuple[int, float]:
        t0 = time.perf_counter()
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])  # as the server encodes a prompt
        with lock, torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0])
        new = out[0, ids.shape[1]:].tolist()
        n = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        return n, time.perf_counter() - t0

    return send


def run(models: list[str], layouts: list[tuple[int, int]], concurrency: list[int], requests: int,
        max_tokens: int, max_num_seqs: int) -> dict:
    import torch

    doc = {"benchmark": "serve", "cpu_count": os.cpu_count(), "torch": torch.__version__,
           "max_tokens": max_tokens, "requests_per_case": requests, "models": {}}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        root = Path(tmp)
        for preset in models:
            ckpt = make_checkpoint(preset, root)
            texts = prompts(requests)
            warm = prompts(4, seed=1)
            cases: dict[str, dict] = {}
            hf = transformers_sender(ckpt, max_tokens)
            drive(hf, warm, 1)
            for c in concurrency:
                cases[f"transformers_c{c}"] = drive(hf, texts, c)
            del hf
            for replicas, tp in layouts:
                name = f"r{replicas}" + (f"tp{tp}" if tp > 1 else "")
                t0 = time.perf_counter()
                server = Served(ckpt, replicas, tp, root / f"{preset}-{name}.log", max_num_seqs)
                start = time.perf_counter() - t0
                try:
                    send = server_sender(server.url, max_tokens)
                    drive(send, warm, 1)
                    for c in concurrency:
                        case = drive(send, texts, c)
                        case["start_s"] = round(start, 2)
                        base = cases[f"transformers_c{c}"]["tokens_per_s"]
                        case["speedup_vs_transformers"] = round(case["tokens_per_s"] / base, 3) if base else None
                        cases[f"{name}_c{c}"] = case
                finally:
                    server.close()
            doc["models"][preset] = {"cases": cases}
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="posttrain bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["debug"])
    p.add_argument("--layouts", nargs="+", type=parse_layout, default=[(1, 1), (2, 1)])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=32, help="requests per case")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32, help="each replica's running batch")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if min(args.concurrency) < 1 or args.requests < 1 or args.max_tokens < 1:
        p.error("--concurrency, --requests and --max-tokens must be >= 1")
    return emit(run(args.models, args.layouts, args.concurrency, args.requests, args.max_tokens,
                    args.max_num_seqs), args.out)


if __name__ == "__main__":
    sys.exit(main())
