"""The registered model as an MLflow model: a pyfunc flavour (`PosttrainLM`) whose artifact `hf`
is the HF-format model directory (config.json, safetensors, tokenizer files), so that
`mlflow.pyfunc.load_model("models:/name/3").predict(pd.DataFrame({"prompt": [...]}))` returns
completions, and `mlflow models serve` serves it. It loads with the project's own loader
(posttrain.registry.hf, posttrain.registry.tokenizer) and decodes with posttrain.core.model.generate; the project's code
(core, kernels, registry) travels in the model's `code/`, so the model loads without the repo.

Signature: input a string column `prompt`; output string columns `completion`, `finish_reason`;
params `max_new_tokens` (int), `temperature` (float, 0 = greedy) and `chat_template` (bool: wrap
each prompt as a user message through the tokenizer's chat template, as `posttrain generate`
does; false, or a tokenizer without a template: the prompt as plain text, as evaluate does).

A PEFT adapter directory (posttrain.registry.adapters) is registered merged into its base (the model the
adapter names as `base_model_name_or_path`), the adapter's own files kept as artifact `adapter`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import pandas as pd

HF_ARTIFACT = "hf"
ADAPTER_ARTIFACT = "adapter"
DEFAULT_PARAMS = {"max_new_tokens": 64, "temperature": 0.0, "chat_template": True}
EXAMPLE_PROMPTS = ["What is 12 + 30?"]
CODE_PACKAGES = ("core", "kernels", "registry")
REQUIREMENTS = ("mlflow", "torch", "tokenizers", "safetensors", "jinja2", "pydantic", "pyyaml", "numpy", "pandas")
BATCH = 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")  # posttrain.registry.hf.copy_tokenizer_files's


def signature():
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec(DataType.string, "prompt")]),
        outputs=Schema([ColSpec(DataType.string, "completion"), ColSpec(DataType.string, "finish_reason")]),
        params=ParamSchema([ParamSpec("max_new_tokens", DataType.long, DEFAULT_PARAMS["max_new_tokens"]),
                            ParamSpec("temperature", DataType.double, DEFAULT_PARAMS["temperature"]),
                            ParamSpec("chat_template", DataType.boolean, DEFAULT_PARAMS["chat_template"])]))


def prompts_of(model_input: Any) -> list[str]:
    """The prompts of a pyfunc input: a DataFrame (its `prompt` column, else its first), a list
    or Series of strings, one string, or {"prompt": ...}."""
    if isinstance(model_input, pd.DataFrame):
        col = model_input["prompt"] if "prompt" in model_input.columns else model_input.iloc[:, 0]
        return [str(p) for p in col.tolist()]
    if isinstance(model_input, dict):
        return prompts_of(model_input["prompt"])
    if isinstance(model_input, str):
        return [model_input]
    return [str(p) for p in list(model_input)]


def encode(tok, prompt: str, chat_template: bool) -> list[int]:
    if chat_template and tok.chat_template is not None:
        return tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    ids = tok.encode(prompt)
    return ids[:-1] if len(ids) > 1 and ids[-1] in tok.eos_ids else ids  # a post-processor's EOS


def complete(model, tok, prompts: list[str], max_new_tokens: int = 64, temperature: float = 0.0,
             chat_template: bool = True) -> tuple[list[str], list[str]]:
    """(completions, finish reasons) of `prompts`, BATCH at a time (greedy at temperature 0)."""
    from posttrain.core.model.generate import SamplingParams, generate

    params = SamplingParams(max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                            stop_token_ids=tuple(sorted(tok.eos_ids)))
    texts, reasons = [], []
    for i in range(0, len(prompts), BATCH):
        ids = [encode(tok, p, chat_template) for p in prompts[i:i + BATCH]]
        for g in generate(model, ids, params, pad_id=tok.pad_id or 0):
            texts.append(tok.decode(g.tokens, skip_special_tokens=True))
            reasons.append(g.finish_reason)
    return texts, reasons


def load_lm(hf_dir: str | Path, device: str | None = None):
    """(model in eval mode, tokenizer) of an HF directory: the project's loader, fp32 on CPU,
    bf16 on CUDA (POSTTRAIN_SERVE_DEVICE / POSTTRAIN_SERVE_DTYPE override)."""
    import torch

    from posttrain.registry.hf import load_pretrained
    from posttrain.registry.tokenizer import Tokenizer

    device = device or os.environ.get("POSTTRAIN_SERVE_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = os.environ.get("POSTTRAIN_SERVE_DTYPE") or ("bfloat16" if str(device).startswith("cuda") else "float32")
    model = load_pretrained(hf_dir, dtype=getattr(torch, dtype), device=device).eval()
    return model, Tokenizer.from_pretrained(hf_dir)


class PosttrainLM(mlflow.pyfunc.PythonModel):
    """Prompts in, greedy (or sampled) completions out, from the HF directory artifact `hf`."""

    def load_context(self, context) -> None:
        self.model, self.tok = load_lm(context.artifacts[HF_ARTIFACT])

    def predict(self, context, model_input, params: dict[str, Any] | None = None) -> pd.DataFrame:
        p = {**DEFAULT_PARAMS, **(params or {})}
        texts, reasons = complete(self.model, self.tok, prompts_of(model_input), p["max_new_tokens"],
                                  p["temperature"], bool(p["chat_template"]))
        return pd.DataFrame({"completion": texts, "finish_reason": reasons})


# ---------------------------------------------------------------------------------------------
# Writing the MLflow model


def is_adapter_dir(path: Path) -> bool:
    return (path / "adapter_config.json").exists() and not (path / "config.json").exists()


def _tokenizer_dir(*candidates: Path) -> Path | None:
    return next((c for c in candidates if (c / "tokenizer.json").exists()), None)


def merge_adapter(adapter_dir: Path, out: Path, base: str | Path | None = None) -> Path:
    """The PEFT adapter at `adapter_dir` merged into its base (HF directory `base`, else the one
    its adapter_config.json names; a stage directory's `model/`), with a tokenizer (the adapter
    stage's `tokenizer/`, else the base's), saved as an HF directory at `out`."""
    import json

    from posttrain.core.lora import merged_state_dict
    from posttrain.registry.adapters import load_adapter
    from posttrain.registry.hf import CheckpointError, load_pretrained, save_pretrained
    from posttrain.registry.tokenizer import Tokenizer

    base = Path(base or json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
                or "")
    base = base / "model" if not (base / "config.json").exists() and (base / "model" / "config.json").exists() else base
    if not (base / "config.json").exists():
        raise CheckpointError(f"{adapter_dir}: a LoRA adapter is registered merged into its base, and its base "
                              f"{str(base)!r} is not an HF model directory")
    model = load_pretrained(base)
    load_adapter(model, adapter_dir)
    save_pretrained(model, out, state=merged_state_dict(model, "default"))
    tok = _tokenizer_dir(adapter_dir, adapter_dir.parent / "tokenizer", adapter_dir.parent.parent / "tokenizer", base)
    if tok is not None:
        Tokenizer.from_pretrained(tok).save_pretrained(out)
    return out


def _code_copy(dst: Path) -> list[str]:
    """The project's packages the model imports (sources only), copied under `dst`/posttrain: the
    model's code/ folder then holds the `posttrain` namespace with those packages in it. (A model
    registered before the rename to posttrain.* carries its own code under the old names and
    loads from it.)"""
    root = Path(__file__).resolve().parents[1]
    for pkg in CODE_PACKAGES:
        shutil.copytree(root / pkg, dst / "posttrain" / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return [str(dst / "posttrain")]


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or no hard links there
        shutil.copy2(src, dst)


def _link_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, copy_function=_link, ignore=shutil.ignore_patterns(".*"))


def _add_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer files of `src` into `dst`, replacing (not writing through) hard links."""
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            (dst / name).unlink(missing_ok=True)
            shutil.copy2(src / name, dst / name)


