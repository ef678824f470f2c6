"""Which replica gets a request: a pure policy over per-replica load, no I/O.

The load of a replica is its *outstanding tokens*: for every request the front end has in flight
on it, the prompt's estimated tokens plus `max_tokens * n`. `least-loaded` picks the live replica
with the least of it (ties: fewer requests in flight, then the lowest index). `prefix` hashes the
prompt's first `prefix_chars` characters to a home replica, so requests that share a prefix
(a system prompt, a few-shot header) land where their KV blocks may already be cached; it falls
back to least-loaded when the home replica is not live, has been excluded (it just failed this
request), or carries more than `imbalance` times the least load plus `slack` tokens.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

POLICIES = ("least-loaded", "prefix")


@dataclass
class Load:
    live: bool = False
    tokens: int = 0
    requests: int = 0


class Router:
    def __init__(self, num_replicas: int, policy: str = "least-loaded", prefix_chars: int = 64,
                 imbalance: float = 2.0, slack: int = 256):
        if num_replicas < 1:
            raise ValueError(f"need at least one replica, not {num_replicas}")
        if policy not in POLICIES:
            raise ValueError(f"routing policy {policy!r} is not one of {', '.join(POLICIES)}")
        if prefix_chars < 1:
            raise ValueError(f"prefix_chars must be at least 1, not {prefix_chars}")
        self.policy, self.prefix_chars = policy, prefix_chars
        self.imbalance, self.slack = imbalance, slack
        self.loads = [Load() for _ in range(num_replicas)]

    def set_live(self, replica: int, live: bool) -> None:
        self.loads[replica].live = live

    def home(self, key: str) -> int:
        """The replica a prompt prefix belongs to (a stable hash: the same in every process)."""
        return zlib.crc32(key[:self.prefix_chars].encode()) % len(self.loads)

    def choose(self, key: str = "", exclude: frozenset[int] | set[int] = frozenset()) -> int | None:
        """The replica for a request whose prompt starts with `key`; None when none is live."""
        live = [i for i, x in enumerate(self.loads) if x.live and i not in exclude]
        if not live:
            return None
        least = min(live, key=lambda i: (self.loads[i].tokens, self.loads[i].requests, i))
        if self.policy == "prefix" and key:
            home = self.home(key)
            if home in live and self.loads[home].tokens <= self.imbalance * self.loads[least].tokens + self.slack:
                return home
        return least

    def start(self, replica: int, cost: int) -> None:
        self.loads[replica].tokens += cost
        self.loads[replica].requests += 1

    def finish(self, replica: int, cost: int) -> None:
        self.loads[replica].tokens -= cost
        self.loads[replica].requests -= 1


def estimate_cost(body: dict) -> tuple[str, int]:
    """(routing key, outstanding-token estimate) of an OpenAI request body, without a tokenizer:
    the prompt text (a chat's messages concatenated), ~4 characters a token, plus max_tokens * n.
    Bodies the replica will refuse still get a cost; it is returned when they finish."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        key, tokens = " ".join(map(str, prompt)), len(prompt)
    else:
        if isinstance(body.get("messages"), list):
            parts = [m.get("content") for m in body["messages"] if isinstance(m, dict)]
            key = "\n".join(p if isinstance(p, str) else str(p) for p in parts)
        else:
            key = prompt if isinstance(prompt, str) else str(prompt or "")
        tokens = len(key) // 4 + 1
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    n = body.get("n", 1)
    max_tokens = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 16
    n = n if isinstance(n, int) and n > 0 else 1
    return key, tokens + max_tokens * n
