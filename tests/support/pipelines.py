"""The pipeline config tests load: a fixed copy of the demo's DAG (tests/support/configs/pipeline.yaml), so
that tuning configs/demo.yaml does not move what the loader's tests expect."""

from pathlib import Path

DEMO_CONFIG = Path(__file__).resolve().parent / "configs" / "pipeline.yaml"
