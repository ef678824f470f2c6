"""`posttrain bench sft` without transformers/peft installed: it stops at once, naming the missing
package and the install command, instead of a ModuleNotFoundError from a forkserver child."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test runs the benchmark CLI as a process


# Makes `name` (and its submodules) unimportable, as if it were not installed.
BLOCKER = textwrap.dedent("""
    import sys

    class _Block:
        def __init__(self, names):
            self.names = set(names)

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.names:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _Block(BLOCKED))
""")


def _write_blocker(tmp_path: Path, blocked: list[str]) -> Path:
    """A sitecustomize that installs the blocker in every Python process started with it on the
    path, so it also holds in the subprocess `posttrain bench` starts."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.replace("BLOCKED", repr(blocked)))
    return site


def _run(tmp_path: Path, blocked: list[str], argv: list[str]) -> subprocess.CompletedProcess:
    site = _write_blocker(tmp_path, blocked)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ["PYTHONPATH"]])}
    return subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("blocked", [["peft"], ["transformers", "peft"]])
def test_bench_sft_names_missing_package(tmp_path, blocked):
    proc = _run(tmp_path, blocked, ["-m", "posttrain.benchmarks.sft", "--quick"])
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout == ""  # no JSON, no work
    err = proc.stderr
    assert "Traceback" not in err, err
    assert f"not installed: {', '.join(blocked)}" in err, err
    assert "pip install 'posttrain[bench]'" in err, err
    if blocked == ["peft"]:
        assert "transformers," not in err  # only what is missing is named


def test_cli_bench_sft_fails_fast(tmp_path):
    proc = _run(tmp_path, ["peft"], ["-m", "posttrain.flows.cli", "bench", "sft", "--quick"])
    assert proc.returncode != 0
    assert "not installed: peft" in proc.stderr and "pip install 'posttrain[bench]'" in proc.stderr, proc.stderr
    assert "[bench sft] rep" not in proc.stderr  # nothing was measured


def test_blocker_really_blocks(tmp_path):
    """The check above is only meaningful if the blocker hides an installed peft."""
    pytest.importorskip("peft")
    proc = _run(tmp_path, ["peft"], ["-c", "import peft"])
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


def test_bench_dpo_names_missing_trl(tmp_path):
    proc = _run(tmp_path, ["trl"], ["-m", "posttrain.benchmarks.dpo", "--quick"])
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "not installed: trl" in proc.stderr, proc.stderr
    assert "pip install 'posttrain[bench]'" in proc.stderr, proc.stderr


def test_bench_distill_names_missing_trl(tmp_path):
    proc = _run(tmp_path, ["trl"], ["-m", "posttrain.benchmarks.distill", "--quick"])
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "not installed: trl" in proc.stderr, proc.stderr
    assert "pip install 'posttrain[bench]'" in proc.stderr, proc.stderr


def test_bench_qlora_names_missing_bitsandbytes(tmp_path):
    proc = _run(tmp_path, ["bitsandbytes"], ["-m", "posttrain.flows.cli", "bench", "qlora", "--quick"])
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "not installed: bitsandbytes" in proc.stderr, proc.stderr
    assert "pip install 'posttrain[bench]'" in proc.stderr, proc.stderr
