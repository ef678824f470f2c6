"""The `posttrain` command line.

    posttrain run CONFIG.yaml [--set a.b=c ...]     the whole pipeline once (--dry-run: the plan only)
    posttrain stage NAME CONFIG.yaml [--set ...]    one stage (data_prep, sft, distill, dpo, grpo, evaluate)
    posttrain serve [CONFIG.yaml]                   Prefect deployments: on demand + cron retraining
    posttrain ui                                    prefect server + mlflow server on 127.0.0.1
    posttrain demo                                  the embedded default pipeline, end to end
    posttrain bench sft|kernels|adapters|weight_sync|generate|online|serve|optimizers|precision|qat|gpu|dpo|distill|all   benchmarks, JSON out
    posttrain config [CONFIG.yaml] [--set ...]      the resolved DAG and what is cached (--json, --convert OLD)
    posttrain generate MODEL "prompt" ...           sample from a preset, HF dir or stage output
    posttrain serve-model MODEL [--adapters a=DIR]  OpenAI-compatible server on 127.0.0.1 (docs/serving.md)
    posttrain serve-model MODEL --replicas N        N engine processes behind one front end, with failover
    posttrain serve-model MODEL --tp K              one replica split by tensor parallelism over K processes
    posttrain serve-model MOE_MODEL --ep K          one replica, its MoE experts spread over K processes
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from posttrain.flows.model_cli import add_data_parser, add_model_parser


def _add_config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("config", nargs=None if required else "?", help="YAML/JSON config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value by dotted path (repeatable)")


def _pipeline(args):
    from posttrain.core.config import load_config
    from posttrain.flows.config import PipelineConfig
    from posttrain.flows.demo import DEMO_CONFIG

    return load_config(PipelineConfig, args.config or DEMO_CONFIG, args.overrides)


def print_plan(cfg) -> None:
    """The resolved DAG: each node's kind, inputs, output dir and what a run would do with it."""
    from posttrain.flows.dag import PipelineDAG
    from posttrain.flows.pipeline import dry_run

    dag = PipelineDAG(cfg)
    rows = dry_run(dag)
    width = max(len(n) for n in rows)
    print(f"pipeline {cfg.name}: {len(rows)} nodes, {len(dag.edges)} edges (workspace {cfg.workspace})")
    for name, r in rows.items():
        ins = ", ".join(r["inputs"]) or "-"
        print(f"  {name:<{width}}  {r['kind']:<9}  {r['status']:<6}  <- {ins}   -> {r['output_dir']}")
    print("edges:")
    for e in dag.edges:
        print(f"  {e.src} -> {e.dst}  ({e.role}: {e.key})")


def cmd_config(args) -> int:
    from posttrain.core.config import dump_config

    if args.convert:
        from posttrain.flows.convert import convert_file

        print(convert_file(args.convert), end="")
        return 0
    cfg = _pipeline(args)
    if args.json:
        print(json.dumps(dump_config(cfg), indent=2))
    else:
        print_plan(cfg)
    return 0


def cmd_run(args) -> int:
    from posttrain.flows.pipeline import run_pipeline

    cfg = _pipeline(args)
    if args.dry_run:
        print_plan(cfg)
        return 0
    result = run_pipeline(cfg)
    return 0 if result.ok else 1


def cmd_demo(args) -> int:
    from posttrain.flows.demo import main

    return main(args.overrides)


