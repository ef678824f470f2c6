"""The whole suite runs apart from the user's own Prefect and MLflow: before anything imports
prefect, PREFECT_HOME points at a directory of this test session (so the ephemeral API servers
the tests start keep their database there, not in ~/.prefect, and no test run appears in the
user's UI), and no PREFECT_API_URL / MLFLOW_TRACKING_URI / PREFECT_PROFILE of the user's shell
reaches a test. A test that needs a server of its own sets these itself.

The repository root is on no process's import path: its `kernels/` folder (installed as
posttrain.kernels) would shadow Hugging Face's `kernels`, which transformers imports. The tests
import one another as `tests.<module>` (and the ranks of a launched stage import test stages such
as `tests.support.probe_stage`) through a directory of this session that holds only a `tests` link to
tests/; it is first on sys.path here and, with tests/ itself, on PYTHONPATH for every process a
test starts. PYTHONSAFEPATH=1 keeps those processes from putting their working directory (the
root, unless a test chose another) or their script's directory first on sys.path.

The tiers (docs/testing.md): tests/support/tier_guard.py fails a test without the `slow` mark that starts
a process or listens on a socket."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPORTS = Path(tempfile.mkdtemp(prefix="posttrain-tests-path-"))
(IMPORTS / "tests").symlink_to(ROOT / "tests", target_is_directory=True)


def _not_root(entry: str) -> bool:
    return Path(entry or ".").resolve() != ROOT


sys.path[:] = [str(IMPORTS), *filter(_not_root, sys.path)]
os.environ["PYTHONPATH"] = os.pathsep.join([str(IMPORTS), str(ROOT / "tests"), *(
    p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and _not_root(p))])
os.environ["PYTHONSAFEPATH"] = "1"

from tests.support.tier_guard import _fast_tier_starts_no_process, pytest_runtest_makereport  # noqa: F401

# Under pytest-xdist (`make test` runs its workers side by side, scripts/run_tests.py) each worker, and
# every process it starts, computes on one thread unless the user chose otherwise: two workers each
# with torch's pool of one thread per core would spin against each other on two cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

_HOME = tempfile.mkdtemp(prefix="posttrain-tests-prefect-")
os.environ["PREFECT_HOME"] = _HOME
for _var in ("PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_PROFILE", "MLFLOW_TRACKING_URI"):
    os.environ.pop(_var, None)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


# The costliest files (docs/testing.md), started first: pytest-xdist hands whole files to its
# workers in collection order, so a long file left to the end would run alone on one core.
FIRST = ["tests/flows/test_chaos.py", "tests/flows/test_demo_teaches.py", "tests/flows/test_ui_browser.py",
         "tests/flows/test_pipeline_e2e.py", "tests/flows/test_user_dag.py", "tests/stages/test_stage_parallel.py",
         "tests/test_wheel.py", "tests/core/test_disaggregated.py"]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(os.path.relpath(item.path, ROOT), len(FIRST)))


def pytest_unconfigure(config):
    shutil.rmtree(_HOME, ignore_errors=True)
    shutil.rmtree(IMPORTS, ignore_errors=True)
