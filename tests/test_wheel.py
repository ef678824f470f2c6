"""The wheel alone, beside the ecosystem (issue 39): posttrain's wheel installed into a fresh venv
with the CPU torch wheel, the newest transformers and Hugging Face's `kernels` (which imports as
`kernels`, the name our kernels/ folder had before everything moved under posttrain.*). 
  * the wheel holds only posttrain/ (and its .dist-info): every package of pyproject's list and the
    package data the code reads at run time (the configs, the launch templates).

In that venv, run from a directory outside the repository:

  * transformers and `kernels` import beside posttrain, a transformers model class builds, and
    `kernels` is Hugging Face's;
  * `posttrain --help` answers;
  * `posttrain run` runs a tiny pipeline (data prep, then a 2-step SFT under torchrun) from a config
    written outside the repository, against Prefect's ephemeral API and a SQLite MLflow: the
    launcher, the ranks and the stage code all come from the installed wheel.

It installs the whole dependency set from pip's cache and the local wheel directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} failed ({out.returncode}):\n{(out.stdout + out.stderr)[-4000:]}"
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp), str(ROOT)],
         tmp, os.environ)
    wheel, = tmp.glob("posttrain-*.whl")
    return wheel


def test_the_wheel_holds_posttrain_and_its_package_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"posttrain", wheel.name.split("-py3")[0] + ".dist-info"}
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert [p for p in packages if p.replace(".", "/") + "/__init__.py" not in names] == []
    assert "posttrain/__init__.py" not in names  # a namespace package
    for data in ("posttrain/configs/demo.yaml", "posttrain/configs/data/chat.jsonl",
                 "posttrain/infra/slurm/stage.sbatch.j2", "posttrain/infra/kubernetes/pytorchjob.yaml.j2"):
        assert data in names, data


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> tuple[Path, dict]:
    import torch

    tmp = tmp_path_factory.mktemp("wheel")
    # Nothing of this test session reaches the venv: no PYTHONPATH (tests/conftest.py sets one), no
    # PYTHONSAFEPATH, no Prefect/MLflow settings.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "PREFECT_", "MLFLOW_", "POSTTRAIN_", "VIRTUAL_ENV"))}
    env["PREFECT_HOME"] = str(tmp / "prefect")
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    _run([sys.executable, "-m", "venv", str(tmp / "venv")], tmp, env)
    py = tmp / "venv" / "bin" / "python"
    # The CPU build of the torch this suite runs (a bare `torch` would pull the CUDA build), then
    # the wheel with the newest transformers and Hugging Face's kernels. (--no-compile: Python
    # compiles what the test imports; compiling every module of torch and transformers up front
    # would take most of the install's time.)
    pip = [str(py), "-m", "pip", "install", "-q", "--no-compile"]
    _run([*pip, f"torch=={torch.__version__.split('+')[0]}"], tmp, env)
    _run([*pip, str(wheel), "transformers", "kernels"], tmp, env)
    return py, env


def test_transformers_and_kernels_import_beside_posttrain(venv, tmp_path):
    py, env = venv
    script = textwrap.dedent("""
        import json, importlib.metadata as md
        import kernels, transformers
        import posttrain.kernels, posttrain.core.model
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
        print(json.dumps({"kernels": kernels.__file__, "ours": posttrain.kernels.__file__,
                          "transformers": transformers.__version__, "kernels_version": md.version("kernels"),
                          "params": sum(p.numel() for p in model.parameters())}))
    """)
    got = json.loads(_run([str(py), "-c", script], tmp_path, env).stdout.strip().splitlines()[-1])
    venv_dir = py.parent.parent
    assert Path(got["kernels"]).is_relative_to(venv_dir) and "site-packages/kernels/" in got["kernels"], got
    assert Path(got["ours"]).is_relative_to(venv_dir) and "site-packages/posttrain/kernels/" in got["ours"], got
    assert got["params"] > 0
    print(got)


def test_posttrain_help_and_a_tiny_pipeline_from_the_wheel(venv, tmp_path):
    py, env = venv
    posttrain = py.parent / "posttrain"
    assert "run" in _run([str(posttrain), "--help"], tmp_path, env).stdout
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(textwrap.dedent(f"""
        name: wheel
        workspace: {tmp_path / 'runs'}
        nodes:
          prep: {{kind: data_prep, synthetic_size: 200, vocab_size: 512}}
          sft:
            kind: sft
            model: debug
            data: {{sources: [prep], batch_tokens: 256, max_seq_len: 64}}
            max_steps: 2
            eval_interval: 0
            checkpoint: {{interval_steps: 0}}
        launcher: {{kind: local, nproc_per_node: 2}}
        tracking: {{tracking_uri: "sqlite:///{tmp_path / 'mlflow.db'}"}}
    """))
    out = _run([str(posttrain), "run", str(cfg)], tmp_path, env)
    manifest = json.loads((tmp_path / "runs" / "wheel" / "sft" / "manifest.json").read_text())
    assert manifest["files"], manifest
    print(out.stdout[-2000:])