def requirements() -> list[str]:
    out = []
    for name in REQUIREMENTS:
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return out


def log_pyfunc_model(client, run_id: str, model_dir: Path, name: str, params: dict[str, str],
                     tags: dict[str, str], base_model: str | Path | None = None):
    """Write `model_dir` (an HF directory, or a PEFT adapter directory, merged into its base) as
    a pyfunc MLflow model and upload it as a LoggedModel of run `run_id` (its output); returns
    the LoggedModel, READY. Through `client` only: no global tracking URI, no active run."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.models import Model

    model_dir = Path(model_dir)
    run = client.get_run(run_id)
    logged = client.create_logged_model(run.info.experiment_id, name=name, source_run_id=run_id,
                                        tags=tags, params=params, model_type="llm")
    try:
        with contextlib.ExitStack() as stack:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="posttrain-mlflow-model-")))
            # MLflow names an artifact's folder after its directory (artifacts/hf) and takes no
            # symlinks: hard links (copies across file systems), next to the model
            links = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=".mlflow-", dir=model_dir.parent)))
            if is_adapter_dir(model_dir):
                merge_adapter(model_dir, links / HF_ARTIFACT, base_model)
                _link_tree(model_dir, links / ADAPTER_ARTIFACT)
            else:
                _link_tree(model_dir, links / HF_ARTIFACT)
            tok = _tokenizer_dir(links / HF_ARTIFACT, model_dir.parent / "tokenizer")  # a stage's own
            if tok is not None and tok != links / HF_ARTIFACT:
                _add_tokenizer(tok, links / HF_ARTIFACT)
            if _tokenizer_dir(links / HF_ARTIFACT) is None:
                raise FileNotFoundError(f"{model_dir}: no tokenizer.json; a registered model carries its tokenizer")
            artifacts = {p.name: str(p) for p in sorted(links.iterdir())}
            mlflow_model = Model(artifact_path=logged.artifact_location, model_uuid=logged.model_id,
                                 run_id=run_id, model_id=logged.model_id)
            local = tmp / "model"
            stack.enter_context(warnings.catch_warnings())  # the signature is given: no type hints needed
            warnings.filterwarnings("ignore", message=".*type hints to the `predict` method")
            mlflow.pyfunc.save_model(
                path=str(local), python_model=PosttrainLM(), artifacts=artifacts, mlflow_model=mlflow_model,
                signature=signature(), input_example=(pd.DataFrame({"prompt": EXAMPLE_PROMPTS}),
                                                      {"max_new_tokens": 16}),
                code_paths=_code_copy(tmp / "code"), pip_requirements=requirements(),
                metadata={"posttrain": {"artifact": HF_ARTIFACT, "adapter": ADAPTER_ARTIFACT in artifacts}})
            client.log_model_artifacts(logged.model_id, str(local))
    except BaseException:
        client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
    return client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)


def hf_dir_of(local: Path) -> Path:
    """The HF directory inside a downloaded MLflow model (`artifacts/hf`); a plain HF directory
    (a version registered before models were MLflow models) is its own."""
    local = Path(local)
    if (local / "MLmodel").exists():
        import yaml

        conf = yaml.safe_load((local / "MLmodel").read_text())
        rel = conf.get("flavors", {}).get("python_function", {}).get("artifacts", {}).get(HF_ARTIFACT, {}).get("path")
        if rel and (local / rel).is_dir():
            return local / rel
        if (local / "artifacts" / HF_ARTIFACT).is_dir():
            return local / "artifacts" / HF_ARTIFACT
    return local
