"""One serving replica over K processes, a "replica group": the model split by tensor parallelism
(`serve-model --tp K`) or its MoE experts spread by expert parallelism (`serve-model --ep K`).
The launcher, the messages and the lockstep below are the same for both; only how each rank
splits its copy of the model differs (`LAYOUTS`):

    tp  every linear layer split by the TP plan (posttrain.core.parallel.plans, no sequence parallelism);
        MoE blocks token-sharded with their experts replicated.
    ep  each MoE layer keeps E/K of its experts (posttrain.core.parallel.expert.apply_serving_expert_parallel);
        attention, dense MLPs, embeddings, router and shared experts stay whole on every rank.
        All ranks hold the same tokens, so each runs its experts' (token, slot) pairs and one
        all-reduce per MoE layer sums the outputs. Needs an MoE model and K dividing its experts.

Rank 0 is the server: the HTTP app, the EngineWorker's scheduling, and an Engine over its part
of the model. Ranks 1..K-1, the followers, hold the other parts and identical Engines. Every
engine step is collective (the split layers all-reduce and all-gather inside the model call), so
every rank must add the same requests in the same order and step together. The engine is
deterministic given that: the logits are gathered (tp) or whole (ep), so greedy and seeded tokens
are the same on every rank, and so are the stop checks and finishes each rank makes itself. Rank 0
sends, once per loop of its engine thread, one message to the followers:

    {"ops": [{"add": {"prompt": [token ids], "params": {RequestParams' fields}}}
             | {"abort": request id}, ...], "step": true|false}
    {"stop": true}

as JSON bytes in a uint8 tensor (its length first), broadcast over a gloo group of the ranks: no
pickle. The ops are what rank 0 did to its engine since the last message, in its order: requests
added, and requests aborted because their client went away (EngineWorker.cancel); the request
ids agree on every rank because every engine numbers its requests in the order they are added.
A request that asks to sample (temperature > 0) without a seed gets one from rank 0, so that
every rank draws the same token.

Idle, rank 0 sends an empty message every HEARTBEAT_S: the followers' receives never time out,
and rank 0 notices within that time when a follower has exited. A failed collective or a dead
follower is fatal to the replica: its requests fail with a clean 500, the server stops and the
process exits 1. SIGTERM on rank 0 stops the server, which sends "stop": the followers leave
their loops and exit 0. Followers ignore SIGINT (a terminal's Ctrl-C reaches every process of the
group) and get SIGTERM when rank 0 dies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import multiprocessing as mp
import os
import queue
import random
import signal
import sys
import threading
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from posttrain.core.generation import Engine, RequestParams
from posttrain.stages.serving.worker import EngineWorker

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
TIMEOUT_S = 120.0
"""Collective timeout of the replica's groups: the longest a rank waits for the others."""


# ------------------------------------------------------------------ layouts


def _split_tp(model, mesh) -> str | None:
    from posttrain.core.parallel.plans import apply_plan, transformer_tp_plan

    apply_plan(model, transformer_tp_plan(model.args, sequence_parallel=False), mesh["tp"])
    return None


def _split_ep(model, mesh) -> str | None:
    from posttrain.core.parallel.expert import apply_serving_expert_parallel

    held = apply_serving_expert_parallel(model, mesh["ep"])
    first, n = held[0]  # the same experts in every MoE layer
    return f"holds experts {first}..{first + n - 1} of {model.args.moe.num_experts} in each of {len(held)} MoE layers"


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a replica group splits the model: its flag, its name in messages, the core's parallel
    config for K ranks (what validates the model and builds the mesh), and the split itself, run
    on every rank's whole model (returns what this rank holds, for the log, or None)."""

    flag: str
    name: str
    config: Callable[[int], dict]
    split: Callable[[object, object], str | None]


LAYOUTS = {
    "tp": Layout("tp", "tensor-parallel", lambda k: {"tp": k}, _split_tp),
    # The core's EP layout carves ep out of the ranks that would shard the other weights (dp_shard);
    # nothing shards them here (no FSDP), so they stay whole on every rank.
    "ep": Layout("ep", "expert-parallel", lambda k: {"dp_shard": k, "ep": k}, _split_ep),
}


# ------------------------------------------------------------------ checks, before anything starts


def check_group(model_ref: str, layout: str, k: int, device: str, replicas: int = 1) -> None:
    """ValueError unless `model_ref` can be split by `layout` ("tp" or "ep") over `k` ranks on
    `device`, `replicas` times (reads only its config)."""
    from posttrain.core.model.config import ModelConfig
    from posttrain.core.parallel.config import ParallelConfig
    from posttrain.core.parallel.mesh import ParallelDims
    from posttrain.stages.common import load_model

    flag = f"--{LAYOUTS[layout].flag}"
    if k < 1:
        raise ValueError(f"{flag} must be at least 1, not {k}")
    if device.startswith("cuda"):
        first, need = _cuda_index(device), k * replicas
        count = torch.cuda.device_count()
        if first + need > count:
            raise ValueError(f"{flag} {k} x {replicas} replica(s) on {device} needs GPUs {first}..{first + need - 1}; "
                             f"{count} visible")
    elif device != "cpu":
        raise ValueError(f"{flag} runs on cpu or cuda, not {device!r}")
    model, _ = load_model(ModelConfig(name_or_path=model_ref), torch.device("cpu"), meta=True)
    if layout == "ep" and model.args.moe is None:
        raise ValueError(f"--ep {k}: the model is dense (no experts); expert parallelism needs an MoE model "
                         "(use --tp to split a dense one)")
    try:
        ParallelDims.from_config(ParallelConfig(**LAYOUTS[layout].config(k)), k, model.args)
    except ValueError as e:
        raise ValueError(f"{flag} {k}: {e}") from None


