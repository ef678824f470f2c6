"""Promotion to champion (posttrain.registry.mlflow_registry.should_promote): past the floors first (beat
the model the candidate was trained from, reach min_score), then beat the champion."""

from __future__ import annotations

import math

import pytest

from posttrain.registry.mlflow_registry import should_promote


def test_no_champion_is_not_enough_below_the_floors():
    assert should_promote(0.0, None, True, 0.0, baseline=0.0)[0] is False  # exact match 0 does not become champion
    assert should_promote(0.4, None, True, 0.0, baseline=0.3)[0] is True
    assert should_promote(0.4, None, True, 0.0, baseline=0.3, min_score=0.5) == (
        False, "below min_score (0.4 vs 0.5)")
    assert should_promote(math.nan, None, True, 0.0)[0] is False
    assert should_promote(0.4, None, True, 0.0, baseline=math.nan)[0] is True  # a baseline without the metric


def test_then_the_champion_by_min_delta_in_either_direction():
    assert should_promote(0.5, 0.45, True, 0.1) == (False, "does not beat the champion by min_delta (0.5 vs 0.45)")
    assert should_promote(0.6, 0.45, True, 0.1)[0] is True
    # lower is better (perplexity): beat the baseline and the champion downwards
    assert should_promote(2.0, 3.0, False, 0.5, baseline=4.0)[0] is True
    assert should_promote(2.8, 3.0, False, 0.5, baseline=4.0)[0] is False
    assert should_promote(4.5, None, False, 0.0, baseline=4.0)[0] is False


def test_a_named_baseline_must_be_a_node():
    from posttrain.core.config import ConfigError, load_config
    from posttrain.flows.config import PipelineConfig
    from tests.support.pipelines import DEMO_CONFIG

    with pytest.raises(ConfigError, match=r"registry\.baseline: 'nobody' is not a node"):
        load_config(PipelineConfig, DEMO_CONFIG, ["registry.baseline=nobody"])
    assert load_config(PipelineConfig, DEMO_CONFIG, ["registry.baseline=student"]).registry.baseline == "student"
