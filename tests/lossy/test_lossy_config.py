"""LossyConfig validation: bad values fail with the field's name; dict/JSON round trips keep budget's type."""

from __future__ import annotations

import pytest

from hf_kvcompress import CompressionConfig, LossyConfig

BAD = [
    ("method", "h2o"),
    ("budget", 0.0),
    ("budget", 1.5),
    ("budget", 0),
    ("budget", -3),
    ("budget", True),
    ("budget", "0.3"),
    ("entropy_threshold", -1.0),
    ("error_tolerance", 0.0),
    ("interval", 0),
    ("sinks", -1),
    ("reference_queries", 0),
    ("selection", "random"),
    ("fit_bias", 1),
    ("ridge", -0.1),
    ("query_horizon", -5),
]


@pytest.mark.parametrize(("field", "value"), BAD)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"LossyConfig.{field} "):
        LossyConfig(**{field: value})


@pytest.mark.parametrize("budget", [0.25, 1.0, 512])
def test_round_trip_keeps_budget_type(budget):
    config = CompressionConfig(mode="lossy", lossy=LossyConfig(method="topk", budget=budget, fit_bias=False))
    again = CompressionConfig.from_json(config.to_json())
    assert again == config
    assert type(again.lossy.budget) is type(budget)
    assert LossyConfig.from_dict(config.lossy.to_dict()) == config.lossy
