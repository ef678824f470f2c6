"""Per-request sampling parameters, the engine's outputs, and the sampler.

Every sequence samples from its own logits row with its own `torch.Generator` (seeded from the
request's seed, plus the sample's index for n > 1), so a seeded sample depends on its request
alone, not on what else shares the batch or on when it was scheduled: a sequence draws exactly one
uniform per token and takes the token where the filtered distribution's CDF passes it. Filtering:
temperature, then top-k and top-p (posttrain.core.model.generate's filter_logits), then min-p (drop tokens
whose probability is under min_p times the most likely one's), batched over the step's rows that
share those settings (`sample_rows`). Log-probabilities are of the raw (temperature 1, unfiltered) distribution, as in
posttrain.core.model.generate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from posttrain.core.model.generate import filter_logits


@dataclass
class RequestParams:
    """What one request asks for (the engine's SamplingParams)."""

    max_tokens: int = 64
    temperature: float = 1.0
    """0 means greedy."""
    top_k: int = 0
    """Keep the k most likely tokens (0: all)."""
    top_p: float = 1.0
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely token (0: off)."""
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    """Stop strings: the sequence ends once its decoded text contains one (needs the engine's
    `decode`). The tokens up to and including the one that completed the string are kept."""
    seed: int | None = None
    n: int = 1
    """Samples of the prompt; they share the prompt's KV blocks."""
    logprobs: bool = True
    """Record the log-probability of each chosen token."""
    top_logprobs: int = 0
    """Also record the k most likely tokens' log-probabilities at each step."""
    adapter: str | None = None
    """The LoRA adapter this request decodes with (requests for different adapters share a batch,
    each token routed to its own; posttrain.core.lora.route_adapters). None: the model as it is, or, in a
    step where another request names an adapter, the base alone."""

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_tokens < 1:
            raise ValueError(f"n ({self.n}) and max_tokens ({self.max_tokens}) must be at least 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p <= 1:
            raise ValueError("need temperature >= 0, 0 < top_p <= 1, 0 <= min_p <= 1")
        self.stop_token_ids, self.stop = tuple(self.stop_token_ids), tuple(self.stop)


@dataclass
class Completion:
    """One sample of a request (the fields of posttrain.core.model.generate.Generation, and more)."""

    tokens: list[int]
    """New tokens, the stop token included when one ended the sequence."""
    finish_reason: str
    """"stop" (a stop token or string) or "length" (max_tokens)."""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    index: int = 0
    """Which of the request's n samples."""


@dataclass
class RequestOutput:
    request_id: int
    prompt: list[int]
    completions: list[Completion]
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (not computed)."""


def make_generator(params: RequestParams, index: int, device: torch.device) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed + index)
    return g


def sample_rows(logits: torch.Tensor, picks: list) -> list[int]:
    """The next token of each (sequence, logits row) in `picks`, from (R, V) fp32 logits: greedy
    rows by one argmax; sampled rows batched by their filters (temperature, top-k, top-p, min-p:
    one filter and softmax for all rows that share them), each row's token then drawn by inverse
    CDF from one uniform of its own generator, so a sample depends only on its seed and logits."""
    if not picks:
        return []
    tokens = [0] * len(picks)
    greedy: list[int] = []
    groups: dict[tuple, list[int]] = {}
    for i, (seq, _) in enumerate(picks):
        p = seq.request.params
        if p.temperature > 0:
            groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p), []).append(i)
        else:
            greedy.append(i)
    if greedy:  # one argmax and one host transfer for the greedy rows
        rows = torch.tensor([picks[i][1] for i in greedy], device=logits.device)
        for i, t in zip(greedy, logits[rows].argmax(-1).tolist()):
            tokens[i] = t
    for (temperature, top_k, top_p, min_p), members in groups.items():
        rows = [picks[i][1] for i in members]
        mine = logits if rows == list(range(logits.shape[0])) else logits[torch.tensor(rows, device=logits.device)]
        probs = filter_logits(mine, temperature, top_k, top_p).softmax(-1)
        if min_p > 0:
            probs = probs.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, 0.0)
        u = torch.stack([torch.rand((), generator=picks[i][0].generator, device=logits.device) for i in members])
        for i, t in zip(members, inverse_cdf(probs, u).tolist()):
            tokens[i] = t
    return tokens


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of probs (R, V), the first token whose cumulative probability passes u (R,) in
    [0, 1) times the row's total. That is a kept token: a zero-probability token adds nothing to
    the sum, so it is never the first to pass. Where u * total rounds up to the total, the row
    takes its last kept token.

    Two levels, so no (R, V) cumulative sum is made (a sequential scan, the slowest part of
    sampling a large vocabulary): the sums of blocks of 256 tokens (fewer where that divides the
    vocabulary and 256 does not, so the rows need no padded copy), their cumulative sum over the
    blocks to find the block where the target falls, then the cumulative sum within that block
    alone. Rounding can put the target past a block's inner total although the block sums said
    it falls there; the block's last kept token is taken then."""
    R, V = probs.shape
    chunk = next((c for c in (256, 128, 64) if V % c == 0), 256)
    nb = -(-V // chunk)
    blocks = (probs if V % chunk == 0 else F.pad(probs, (0, nb * chunk - V))).view(R, nb, chunk)
    sums = blocks.sum(-1)
    cdf = sums.cumsum(-1)
    target = u * cdf[:, -1]
    b = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    over = b >= nb
    if bool(over.any()):
        b[over] = nb - 1 - (sums[over] > 0).flip(-1).int().argmax(-1)
    rows = torch.arange(R, device=probs.device)
    block = blocks[rows, b]  # (R, chunk)
    before = torch.where(b > 0, cdf[rows, (b - 1).clamp(min=0)], torch.zeros_like(target))
    t = torch.searchsorted(before[:, None] + block.cumsum(-1), target[:, None], right=True).squeeze(-1)
    past = t >= chunk
    if bool(past.any()):
        t[past] = chunk - 1 - (block[past] > 0).flip(-1).int().argmax(-1)
    return b * chunk + t


def token_logprobs(logp: torch.Tensor, token: int, top: int) -> tuple[float, dict[int, float]]:
    """The raw log-probability of `token` and the `top` most likely tokens' (by id), from a (V,)
    row of log-probabilities (temperature 1)."""
    tops: dict[int, float] = {}
    if top:
        values, ids = logp.topk(min(top, logp.shape[-1]))
        tops = dict(zip(ids.tolist(), values.tolist()))
    return float(logp[token]), tops


def hits_stop_string(tokens: list[int], stops: tuple[str, ...], decode: Callable[[list[int]], str] | None,
                     window: int = 0) -> bool:
    """Whether the decoded text of the last tokens contains a stop string. `window` tokens at most
    are decoded (0: all): enough to hold the longest stop string plus the new token."""
    if not stops or decode is None:
        return False
    text = decode(tokens[-window:] if window else tokens)
    return any(s in text for s in stops)
