"""A sample's text as its tokens arrive: stop strings cut it (OpenAI leaves the stop string out),
and a stream emits only text that cannot change any more, so the streamed pieces concatenate
to exactly the non-streaming text."""

from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"  # a decoder's stand-in for a UTF-8 sequence not complete yet


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """text up to the earliest stop string, and whether one was found."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def final_text(tokens: list[int], decode: Callable[[list[int]], str], stops: tuple[str, ...],
               engine_reason: str) -> tuple[str, str]:
    """(text, finish_reason) of a finished sample."""
    text, stopped = cut_at_stop(decode(tokens), stops)
    return text, "stop" if stopped else engine_reason


class TextStream:
    """One sample's streamed text: `push(token)` returns the new text safe to send."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...]):
        self.decode, self.stops = decode, stops
        self.tokens: list[int] = []
        self.sent = ""
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.tokens.append(token)
        text, self.stopped = cut_at_stop(self.decode(self.tokens), self.stops)
        if not self.stopped:
            text = text.rstrip(REPLACEMENT)
            # hold back a tail that may begin a stop string
            hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[:len(text) - hold]
        return self._advance(text)

    def finish(self, text: str) -> str:
        """The rest of the sample's final text."""
        return self._advance(text)

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent):], text
        return new
