"""The suite's Prefect and MLflow state stays out of the user's (tests/conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path


def test_prefect_home_is_the_sessions_not_the_users():
    from prefect.settings import get_current_settings

    home = Path(get_current_settings().home).resolve()
    assert home == Path(os.environ["PREFECT_HOME"]).resolve()
    assert home != (Path.home() / ".prefect").resolve() and home.name.startswith("posttrain-tests-prefect-")
    assert get_current_settings().api.url is None  # the ephemeral API, never a server of the user's
    assert "MLFLOW_TRACKING_URI" not in os.environ