def _cuda_index(device: str) -> int:
    return torch.device(device).index or 0


def rank_device(device: str, rank: int) -> str:
    """Rank r of a replica on cuda:B runs on cuda:B+r (replicas side by side take disjoint GPUs)."""
    return f"cuda:{_cuda_index(device) + rank}" if device.startswith("cuda") else "cpu"


# ------------------------------------------------------------------ the messages


class Channel:
    """Rank 0 -> every rank of `group`: one JSON object per call, in a uint8 tensor."""

    def __init__(self, group: dist.ProcessGroup, src: int = 0):
        self.group, self.src = group, src

    def send(self, msg: dict) -> None:
        data = torch.frombuffer(bytearray(json.dumps(msg).encode()), dtype=torch.uint8)
        dist.broadcast(torch.tensor([data.numel()], dtype=torch.int64), self.src, group=self.group)
        dist.broadcast(data, self.src, group=self.group)

    def recv(self) -> dict:
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, self.src, group=self.group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, self.src, group=self.group)
        return json.loads(data.numpy().tobytes())


def encode_params(params: RequestParams) -> dict:
    return dataclasses.asdict(params)


def decode_params(d: dict) -> RequestParams:
    return RequestParams(**{**d, "stop_token_ids": tuple(d["stop_token_ids"]), "stop": tuple(d["stop"])})


# ------------------------------------------------------------------ rank 0: the worker


class GroupEngineWorker(EngineWorker):
    """EngineWorker on rank 0 of a replica group: before each step it tells the followers what it
    admitted; any failure of the group is fatal (`fatal`, `on_fatal`) instead of a fresh engine
    (the other ranks' engines would not start over with it). `what` names the group in messages."""

    def __init__(self, make_engine: Callable[[], Engine], channel: Channel,
                 peers_alive: Callable[[], bool] = lambda: True, name: str = "engine-group",
                 what: str = "tensor-parallel"):
        super().__init__(make_engine, name)
        self.channel, self.peers_alive, self.what = channel, peers_alive, what
        self._ops: list[dict] = []  # what this engine was told since the last message, in order
        self._lock = threading.Lock()  # submit vs. _fail: nothing is queued after the last drain

    def submit(self, prompt, params, sink) -> None:
        with self._lock:
            if self.fatal is None:
                self.inbox.put((prompt, params, sink))
                return
        sink.error(self.fatal)

    def _admit(self, item) -> int | None:
        prompt, params, _ = item
        if params.temperature > 0 and params.seed is None:
            params.seed = random.getrandbits(62)  # every rank must draw the same tokens
        rid = super()._admit(item)
        if rid is not None:  # refused ones (the engine's ValueError) are refused on rank 0 alone
            self._ops.append({"add": {"prompt": list(prompt), "params": encode_params(params)}})
        return rid

    def _cancel(self, sink) -> int | None:
        rid = super()._cancel(sink)
        if rid is not None:
            self._ops.append({"abort": rid})
        return rid

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(0 if self.engine.has_unfinished() else HEARTBEAT_S)
                if self._stop.is_set():
                    break
                if not self.peers_alive():
                    raise RuntimeError(f"a follower rank of the {self.what} group exited")
                ops, self._ops = self._ops, []
                step = self.engine.has_unfinished()
                self.channel.send({"ops": ops, "step": step})
                if step:
                    self._step()
            self.channel.send({"stop": True})
        except Exception as e:  # noqa: BLE001 - the group is broken: fail everything, stop the server
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        log.error("%s replica failed (%s: %s); failing %d requests and stopping",
                  self.what, type(e).__name__, e, len(self.sinks))
        err = RuntimeError(f"the {self.what} group failed ({type(e).__name__}: {e}); the server is stopping")
        with self._lock:
            self.fatal = err
        sinks, self.sinks = self.sinks, {}
        for sink in sinks.values():
            self._call(sink.error, err)
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, tuple):  # a request (not a cancel, not the stop's wake-up)
                self._call(item[2].error, err)
        if self.on_fatal is not None:
            self._call(lambda _: self.on_fatal(), None)


# ------------------------------------------------------------------ every rank: group, model, engine


