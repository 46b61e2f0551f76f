"""LossyConfig validation: bad values fail with the field's name; dict/JSON round trips keep the budget."""

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
    ("budget_tokens", 0),
    ("budget_tokens", 2.5),
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


@pytest.mark.parametrize("budget", [{"budget": 0.25}, {"budget": 1.0}, {"budget_tokens": 512}])
def test_round_trip_keeps_the_budget(budget):
    config = CompressionConfig(mode="lossy", lossy=LossyConfig(method="topk", fit_bias=False, **budget))
    again = CompressionConfig.from_json(config.to_json())
    assert again == config
    assert {k: getattr(again.lossy, k) for k in budget} == budget
    assert LossyConfig.from_dict(config.lossy.to_dict()) == config.lossy


@pytest.mark.parametrize("count", [1, 30, 512])
def test_an_int_budget_is_refused_with_a_pointer_to_budget_tokens(count):
    with pytest.raises(ValueError, match=rf"LossyConfig\.budget .*got the int {count}.*budget_tokens={count}"):
        LossyConfig(budget=count)


def test_old_json_with_an_int_budget_names_the_new_field():
    old = CompressionConfig(mode="lossy").to_dict()
    old["lossy"]["budget"] = 512
    del old["lossy"]["budget_tokens"]  # written before the field existed
    with pytest.raises(ValueError, match="budget_tokens=512"):
        CompressionConfig.from_dict(old)


def test_budget_and_budget_tokens_are_alternatives():
    assert LossyConfig().budget == 0.3 and LossyConfig().budget_tokens is None
    assert LossyConfig(budget_tokens=64).budget is None
    with pytest.raises(ValueError, match=r"LossyConfig\.budget and budget_tokens are alternatives"):
        LossyConfig(budget=0.5, budget_tokens=64)


def test_top_level_budget_fills_the_lossy_budget():
    config = CompressionConfig(mode="lossy", budget=0.25)
    assert config.lossy.budget == 0.25 and config.budget == 0.25
    assert config == CompressionConfig(mode="lossy", lossy=LossyConfig(budget=0.25))
    assert CompressionConfig.from_json(config.to_json()) == config
    assert CompressionConfig.from_dict({"mode": "lossy", "budget": 0.5}).lossy.budget == 0.5
    # the same value given both ways is not a conflict; a lossy config without a budget takes the shortcut's
    assert CompressionConfig(mode="lossy", budget=0.5, lossy={"budget": 0.5}).lossy.budget == 0.5
    assert CompressionConfig(mode="lossy", budget=0.5, lossy=LossyConfig(method="topk")).lossy.method == "topk"
    assert CompressionConfig().budget is None


@pytest.mark.parametrize("mode", ["none", "lossless"])
def test_top_level_budget_is_refused_outside_lossy_mode(mode):
    with pytest.raises(ValueError, match=f"CompressionConfig.budget applies to mode='lossy' only.*mode='{mode}'"):
        CompressionConfig(mode=mode, budget=0.3)


@pytest.mark.parametrize("lossy", [{"budget": 0.5}, LossyConfig(budget=0.3), {"budget_tokens": 40}])
def test_conflicting_budgets_are_refused(lossy):
    with pytest.raises(ValueError, match=r"CompressionConfig\.budget .*conflicts with lossy\.budget"):
        CompressionConfig(mode="lossy", budget=0.25, lossy=lossy)


def test_top_level_int_budget_is_refused():
    with pytest.raises(ValueError, match=r"CompressionConfig\.budget .*int 1;.*budget_tokens=1\).*1\.0"):
        CompressionConfig(mode="lossy", budget=1)
