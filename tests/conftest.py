"""The whole suite runs apart from the user's own Prefect and MLflow: before anything imports
prefect, PREFECT_HOME points at a directory of this test session (so the ephemeral API servers
the tests start keep their database there, not in ~/.prefect, and no test run appears in the
user's UI), and no PREFECT_API_URL / MLFLOW_TRACKING_URI / PREFECT_PROFILE of the user's shell
reaches a test. A test that needs a server of its own sets these itself.

The tiers (docs/testing.md): tests/tier_guard.py fails a test without the `slow` mark that starts
a process or listens on a socket."""

from __future__ import annotations

import os
import shutil
import tempfile

from tests.tier_guard import _fast_tier_starts_no_process, pytest_runtest_makereport  # noqa: F401

_HOME = tempfile.mkdtemp(prefix="posttrain-tests-prefect-")
os.environ["PREFECT_HOME"] = _HOME
for _var in ("PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_PROFILE", "MLFLOW_TRACKING_URI"):
    os.environ.pop(_var, None)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def pytest_unconfigure(config):
    shutil.rmtree(_HOME, ignore_errors=True)