def _join(rank: int, world: int, master_port: int, device: str, layout: str) -> tuple[object, dist.ProcessGroup]:
    """Join the replica's process group (gloo on CPU, NCCL on CUDA); its mesh (the layout's) and a
    gloo group of the same ranks for the messages."""
    from posttrain.core.parallel.config import ParallelConfig
    from posttrain.core.parallel.mesh import init_distributed

    local = _cuda_index(device) + rank if device.startswith("cuda") else rank
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(master_port))
    cfg = ParallelConfig(**LAYOUTS[layout].config(world), device="cuda" if device.startswith("cuda") else "cpu")
    mesh, _ = init_distributed(cfg, timeout_s=TIMEOUT_S)
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    return mesh, control


def _load_split(spec: dict, rank: int, mesh) -> tuple[object, object, list[str]]:
    """This rank's model (whole, with its adapters, then split by the layout) and tokenizer."""
    from posttrain.stages.serving.server import load_served

    adapters = {name: Path(p) for name, p in spec["adapters"].items()}
    model, tok, names = load_served(spec["model"], spec["tokenizer"], adapters,
                                    torch.device(rank_device(spec["device"], rank)), spec.get("shown_as"))
    layout = LAYOUTS[spec["layout"]]
    held = layout.split(model, mesh)
    if held:
        print(f"serve-model: {layout.name} rank {rank} {held}", file=sys.stderr, flush=True)
    return model.eval(), tok, names


def _engine_settings(spec: dict):
    from posttrain.stages.serving.server import EngineSettings

    return EngineSettings(**spec["engine"])


def follow(engine: Engine, channel: Channel) -> None:
    """A follower's loop: apply rank 0's messages to `engine` until it says stop."""
    while True:
        msg = channel.recv()
        if msg.get("stop"):
            return
        for op in msg["ops"]:
            if "add" in op:
                engine.add_request(op["add"]["prompt"], decode_params(op["add"]["params"]))
            else:
                engine.abort(op["abort"])
        if msg["step"]:
            engine.step()


def _follower(rank: int, world: int, master_port: int, spec: dict) -> None:
    """A follower process: join, load, wait for rank 0 at the barrier, then follow. Exit 1, with
    one line on stderr, on any failure."""
    from posttrain.stages.serving.frontend import _die_with_parent
    from posttrain.stages.serving.server import engine_factory

    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    code = 0
    try:
        mesh, control = _join(rank, world, master_port, spec["device"], spec["layout"])
        model, tok, _ = _load_split(spec, rank, mesh)
        engine = engine_factory(model, tok, _engine_settings(spec))()
        dist.barrier(group=control)
        follow(engine, Channel(control))
    except Exception as e:  # noqa: BLE001 - one line, not a traceback per rank
        print(f"serve-model: {LAYOUTS[spec['layout']].name} rank {rank} stopped: {type(e).__name__}: {e}",
              file=sys.stderr)
        code = 1
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    sys.exit(code)


# ------------------------------------------------------------------ rank 0: the whole replica


def serve_group(spec: dict, k: int, model_id: str, host: str, port: int, api_key: str | None,
                max_queue: int) -> int:
    """Start the k-1 followers, become rank 0, serve until SIGTERM (0) or a failure of the group (1).

    spec: {"layout": "tp" | "ep", "model": ref, "tokenizer": dir | None, "adapters": {name: dir},
    "device": "cpu" | "cuda[:B]", "engine": EngineSettings' fields, "shown_as": name in messages}.
    Loading errors raise (the CLI prints them) after the followers are stopped."""
    from posttrain.core.parallel.mesh import _free_port
    from posttrain.stages.serving.server import make_state, serve

    master_port = _free_port()
    ctx = mp.get_context("spawn" if spec["device"].startswith("cuda") else "fork")
    layout = LAYOUTS[spec["layout"]]
    procs = [ctx.Process(target=_follower, args=(r, k, master_port, spec), name=f"{layout.flag}-rank{r}",
                         daemon=True) for r in range(1, k)]
    for p in procs:
        p.start()
    served = False
    try:
        torch.set_num_threads(max(1, torch.get_num_threads() // k))
        mesh, control = _join(0, k, master_port, spec["device"], spec["layout"])
        model, tok, names = _load_split(spec, 0, mesh)
        dist.barrier(group=control)  # every follower loaded and built its engine
        channel = Channel(control)
        alive = lambda: all(p.is_alive() for p in procs)  # noqa: E731
        state = make_state(model, tok, model_id, names, api_key=api_key, max_queue=max_queue,
                           engine=_engine_settings(spec),
                           make_worker=lambda make_engine: GroupEngineWorker(make_engine, channel, alive,
                                                                             what=layout.name))
        print(f"serve-model: {layout.name} replica of {k} ranks ready", file=sys.stderr)
        served = True
        # uvicorn re-raises the SIGTERM / SIGINT it stopped on once it is done; with the default
        # handler that would kill this process inside serve(), before the worker tells the
        # followers to stop. A handler of ours takes that re-raise, and we exit 0.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        serve(state, host=host, port=port)
        if state.worker.fatal is not None:
            print(f"serve-model: {state.worker.fatal}", file=sys.stderr)
            return 1
        return 0
    finally:
        for p in procs:
            p.join(timeout=10 if served else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