def cmd_stage(args) -> int:
    from posttrain.core.config import ConfigError, load_config
    from posttrain.stages.config import STAGE_CONFIGS
    from posttrain.stages.launch import launch_stage

    if args.name not in STAGE_CONFIGS:
        print(f"unknown stage {args.name!r}; stages: {', '.join(STAGE_CONFIGS)}", file=sys.stderr)
        return 2
    from posttrain.core.tracking import TrackingConfig
    from posttrain.stages.launch.config import LauncherConfig

    from pydantic import ValidationError

    spec = load_config(STAGE_CONFIGS[args.name], args.config, args.overrides)
    try:  # filling in the defaults re-validates: e.g. a parallel layout the default launcher cannot hold
        spec.output_dir = spec.output_dir or str(Path("runs") / "manual" / args.name)
        spec.launcher = spec.launcher or LauncherConfig()
        spec.tracking = spec.tracking or TrackingConfig()
    except ValidationError as e:
        raise ConfigError("; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())) from None
    result = launch_stage(args.name, spec, spec.launcher, workdir=Path(spec.output_dir).parent / ".launch",
                          on_output=lambda line: print(line, end="" if line.endswith("\n") else "\n"))
    if result.returncode == 0 and result.manifest:
        print(json.dumps(result.manifest.get("metrics", {}), indent=2))
    return result.returncode


def cmd_serve(args) -> int:
    from posttrain.flows.deploy import serve

    serve(args.config, args.overrides)
    return 0


def cmd_ui(args) -> int:
    from posttrain.flows.ui import run_ui

    try:
        return run_ui(host=args.host, prefect_port=args.prefect_port, mlflow_port=args.mlflow_port,
                      backend_store=args.backend_store)
    except RuntimeError as e:  # a port taken, a server that did not come up: say so, no traceback
        print(f"posttrain ui: {e}", file=sys.stderr)
        return 1


def cmd_bench(args) -> int:
    import subprocess

    modules = {"sft": "posttrain.benchmarks.sft", "kernels": "posttrain.benchmarks.kernels", "adapters": "posttrain.benchmarks.adapters",
               "weight_sync": "posttrain.benchmarks.weight_sync", "generate": "posttrain.benchmarks.generate", "online": "posttrain.benchmarks.online",
               "serve": "posttrain.benchmarks.serve", "optimizers": "posttrain.benchmarks.optimizers", "precision": "posttrain.benchmarks.precision",
               "qat": "posttrain.benchmarks.qat", "gpu": "posttrain.benchmarks.gpu", "dpo": "posttrain.benchmarks.dpo",
               "distill": "posttrain.benchmarks.distill", "qlora": "posttrain.benchmarks.qlora", "profile": "posttrain.benchmarks.profile",
               "multi_adapter": "posttrain.benchmarks.adapters"}  # (multi_adapter: the adapters benchmark's other name)
    # `all` is what runs on this machine; the GPU script is run on its own, on a GPU (benchmarks/gpu.py)
    which = [w for w in modules if w not in ("gpu", "multi_adapter")] if args.what == "all" else [args.what]
    rc = 0
    for w in which:
        module = modules[w]
        rc |= subprocess.call([sys.executable, "-m", module, *args.extra])
    return rc


def cmd_generate(args) -> int:
    import torch

    from posttrain.core.model.config import ModelConfig
    from posttrain.core.model.generate import SamplingParams, generate
    from posttrain.registry.hf import CheckpointError
    from posttrain.stages.common import StageError, load_model, load_tokenizer, resolve_model_dir

    try:
        is_preset = resolve_model_dir(args.model)[0] is None
        model, _ = load_model(ModelConfig(name_or_path=args.model), torch.device("cpu"))
        vocab = model.args.vocab_size
        if args.tokenizer is None and is_preset:
            # A preset has random weights and no tokenizer: bytes + ChatML, built in memory.
            from posttrain.registry.byte_tokenizer import byte_tokenizer

            try:
                tok = byte_tokenizer(vocab)
            except ValueError as e:
                raise StageError(f"preset {args.model!r}: {e}; pass --tokenizer DIR") from None
        else:
            tok = load_tokenizer(args.tokenizer, args.model)
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                   for p in args.prompts]
        too_big = max(max(ids) for ids in prompts)
        if too_big >= vocab:
            raise StageError(f"the tokenizer gives id {too_big}, beyond the model's vocabulary ({vocab} ids): "
                             "the tokenizer is not this model's; pass the right --tokenizer DIR")
    except (StageError, CheckpointError) as e:
        hint = "" if "--tokenizer" in str(e) or "tokenizer.json" not in str(e) else "; pass --tokenizer DIR"
        print(f"generate: {e}{hint}", file=sys.stderr)
        return 2
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, stop_token_ids=tuple(tok.eos_ids))
    for p, g in zip(args.prompts, generate(model.eval(), prompts, params, pad_id=tok.pad_id or 0)):
        print(f"{p!r} -> {tok.decode(g.tokens, skip_special_tokens=True)!r} ({g.finish_reason})")
    return 0


