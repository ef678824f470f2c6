"""Build and run a server: a model (with its LoRA adapters loaded under their names), a
tokenizer, one EngineWorker, the app, uvicorn on 127.0.0.1 by default."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.generation import Engine
from stages.serving.app import ServerState, build_app
from stages.serving.protocol import MAX_N, Limits
from stages.serving.worker import EngineWorker

log = logging.getLogger(__name__)


def parse_adapters(spec: str | None) -> dict[str, Path]:
    """'a=path,b=path' -> {name: path}."""
    out: dict[str, Path] = {}
    for item in filter(None, (s.strip() for s in (spec or "").split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--adapters: {item!r} is not NAME=PATH")
        if name in out:
            raise ValueError(f"--adapters: adapter {name!r} given twice")
        out[name] = Path(path)
    return out


def load_adapters(model: torch.nn.Module, adapters: dict[str, Path]) -> list[str]:
    """Each saved (PEFT-format) adapter onto the one base under its name; afterwards no adapter is
    active, so requests that name none get the base model."""
    from core.lora.model import lora_modules
    from registry.adapters import load_adapter

    for name, path in adapters.items():
        load_adapter(model, path, name)
    for _, mod in lora_modules(model):
        mod.active_adapter = None
    return list(adapters)


@dataclass
class EngineSettings:
    max_num_seqs: int = 16
    block_size: int = 16
    num_blocks: int | None = None
    max_batch_tokens: int = 1024


def make_state(model, tokenizer, model_id: str, adapters: list[str], api_key: str | None = None,
               max_queue: int = 64, engine: EngineSettings | None = None) -> ServerState:
    """The server's state, its engine thread started (stop it with state.worker.stop())."""
    engine = engine or EngineSettings()
    if model_id in adapters:
        raise ValueError(f"adapter name {model_id!r} is the base model's id")
    model = model.eval()
    vocab = model.args.vocab_size
    if tokenizer.vocab_size > vocab:
        log.warning("the tokenizer has %d ids, the model %d: ids past the model's are refused",
                    tokenizer.vocab_size, vocab)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731

    def make_engine() -> Engine:
        return Engine(model, max_num_seqs=engine.max_num_seqs, block_size=engine.block_size,
                      num_blocks=engine.num_blocks, max_batch_tokens=engine.max_batch_tokens, decode=decode)

    worker = EngineWorker(make_engine).start()
    limits = Limits(vocab_size=vocab, context=model.args.max_position_embeddings,
                    max_n=min(MAX_N, engine.max_num_seqs))
    return ServerState(model_id, list(adapters), tokenizer, worker, limits, api_key=api_key, max_queue=max_queue,
                       stop_token_ids=tuple(sorted(tokenizer.eos_ids)))


def serve(state: ServerState, host: str = "127.0.0.1", port: int = 8000, sock: socket.socket | None = None,
          log_level: str = "info") -> Any:
    """Run uvicorn until it is told to stop; the engine thread stops with it."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(build_app(state), host=host, port=port, log_level=log_level,
                                           access_log=False, lifespan="off"))
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        state.worker.stop()
    return server
