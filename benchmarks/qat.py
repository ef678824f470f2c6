"""How much of post-training quantization's loss QAT recovers, on the demo's verifiable suite.

    python -m posttrain.benchmarks.qat [--quick] [--weights int4] [--group-size 16] [--activations none]
                             [--sft-steps 600] [--qat-steps 200] [--out file.json]
    posttrain bench qat ...

Every step is a real stage run (`python -m posttrain.stages.sft`, one process, the CPU) on data prep's
synthetic suite (copy, reverse, sort, max; 2000 examples):

  a   SFT of the debug preset from scratch (--sft-steps, lr 3e-3)
  a'  a trained --qat-steps more without QAT (lr 5e-4): the float model QAT is compared with
  b   post-training quantization of a  (posttrain.registry.quantized.save_quantized: the same codes QAT exports)
  b'  post-training quantization of a'
  c   a trained --qat-steps with `qat:` (same lr and data as a'), its exported `quantized/` model

then the evaluate stage scores each on the held-out split: greedy exact match against the answer,
and the token-weighted NLL of the reference completions (a finer measure: exact match moves by
whole prompts). `recovered` = (c - b') / (a' - b'): the share of the float-to-PTQ drop QAT wins
back at equal training (and the same against a and b), for exact match and for NLL; None when
PTQ did not hurt. A negative share means QAT did worse than PTQ.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from posttrain.benchmarks import emit


def stage(module: str, cfg, root: Path) -> float:
    from posttrain.core.config import to_json_file

    path = root / f"{Path(cfg.output_dir).name}.json"
    to_json_file(cfg, path)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", f"posttrain.stages.{module}", "--config", str(path)], cwd=root,
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{cfg.output_dir} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return time.perf_counter() - t0


def ptq(model_dir: Path, out: Path, qat) -> Path:
    """Post-training quantization of a stage's exported model with the scheme QAT trains for."""
    from posttrain.registry.hf import load_pretrained
    from posttrain.registry.quantized import save_quantized
    from posttrain.registry.tokenizer import Tokenizer

    model = load_pretrained(model_dir)
    save_quantized(model, out, qat)
    Tokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny run that checks the pipeline (numbers meaningless)")
    p.add_argument("--weights", default="int4", choices=["int4", "int8"])
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--activations", default="none", choices=["none", "int8"])
    p.add_argument("--sft-steps", type=int, default=600)
    p.add_argument("--qat-steps", type=int, default=200)
    p.add_argument("--out")
    args = p.parse_args(argv)
    from posttrain.core.qat import QATConfig
    from posttrain.core.tracking import TrackingConfig
    from posttrain.stages.config import DataPrepConfig, EvalConfig, SFTConfig
    from posttrain.stages.data_prep import prepare

    sft_steps, qat_steps, size = (30, 10, 200) if args.quick else (args.sft_steps, args.qat_steps, 2000)
    qat = QATConfig(weights=args.weights, group_size=args.group_size, activations=args.activations)
    off = TrackingConfig(enabled=False)
    doc: dict = {"benchmark": "qat", "command": "python -m posttrain.benchmarks.qat " + " ".join(argv if argv is not None
                                                                                       else sys.argv[1:]),
                 "qat": qat.model_dump(), "sft_steps": sft_steps, "qat_steps": qat_steps, "synthetic_size": size}
    with tempfile.TemporaryDirectory(prefix="qat.") as tmp:
        root = Path(tmp)
        prepare(DataPrepConfig(output_dir=str(root / "data"), synthetic_size=size, tracking=off))
        data = {"sources": [str(root / "data")], "batch_tokens": 768, "max_seq_len": 64}
        common = dict(tracking=off, data=data, eval_interval=0, epochs=100, checkpoint={"interval_steps": 0})
        seconds = {"a": stage("sft", SFTConfig(output_dir=str(root / "a"), model="debug", max_steps=sft_steps,
                                               optim={"lr": 3e-3, "warmup_steps": 20}, **common), root)}
        more = dict(model=str(root / "a"), max_steps=qat_steps, optim={"lr": 5e-4, "warmup_steps": 0}, **common)
        seconds["a_more"] = stage("sft", SFTConfig(output_dir=str(root / "a_more"), **more), root)
        seconds["c"] = stage("sft", SFTConfig(output_dir=str(root / "c"), qat=qat, **more), root)
        ptq(root / "a" / "model", root / "b", qat)
        ptq(root / "a_more" / "model", root / "b_more", qat)
        models = {"a": root / "a", "b": root / "b", "a_more": root / "a_more", "b_more": root / "b_more",
                  "c": root / "c" / "quantized"}
        ev = EvalConfig(output_dir=str(root / "eval"), models=[str(m) for m in models.values()], tracking=off,
                        data={"sources": [str(root / "data")]}, metrics=["exact_match", "perplexity"],
                        max_new_tokens=16)
        stage("evaluate", ev, root)
        manifest = json.loads((root / "eval" / "manifest.json").read_text())
        from posttrain.stages.evaluation.plan import model_names

        names = dict(zip(models, model_names(ev.models)))
        em = {k: round(manifest["results"][names[k]]["exact_match"], 4) for k in models}
        nll = {k: round(manifest["results"][names[k]]["nll"], 5) for k in models}
        from posttrain.stages.evaluation.plan import load_eval_data

        held_out = len(load_eval_data(ev).prompts)  # the prompts exact match is taken over

    def share(float_, ptq_):
        drop = em[float_] - em[ptq_]
        return round((em["c"] - em[ptq_]) / drop, 3) if drop > 0 else None

    def nll_share(float_, ptq_):  # lower is better
        rise = nll[ptq_] - nll[float_]
        return round((nll[ptq_] - nll["c"]) / rise, 3) if rise > 0 else None

    doc.update(nll=nll, nll_recovered_vs_equal_training=nll_share("a_more", "b_more"),
               nll_recovered_vs_a=nll_share("a", "b"))
    doc.update(exact_match=em, held_out=held_out, correct={k: round(v * held_out) for k, v in em.items()},
               stage_seconds={k: round(v, 1) for k, v in seconds.items()},
               recovered_vs_equal_training=share("a_more", "b_more"), recovered_vs_a=share("a", "b"))
    return emit(doc, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