def _check_serve_args(args) -> str | None:
    """What is wrong with serve-model's numbers, before anything loads or starts."""
    if args.replicas < 1:
        return f"--replicas must be at least 1, not {args.replicas}"
    if args.tp < 1:
        return f"--tp must be at least 1, not {args.tp}"
    if args.ep < 1:
        return f"--ep must be at least 1, not {args.ep}"
    if args.tp > 1 and args.ep > 1:
        return (f"--tp {args.tp} and --ep {args.ep} do not combine yet: a replica is split one way, "
                "by tensor parallelism (--tp) or by expert parallelism (--ep)")
    if not 0 <= args.port <= 65535:
        return f"--port {args.port} is not a TCP port (0-65535)"
    for flag, value in (("--max-queue", args.max_queue), ("--max-num-seqs", args.max_num_seqs),
                        ("--prefix-chars", args.prefix_chars)):
        if value < 1:
            return f"{flag} must be at least 1, not {value}"
    if args.max_retries < 0:
        return f"--max-retries must be 0 or more, not {args.max_retries}"
    if args.request_timeout <= 0:
        return f"--request-timeout must be positive, not {args.request_timeout}"
    return None


def _group(args) -> tuple[str, int]:
    """(layout, ranks) of each replica: ("tp", K), ("ep", K), or ("tp", 1) for one process."""
    return ("ep", args.ep) if args.ep > 1 else ("tp", args.tp)


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _resolve_model(ref: str, args) -> tuple[str, str, bool]:
    """(what a server loads, which version that is, whether it is a preset) for a MODEL reference:
    a registered model (`models:/name@alias`, fetched into --registry-cache; its version
    'name/v3 run ID'), a stage output or HF directory (its real path, both), a preset name.
    StageError when it names nothing servable."""
    from posttrain.stages.common import StageError, local_model_path, resolve_model_dir

    local, version = ref, ref
    if ref.startswith("models:/"):  # a registered MLflow model, fetched into a local cache
        from posttrain.core.tracking.config import default_tracking_uri
        from posttrain.registry.mlflow_registry import fetch_registered

        try:
            path, version = fetch_registered(args.tracking_uri or default_tracking_uri(), ref,
                                             Path(args.registry_cache))
        except RuntimeError as e:
            raise StageError(str(e)) from None
        print(f"serve-model: {ref} is {version} at {path}", file=sys.stderr)
        local = str(path)
    local = local_model_path(local)  # a .gguf file or packaged model: the HF directory it is imported into
    if resolve_model_dir(local)[0] is None:
        return local, version, True
    if version == ref:  # a directory: its real path (a `current` symlink moved to a new checkpoint is a new version)
        local = version = str(Path(local).resolve())
    return local, version, False


def _serve_replicas(args, model_ref: str, version: str, api_key: str | None) -> int:
    """--replicas N > 1: N `serve-model` processes on loopback ports behind one front end; a
    reload (POST /admin/reload, SIGHUP) resolves its reference with `_resolve_model`."""
    from posttrain.stages.common import StageError, resolve_model_dir
    from posttrain.stages.serving.frontend import serve_replicas
    from posttrain.stages.serving.routing import Router

    name = args.served_model_name or args.model

    ports = _free_ports(args.replicas)

    def resolve(ref: str) -> tuple[str, str]:
        try:
            local, found, is_preset = _resolve_model(ref, args)
            if is_preset:
                _check_preset(local)
            elif not (resolve_model_dir(local)[0] / "config.json").exists():  # what a replica would die on
                raise StageError(f"model {ref!r}: {resolve_model_dir(local)[0]} has no config.json")
        except StageError as e:
            raise ValueError(str(e)) from None
        return local, found

    layout, k = _group(args)

    def command(port: int, model: str) -> list[str]:
        device = args.device
        if k > 1 and device.startswith("cuda"):  # replica i: its own K GPUs
            from posttrain.stages.serving.tp import rank_device

            device = rank_device(device, ports.index(port) * k)
        cmd = [sys.executable, "-m", "posttrain.flows.cli", "serve-model", model, "--host", "127.0.0.1",
               "--port", str(port), "--served-model-name", name, "--max-queue", str(args.max_queue),
               "--max-num-seqs", str(args.max_num_seqs), "--device", device, f"--{layout}", str(k)]
        if args.adapters:
            cmd += ["--adapters", args.adapters]
        if args.tokenizer:
            cmd += ["--tokenizer", args.tokenizer]
        return cmd

    router = Router(args.replicas, args.routing, prefix_chars=args.prefix_chars)
    print(f"serve-model: {args.replicas} replicas on 127.0.0.1 ports {', '.join(map(str, ports))}, "
          f"routing {router.policy}", file=sys.stderr)
    serve_replicas(command, ports, router, host=args.host, port=args.port, api_key=api_key,
                   max_retries=args.max_retries, request_timeout=args.request_timeout, ref=args.model,
                   model=model_ref, version=version, resolve=resolve, drain_timeout_s=args.drain_timeout)
    return 0


