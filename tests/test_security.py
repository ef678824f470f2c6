"""Security properties, checked on the code and the shipped files themselves: no code execution
from loaded weights or configs, no secrets in logs, manifests or infra files, servers on
127.0.0.1, and no user-given name that becomes a path outside its directory."""

from __future__ import annotations

import ast
import os
import re
import stat
from pathlib import Path

import pytest
import yaml

from posttrain.flows.dag import PipelineDAG, Upstream

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".venv", ".git", "node_modules", "build", "dist", "__pycache__", ".hypothesis", "runs", "outputs"}
PRODUCT = ("core", "kernels", "stages", "flows", "registry", "benchmarks")


def python_files() -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
        out += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    assert len(out) > 50, "the scan found too few files to mean anything"
    return sorted(out)


FILES = {p: ast.parse(p.read_text(), str(p)) for p in python_files()}
CALLS = [(p, n) for p, tree in FILES.items() for n in ast.walk(tree) if isinstance(n, ast.Call)]


def rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def is_product(p: Path) -> bool:
    return rel(p).split(os.sep)[0] in PRODUCT


def dotted(node: ast.AST) -> str:
    """`torch.load` for an Attribute chain, `load` for a Name; '' otherwise."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def calls(pred) -> list[tuple[str, int, ast.Call]]:
    return [(rel(p), n.lineno, n) for p, n in CALLS if pred(p, n)]


def kw(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


# ------------------------------------------------------------------------------ loading code

def unsafe_torch_loads(trees: dict[Path, ast.AST]) -> list[str]:
    aliases = {a.asname or a.name for tree in trees.values() for n in ast.walk(tree)
               if isinstance(n, ast.ImportFrom) and n.module in ("torch", "torch.serialization")
               for a in n.names if a.name == "load"}
    return [f"{p.name}:{n.lineno}" for p, tree in trees.items() for n in ast.walk(tree)
            if isinstance(n, ast.Call) and (dotted(n.func) in ("torch.load", "torch.serialization.load")
                                            or dotted(n.func) in aliases)
            and not is_true(kw(n, "weights_only"))]


def test_every_torch_load_is_weights_only():
    probe = {Path("probe.py"): ast.parse("import torch\nfrom torch import load as L\ntorch.load('a')\n"
                                          "torch.load('b', weights_only=False)\nL('c')\n"
                                          "torch.load('d', weights_only=True)\n")}
    assert unsafe_torch_loads(probe) == ["probe.py:3", "probe.py:4", "probe.py:5"]  # the scan sees them
    assert not unsafe_torch_loads(FILES), "torch.load without weights_only=True"


def test_no_pickle_is_loaded_by_the_product():
    loaders = {"pickle.load", "pickle.loads", "pickle.Unpickler", "cPickle.load", "dill.load", "dill.loads",
               "cloudpickle.load", "cloudpickle.loads", "joblib.load", "marshal.load", "marshal.loads",
               "shelve.open", "torch.package.PackageImporter"}
    bad = [f"{f}:{line} {dotted(c.func)}" for f, line, c in calls(lambda p, c: is_product(p) and dotted(c.func) in loaders)]
    assert not bad, bad
    np_pickle = calls(lambda p, c: dotted(c.func).endswith(("np.load", "numpy.load")) and is_true(kw(c, "allow_pickle")))
    assert not np_pickle
    # The one unpickler (DCP's .metadata) restricts what it may load.
    unpicklers = [(rel(p), n) for p, tree in FILES.items() if is_product(p) for n in ast.walk(tree)
                  if isinstance(n, ast.ClassDef) and any(dotted(b) == "pickle.Unpickler" for b in n.bases)]
    assert [f for f, _ in unpicklers] == ["core/checkpoint/layout.py"]
    assert all(any(isinstance(m, ast.FunctionDef) and m.name == "find_class" for m in cls.body)
               for _, cls in unpicklers)


def test_yaml_is_read_safely_and_nothing_is_evaluated():
    from posttrain.core.config import _Yaml12Loader

    assert issubclass(_Yaml12Loader, yaml.SafeLoader)
    safe = {"yaml.SafeLoader", "yaml.CSafeLoader", "SafeLoader", "_Yaml12Loader"}
    for f, line, c in calls(lambda p, c: dotted(c.func) in ("yaml.load", "yaml.load_all")):
        assert dotted(kw(c, "Loader") or (c.args[1] if len(c.args) > 1 else ast.Constant(None))) in safe, f"{f}:{line}"
    assert not calls(lambda p, c: dotted(c.func) in ("yaml.unsafe_load", "yaml.full_load", "yaml.unsafe_load_all"))
    assert not calls(lambda p, c: is_product(p) and dotted(c.func) in ("eval", "exec", "compile", "__import__"))
    shell = calls(lambda p, c: is_product(p) and dotted(c.func).startswith(("subprocess.", "os.system", "os.popen"))
                  and (is_true(kw(c, "shell")) or dotted(c.func) in ("os.system", "os.popen")))
    assert not shell, [f"{f}:{line}" for f, line, _ in shell]


def test_trust_remote_code_is_never_used():
    text = {rel(p): p.read_text() for p in FILES if is_product(p)}
    assert not [f for f, t in text.items() if "trust_remote_code" in t]
    enabled = calls(lambda p, c: is_true(kw(c, "trust_remote_code")))
    assert not enabled, enabled


def test_chat_templates_run_sandboxed():
    from tests.support.data_fixtures import make_tokenizer

    from posttrain.registry.tokenizer import ChatTemplateError

    tok = make_tokenizer()
    tok.chat_templates["default"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError, match="unsafe"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# ------------------------------------------------------------------------------ servers and infra

def test_ui_servers_bind_localhost_by_default(monkeypatch):
    import posttrain.flows.ui as ui
    from posttrain.flows.cli import build_parser

    assert build_parser().parse_args(["ui"]).host == "127.0.0.1"
    started: list[tuple[list[str], dict]] = []

    class FakeProc:
        pid = 0

        def __init__(self, cmd, env=None, **kw):
            started.append((cmd, env or dict(os.environ)))

        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(ui.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(ui, "_wait_http", lambda url, proc, timeout: url.startswith("http://127.0.0.1:"))
    procs = ui.start_servers()
    assert [name for name, _, _ in procs] == ["prefect", "mlflow"]
    (prefect, penv), (mlflow, _) = started
    assert prefect[prefect.index("--host") + 1] == "127.0.0.1" and penv["PREFECT_SERVER_API_HOST"] == "127.0.0.1"
    assert mlflow[mlflow.index("--host") + 1] == "127.0.0.1"
    assert not any(a in ("0.0.0.0", "::") for cmd, _ in started for a in cmd)


def _secret_like(key: str) -> bool:
    from posttrain.core.tracking import is_secret_key

    return is_secret_key(key) and not key.lower().startswith("existing")  # a Secret's name, not its value


_REF = re.compile(r"^\$?\$\{[A-Za-z_][A-Za-z0-9_]*(:?[-?][^}]*)?\}$")  # ${VAR}, ${VAR:?msg}, $${VAR}
_URI_PASSWORD = re.compile(r"://[^/\s:@]+:([^@/\s]+)@")


def _walk(node, path=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, path + (str(k),))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, path + (str(i),))
    else:
        yield path, node


INFRA_YAML = sorted(p for p in (ROOT / "infra").rglob("*") if p.suffix in (".yaml", ".yml"))


@pytest.mark.parametrize("path", INFRA_YAML, ids=lambda p: rel(p))
def test_infra_files_hold_no_credentials(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs
    leaks = []
    for doc in docs:
        for keys, value in _walk(doc):
            text = "" if value is None else str(value)
            if _secret_like(keys[-1]) and text and not _REF.match(text):
                leaks.append(f"{'.'.join(keys)}={text!r}")
            for m in _URI_PASSWORD.finditer(text):
                if not _REF.match(m.group(1)):
                    leaks.append(f"{'.'.join(keys)}: password {m.group(1)!r} in a URI")
    assert not leaks, leaks


def test_compose_publishes_ports_on_localhost_only():
    compose = yaml.safe_load((ROOT / "infra" / "compose.yaml").read_text())
    ports = {name: svc.get("ports", []) for name, svc in compose["services"].items()}
    assert any(ports.values())
    for name, published in ports.items():
        for p in published:
            assert str(p).startswith("127.0.0.1:"), f"{name}: {p} is reachable from other hosts"
        assert compose["services"][name].get("network_mode") != "host", name
    # The credentials are required from the environment, and that file is never committed.
    assert "${POSTGRES_PASSWORD:?" in (ROOT / "infra" / "compose.yaml").read_text()
    ignored = (ROOT / ".gitignore").read_text().split()
    assert any(p in ignored for p in (".env", "*.env", "infra/.env")), ".env files must be git-ignored"


# ------------------------------------------------------------------------------ secrets

SECRETS = {"hf": "hf_SECRETtoken123", "aws": "AKIAsecretvalue", "pw": "hunter2pw"}


def _secret_config():
    from posttrain.core.config import load_config
    from posttrain.flows.config import PipelineConfig
    from tests.support.pipelines import DEMO_CONFIG

    return load_config(PipelineConfig, DEMO_CONFIG, overrides=[
        f"launcher.env.HF_TOKEN={SECRETS['hf']}", f"launcher.env.AWS_SECRET_ACCESS_KEY={SECRETS['aws']}",
        f"tracking.tracking_uri=postgresql://mlflow:{SECRETS['pw']}@db:5432/mlflow",
        f"tracking.tags.api_key={SECRETS['hf']}", f"nodes.dpo.launcher.env.HF_TOKEN={SECRETS['hf']}",
        f"nodes.dpo.tracking.tracking_uri=postgresql://mlflow:{SECRETS['pw']}@db:5432/mlflow"])


def _spec(cfg, name: str):
    """Node `name`'s stage spec, its inputs finished in their default dirs."""
    dag = PipelineDAG(cfg)
    return dag.spec(name, {u: Upstream(str(dag.output_dir(u)), "digest") for u in dag.inputs(name)})


