"""A stand-in replica process for the front end's fault tests (tests/stages/test_serving_replicas.py):
`python tests/support/fake_replica.py PORT MODE` serves /health and answers POSTs by MODE:

    ok     a completion body (streamed: two events and data: [DONE])
    full   429 with Retry-After: 3 (its queue is full)
    die    the process exits mid-request (before any answer; a stream after its first event)
    hang   never answers
    watch  answers only after 20 s, meanwhile watching its connection: GET /stats gives
           {"dropped": the requests whose caller closed the connection first}
    exit   exits at once, with status 3 (a model that does not load)
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT, MODE = int(sys.argv[1]), sys.argv[2]
if MODE == "exit":
    sys.exit(3)
DROPPED = [0]
EVENT = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake",
         "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}]}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/stats":
            self._json(200, {"dropped": DROPPED[0]})
        else:
            self._json(200, {"object": "list", "data": [{"id": "fake", "object": "model"}], "port": PORT})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        stream = body.get("stream") is True
        if MODE == "full":
            self._json(429, {"error": {"message": "full", "type": "rate_limit_error", "param": None,
                                       "code": "queue_full"}}, {"Retry-After": "3"})
        elif MODE == "hang":
            time.sleep(3600)
        elif MODE == "watch":
            deadline = time.time() + 20
            while time.time() < deadline:
                if select.select([self.connection], [], [], 0.05)[0] and \
                        not self.connection.recv(1, socket.MSG_PEEK):  # readable with nothing: closed
                    DROPPED[0] += 1
                    return
            self._json(200, {**EVENT, "port": PORT})
        elif MODE == "die" and not stream:
            os._exit(1)
        elif stream:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for event in (json.dumps(EVENT), "[DONE]"):
                data = f"data: {event}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
                if MODE == "die":
                    time.sleep(0.2)
                    os._exit(1)
            self.wfile.write(b"0\r\n\r\n")
        else:
            self._json(200, {**EVENT, "choices": [{**EVENT["choices"][0], "finish_reason": "length"}],
                             "port": PORT})


ThreadingHTTPServer.allow_reuse_address = True
ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