def _check_preset(name: str) -> None:
    from posttrain.core.model import get_preset
    from posttrain.stages.common import StageError

    try:
        get_preset(name)
    except KeyError as e:
        raise StageError(str(e.args[0])) from None


def cmd_serve_model(args) -> int:
    import os

    import torch

    from posttrain.registry.hf import CheckpointError
    from posttrain.stages.common import StageError
    from posttrain.stages.serving.server import EngineSettings, load_served, make_state, parse_adapters, serve

    problem = _check_serve_args(args)
    if problem:
        print(f"serve-model: {problem}", file=sys.stderr)
        return 2
    try:
        model_ref, version, is_preset = _resolve_model(args.model, args)
        adapters = parse_adapters(args.adapters)
        api_key = args.api_key or os.environ.get("POSTTRAIN_API_KEY") or None
        layout, k = _group(args)
        if k > 1:
            from posttrain.stages.serving.tp import check_group

            check_group(model_ref, layout, k, args.device, replicas=args.replicas)
        if args.replicas > 1:  # the replicas load the model; here only what would fail in each of them
            if is_preset:
                _check_preset(model_ref)
            missing = [str(p) for p in adapters.values() if not p.exists()]
            if missing:
                raise StageError(f"--adapters: no such directory: {', '.join(missing)}")
            if api_key is None:
                print("serve-model: no --api-key / POSTTRAIN_API_KEY: every route is open", file=sys.stderr)
            return _serve_replicas(args, model_ref, version, api_key)
        if k > 1:
            from posttrain.stages.serving.tp import serve_group

            if api_key is None:
                print("serve-model: no --api-key / POSTTRAIN_API_KEY: every route is open", file=sys.stderr)
            spec = {"layout": layout, "model": model_ref, "tokenizer": args.tokenizer, "shown_as": args.model,
                    "device": args.device, "adapters": {name: str(path) for name, path in adapters.items()},
                    "engine": {"max_num_seqs": args.max_num_seqs}}
            return serve_group(spec, k, args.served_model_name or args.model, args.host, args.port, api_key,
                               args.max_queue)
        model, tok, names = load_served(model_ref, args.tokenizer, adapters, torch.device(args.device), args.model)
        state = make_state(model, tok, args.served_model_name or args.model, names, api_key=api_key, max_queue=args.max_queue,
                           engine=EngineSettings(max_num_seqs=args.max_num_seqs))
    except (StageError, CheckpointError, ValueError) as e:
        print(f"serve-model: {e}", file=sys.stderr)
        return 2
    if api_key is None:
        print("serve-model: no --api-key / POSTTRAIN_API_KEY: every route is open", file=sys.stderr)
    serve(state, host=args.host, port=args.port)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run the pipeline once (default: configs/demo.yaml)")
    _add_config_args(p, required=False)
    p.add_argument("--dry-run", action="store_true", help="print the DAG and what would run, then exit")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("stage", help="run one stage under its launcher")
    p.add_argument("name", help="data_prep, sft, distill, dpo, grpo or evaluate")
    _add_config_args(p, required=False)
    p.set_defaults(func=cmd_stage)

    p = sub.add_parser("serve", help="serve Prefect deployments (on demand + scheduled)")
    _add_config_args(p, required=False)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("ui", help="start prefect server and mlflow server on 127.0.0.1")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--prefect-port", type=int, default=4200)
    p.add_argument("--mlflow-port", type=int, default=5000)
    p.add_argument("--backend-store", default=None, help="MLflow backend store URI (default sqlite)")
    p.set_defaults(func=cmd_ui)

    p = sub.add_parser("demo", help="the embedded default pipeline, end to end")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="benchmarks (JSON on stdout)")
    p.add_argument("what", choices=["sft", "kernels", "adapters", "weight_sync", "generate", "online", "serve",
                                    "optimizers", "precision", "qat", "gpu", "dpo", "distill", "qlora",
                                    "multi_adapter", "profile", "all"])
    p.add_argument("extra", nargs=argparse.REMAINDER, help="passed to the benchmark script")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("config", help="print the resolved DAG (nodes, edges, cached or to run)")
    _add_config_args(p, required=False)
    p.add_argument("--json", action="store_true", help="print the whole resolved configuration as JSON")
    p.add_argument("--convert", metavar="OLD.yaml", help="print an old fixed-chain config in the DAG format")
    p.set_defaults(func=cmd_config)

    add_model_parser(sub)
    add_data_parser(sub)

    p = sub.add_parser("generate", help="sample completions from a model")
    p.add_argument("model", help="preset name, HF checkpoint dir or stage output dir")
    p.add_argument("prompts", nargs="+")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer dir (default: the model's; for a preset, a built-in byte-level ChatML one)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve-model", help="an OpenAI-compatible HTTP server for a model (docs/serving.md)")
    p.add_argument("model", help="preset name, HF checkpoint dir, stage output dir or models:/name@alias")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--adapters", default=None, metavar="NAME=DIR,...",
                   help="PEFT LoRA adapters loaded onto the base; a request's `model` names one")
    p.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer KEY' (env POSTTRAIN_API_KEY)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting + running; beyond: HTTP 429")
    p.add_argument("--max-num-seqs", type=int, default=16, help="sequences the engine runs at once")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer dir (default: the model's; for a preset, a built-in byte-level ChatML one)")
    p.add_argument("--device", default="cpu", help="torch device for the model (cpu, cuda, cuda:1)")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI for models:/ references")
    p.add_argument("--registry-cache", default="runs/.registry", help="where models:/ references are downloaded")
    p.add_argument("--served-model-name", default=None, help="the base model's id in the API (default: MODEL)")
    p.add_argument("--tp", type=int, default=1,
                   help="K > 1: one replica split by tensor parallelism over K processes (gloo on CPU, NCCL on "
                        "CUDA: GPUs B..B+K-1 for --device cuda:B)")
    p.add_argument("--ep", type=int, default=1,
                   help="K > 1, MoE models: one replica over K processes, each holding 1/K of every MoE layer's "
                        "experts (the other layers whole on each); K must divide the experts; not with --tp")
    p.add_argument("--replicas", type=int, default=1,
                   help="N > 1: N server processes on loopback ports behind a front end on --host/--port")
    p.add_argument("--routing", choices=["least-loaded", "prefix"], default="least-loaded",
                   help="replicas: the least outstanding tokens, or by a hash of the prompt's start (prefix cache)")
    p.add_argument("--prefix-chars", type=int, default=64, help="--routing prefix: characters hashed")
    p.add_argument("--max-retries", type=int, default=2,
                   help="replicas: times a non-streaming request is sent again when its replica's connection fails")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="replicas: seconds the front end waits for a replica's answer (between stream events)")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="replicas, reload: seconds a replica's in-flight requests get to finish before it restarts")
    p.set_defaults(func=cmd_serve_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Prefect's ephemeral API server takes ~15 s to start on a small, busy machine; its default
    # patience is shorter. A user's own setting wins.
    import os

    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    # Nothing leaves this machine: no usage telemetry (its startup write also contends for the
    # ephemeral server's SQLite lock and fills the log with "database is locked").
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    args = build_parser().parse_args(argv)
    from posttrain.core.config import ConfigError

    try:
        return args.func(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