def test_secrets_are_masked_in_logged_params():
    from posttrain.core.config import dump_config
    from posttrain.core.tracking import flatten_params, mask_secrets

    cfg = _secret_config()
    params = flatten_params(dump_config(cfg))  # what stage_run logs to MLflow
    assert params["launcher.env.HF_TOKEN"] == "***" and params["tracking.tracking_uri"] == "postgresql://mlflow:***@db:5432/mlflow"
    stage = flatten_params(dump_config(_spec(cfg, "student")))  # the pipeline's launcher and tracking
    own = flatten_params(dump_config(_spec(cfg, "dpo")))  # the node's own
    assert own["launcher.env.HF_TOKEN"] == "***" and params["nodes.dpo.launcher.env.HF_TOKEN"] == "***"
    for flat in (params, stage, own):
        assert not [k for k, v in flat.items() if any(s in v for s in SECRETS.values())]
    error = f"OperationalError: could not connect to postgresql://mlflow:{SECRETS['pw']}@db/mlflow"
    assert SECRETS["pw"] not in mask_secrets(error)  # the text of a failed run's error tag


def test_stage_manifest_stores_no_secrets(tmp_path):
    from posttrain.core.config import dump_config
    from posttrain.core.manifest import write_manifest

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.bin").write_bytes(b"x")
    cfg = dump_config(_spec(_secret_config(), "student"))
    m = write_manifest(tmp_path, "sft", {"model": "model"}, config=cfg, metrics={"loss": 1.0})
    text = (tmp_path / "manifest.json").read_text()
    assert m["config_digest"] and not any(s in text for s in SECRETS.values())  # a digest, not the config


