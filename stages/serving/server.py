"""Build and run a server: a model (with its LoRA adapters loaded under their names), a
tokenizer, one EngineWorker, the app, uvicorn on 127.0.0.1 by default."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from posttrain.core.generation import Engine
from posttrain.stages.serving.app import ServerState, build_app
from posttrain.stages.serving.protocol import MAX_N, Limits
from posttrain.stages.serving.worker import EngineWorker

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
    from posttrain.core.lora.model import lora_modules
    from posttrain.registry.adapters import load_adapter

    for name, path in adapters.items():
        load_adapter(model, path, name)
    for _, mod in lora_modules(model):
        mod.active_adapter = None
    return list(adapters)


def load_served(model_ref: str, tokenizer_dir: str | None, adapters: dict[str, Path], device: torch.device,
                shown_as: str | None = None) -> tuple[Any, Any, list[str]]:
    """(model, tokenizer, adapter names) for serve-model: the model on `device` with its adapters
    loaded; a preset without --tokenizer gets the built-in byte-level ChatML tokenizer.
    StageError / CheckpointError when something cannot be loaded."""
    from posttrain.core.model.config import ModelConfig
    from posttrain.stages.common import StageError, load_model, load_tokenizer, resolve_model_dir

    is_preset = resolve_model_dir(model_ref)[0] is None
    model, _ = load_model(ModelConfig(name_or_path=model_ref), device)
    if tokenizer_dir is None and is_preset:
        from posttrain.registry.byte_tokenizer import byte_tokenizer

        try:
            tok = byte_tokenizer(model.args.vocab_size)
        except ValueError as e:
            raise StageError(f"preset {shown_as or model_ref!r}: {e}; pass --tokenizer DIR") from None
    else:
        tok = load_tokenizer(tokenizer_dir, model_ref)
    return model, tok, load_adapters(model, adapters)


@dataclass
class EngineSettings:
    max_num_seqs: int = 16
    block_size: int = 16
    num_blocks: int | None = None
    max_batch_tokens: int = 1024


def engine_factory(model, tokenizer, engine: EngineSettings) -> Callable[[], Engine]:
    """A fresh Engine over `model` per call (the same settings every time: the ranks of a
    tensor-parallel replica build theirs with this too)."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731

    def make_engine() -> Engine:
        return Engine(model, max_num_seqs=engine.max_num_seqs, block_size=engine.block_size,
                      num_blocks=engine.num_blocks, max_batch_tokens=engine.max_batch_tokens, decode=decode)

    return make_engine


def make_state(model, tokenizer, model_id: str, adapters: list[str], api_key: str | None = None,
               max_queue: int = 64, engine: EngineSettings | None = None,
               make_worker: Callable[[Callable[[], Engine]], EngineWorker] = EngineWorker) -> ServerState:
    """The server's state, its engine thread started (stop it with state.worker.stop()).
    make_worker: engine factory -> the worker (posttrain.stages.serving.tp's for a tensor-parallel replica)."""
    engine = engine or EngineSettings()
    if model_id in adapters:
        raise ValueError(f"adapter name {model_id!r} is the base model's id")
    model = model.eval()
    vocab = model.args.vocab_size
    if tokenizer.vocab_size > vocab:
        log.warning("the tokenizer has %d ids, the model %d: ids past the model's are refused",
                    tokenizer.vocab_size, vocab)
    worker = make_worker(engine_factory(model, tokenizer, engine)).start()
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
    state.worker.on_fatal = lambda: setattr(server, "should_exit", True)
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        state.worker.stop()
    return server
