"""CompressionConfig: validated at construction, errors name the field, JSON round trip."""

from __future__ import annotations

import pytest

from hf_kvcompress import CompressionConfig, LosslessConfig, LossyConfig


def test_defaults_and_json_round_trip():
    config = CompressionConfig(mode="lossy", lossy={"budget": 0.25, "method": "topk"})
    assert isinstance(config.lossy, LossyConfig)
    assert config.lossy.budget == 0.25
    again = CompressionConfig.from_json(config.to_json())
    assert again == config
    assert CompressionConfig.from_dict(CompressionConfig().to_dict()) == CompressionConfig()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mode": "zip"}, "CompressionConfig.mode"),
        ({"block_tokens": -4}, "CompressionConfig.block_tokens"),
        ({"block_tokens": 0}, "CompressionConfig.block_tokens"),
        ({"residual_tokens": -1}, "CompressionConfig.residual_tokens"),
        ({"block_tokens": 2.5}, "CompressionConfig.block_tokens"),
        ({"lossless": {"predictor": "oracle"}}, "LosslessConfig.predictor"),
        ({"lossless": {"window": "huge"}}, "LosslessConfig.window"),
        ({"lossless": {"fixed_window": 70000}}, "LosslessConfig.fixed_window"),
        ({"lossless": {"header": "tiny"}}, "LosslessConfig.header"),
        ({"lossless": {"mean_steps": 3}}, "LosslessConfig.mean_steps"),
        ({"lossy": {"budget": 1.5}}, "LossyConfig.budget"),
        ({"lossy": {"budget": 0.0}}, "LossyConfig.budget"),
        ({"lossy": {"budget": -3}}, "LossyConfig.budget"),
        ({"lossy": {"error_tolerance": 0}}, "LossyConfig.error_tolerance"),
        ({"lossy": {"method": "magic"}}, "LossyConfig.method"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        CompressionConfig(**kwargs)


def test_unknown_keys_and_bad_json_are_rejected():
    with pytest.raises(ValueError, match="unknown field"):
        CompressionConfig.from_dict({"mode": "none", "colour": "red"})
    with pytest.raises(ValueError, match="not valid JSON"):
        CompressionConfig.from_json("{mode: none")
    with pytest.raises(ValueError, match="LosslessConfig"):
        CompressionConfig(lossless=3)


@pytest.mark.parametrize("predictor", ["probe", "twin"])
def test_model_running_predictors_are_refused_for_generation(predictor):
    with pytest.raises(ValueError, match=rf"LosslessConfig\.predictor cannot be '{predictor}'.*storage only.*"
                                         rf"save_predictor='{predictor}'.*cache\.save\(path, predictor='{predictor}'\)"):
        LosslessConfig(predictor=predictor)
    assert LosslessConfig(save_predictor=predictor).save_predictor == predictor  # storage is where they belong


def test_sub_configs_are_frozen():
    config = LosslessConfig()
    with pytest.raises(AttributeError):
        config.predictor = "twin"  # type: ignore[misc]