def test_stage_spec_file_is_private(tmp_path):
    from posttrain.core.config import to_json_file

    path = to_json_file(_spec(_secret_config(), "student"), tmp_path / "spec.json")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it must hold the tokens; only its owner reads it


# ------------------------------------------------------------------------------ names and paths

def test_adapter_names_cannot_escape(tmp_path):
    from posttrain.core.lora.config import LoRAConfig
    from posttrain.core.lora import apply_lora
    from posttrain.core.model import build_model, get_preset
    from posttrain.registry.adapters import load_adapter, save_adapter

    model = build_model(get_preset("debug"))
    apply_lora(model, LoRAConfig(enabled=True, rank=2))
    for name in ["../evil", "a/b", "..", "/abs", "a\\b", "", "x\x00"]:
        with pytest.raises(ValueError, match="adapter name"):
            save_adapter(model, tmp_path / "adapter", name=name)
        with pytest.raises(ValueError, match="adapter name"):
            load_adapter(model, tmp_path / "adapter", name=name)
        with pytest.raises(ValueError):
            LoRAConfig(adapter_names=[name])
    assert list(tmp_path.iterdir()) == []
    save_adapter(model, tmp_path / "adapter", name="default")  # the checks refuse only bad names
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("bad", ["../x", "a/../../x", "/etc/x", "C:/x", "a\\..\\b", "x\x00"])
def test_mlflow_artifact_paths_stay_in_the_run(bad):
    from posttrain.core.tracking import Tracker, check_artifact_path

    assert check_artifact_path("plots/loss.png") == "plots/loss.png" and check_artifact_path(None) is None
    with pytest.raises(ValueError, match="inside the run's artifacts"):
        check_artifact_path(bad)
    # Wired into the Tracker's calls, before anything is buffered (no MLflow needed to see it).
    with pytest.raises(ValueError, match="inside the run's artifacts"):
        Tracker.log_artifact(object(), "/tmp/file", artifact_path=bad)
    with pytest.raises(ValueError, match="inside the run's artifacts"):
        Tracker._stage(object(), bad)


def test_config_paths_and_names_stay_in_the_workspace():
    from posttrain.core.config import ConfigError, load_config
    from posttrain.flows.config import PipelineConfig
    from tests.support.pipelines import DEMO_CONFIG

    for item in ["name=../x", "name=a/b", "workspace=runs/../..", "nodes.teacher.output_dir=../../x",
                 "nodes.dpo.output_dir=/etc", "nodes.evaluate.output_dir=a/../../../x",
                 # inside the workspace, but a node clears its dir when its result changes:
                 "nodes.dpo.output_dir=..", "nodes.dpo.output_dir=.", "nodes.dpo.output_dir=student",
                 "nodes.dpo.output_dir=.locks", "nodes.a/b.kind=sft",
                 'nodes.student.sweep={model.name_or_path: ["../../../../../x"]}']:
        with pytest.raises(ConfigError, match=re.escape(item.split("=")[0].rsplit(".", 1)[0]
                                                        if item.startswith("nodes.") else item.split("=")[0])):
            load_config(PipelineConfig, DEMO_CONFIG, overrides=[item])
    # the same, written in a file (the Prefect form's values are validated the same way)
    data = yaml.safe_load(DEMO_CONFIG.read_text())
    data["nodes"]["dpo"]["output_dir"] = "../../../etc"
    with pytest.raises(ValueError, match=r"nodes\.dpo\.output_dir: .*escapes"):
        PipelineConfig.model_validate(data)
    data["nodes"]["dpo"].pop("output_dir")
    for name in ("../x", "..", "a/b", "a\\b", ".locks"):  # a node's name is its directory's
        with pytest.raises(ValueError, match=rf"nodes\.{re.escape(name)}: node names are letters"):
            PipelineConfig.model_validate({**data, "nodes": {**data["nodes"], name: {"kind": "data_prep"}}})


def test_slurm_script_cannot_be_injected():
    """Config values land in the sbatch script: a newline in an #SBATCH value or a crafted env
    key would be a shell command. Both are refused; env values are quoted."""
    import shlex

    from posttrain.core.config import ConfigError, load_config
    from posttrain.flows.config import PipelineConfig
    from posttrain.stages.launch.config import LauncherConfig
    from posttrain.stages.launch import render_sbatch

    from tests.support.pipelines import DEMO_CONFIG

    for item in [r'launcher.slurm.partition="gpu\nrm -rf ~"', r'launcher.slurm.extra_args=["--qos=high\ncurl x|sh"]',
                 r'launcher.slurm.account="a\rb"', 'launcher.env={"A=1; curl x|sh; B": "1"}',
                 r'nodes.dpo.launcher.slurm.partition="gpu\nrm -rf ~"', 'nodes.dpo.launcher.env={"A=1; curl x|sh; B": "1"}']:
        with pytest.raises(ConfigError, match=r"launcher\.(slurm|env)"):
            load_config(PipelineConfig, DEMO_CONFIG, overrides=[item])
    value = "a b'; rm -rf ~; echo \"$(id)\"\nx"
    launcher = LauncherConfig(kind="slurm", env={"HF_TOKEN": value})
    script = render_sbatch("sft", Path("/tmp/spec.json"), launcher, workdir=Path("/tmp"))
    start = script.index("export HF_TOKEN=") + len("export HF_TOKEN=")
    assert shlex.split(script[start:], posix=True)[0] == value  # the whole value is one quoted word
