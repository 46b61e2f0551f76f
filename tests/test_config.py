"""CompressionConfig: validated at construction, errors name the field, JSON round trip."""

from __future__ import annotations

import pytest

from hf_kvcompress import CompressionConfig, LosslessConfig, LossyConfig
from hf_kvcompress.codec import CodecConfig
from hf_kvcompress.codec.codec_config import HEADERS, MAX_WINDOW, MEAN_STEPS, WINDOW_MODES
from hf_kvcompress.threads import MAX_WORKERS
from hf_kvcompress.validation import ConfigTypeError


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


@pytest.mark.parametrize(("make", "field"), [
    (lambda: LosslessConfig(fixed_window=64.0), "LosslessConfig.fixed_window"),
    (lambda: LossyConfig(interval="256"), "LossyConfig.interval"),
    (lambda: LossyConfig(fit_bias=1), "LossyConfig.fit_bias"),
    (lambda: CodecConfig(fixed_window=64.0), "CodecConfig.fixed_window"),
    (lambda: CodecConfig(tau_smooth="0.1"), "CodecConfig.tau_smooth"),
])
def test_a_wrong_type_is_one_error_for_every_config(make, field):
    """Every config reports a wrong type the same way: a `ConfigTypeError`, which is a TypeError (what the codec
    always raised) and a ValueError (what CompressionConfig's errors are documented as)."""
    with pytest.raises(ConfigTypeError, match=field.replace(".", r"\.") + " must be") as err:
        make()
    assert isinstance(err.value, TypeError) and isinstance(err.value, ValueError)


def test_lossless_codec_fields_take_the_codecs_choices_and_bounds():
    """The fields LosslessConfig shares with CodecConfig are validated by CodecConfig: whatever the codec accepts
    is accepted (and becomes that CodecConfig), whatever it refuses is refused, named as LosslessConfig's field."""
    for window in WINDOW_MODES:
        config = LosslessConfig(window=window, coder="ans")
        assert config.codec_config() == CodecConfig(window=window, coder="ans", fixed_window=65536,
                                                    header="compact", mean_steps=4)
    for steps in MEAN_STEPS:
        assert LosslessConfig(mean_steps=steps).codec_config().mean_steps == steps
    for header in HEADERS:
        assert LosslessConfig(header=header).codec_config().header == header
    assert LosslessConfig(fixed_window=MAX_WINDOW, coder="ans").fixed_window == MAX_WINDOW
    assert LosslessConfig(fixed_window=1, coder="ans").fixed_window == 1
    with pytest.raises(ValueError, match=rf"LosslessConfig\.fixed_window must lie in \[1, {MAX_WINDOW}\]"):
        LosslessConfig(fixed_window=MAX_WINDOW + 1)
    with pytest.raises(ValueError, match=r"LosslessConfig\(coder='huff'\).*window must be 'fixed'"):
        LosslessConfig(window="metadata")


def test_lossless_defaults_and_their_json_form_are_unchanged():
    """Saved caches embed this dict: its keys, order and default values are part of the file format (the default
    ``save_predictor`` became ``"auto"``, calibrated storage, on 2026-12-07: issue 48)."""
    assert LosslessConfig().to_dict() == {
        "predictor": "generic", "save_predictor": "auto", "probe_layer": 8, "window": "fixed",
        "fixed_window": 65536, "header": "compact", "mean_steps": 4, "workers": None, "decoded_budget": 0.05,
        "coder": "huff"}  # the generation coder (files record it: older ones load as they were)


def test_the_docs_have_a_row_for_every_config_field():
    """docs/lossless.md has a field table for `CompressionConfig` and `LosslessConfig`, docs/lossy.md one for
    `LossyConfig`: every field (``budget``, an init-only shortcut, included), no row for a field that is gone."""
    import dataclasses
    import re
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs"

    def rows(page: str, heading: str) -> list[str]:
        text = (docs / page).read_text().split(heading, 1)[1]
        table = re.search(r"\| field \| default \| meaning \|\n\|---\|---\|---\|\n((?:\|.*\n)+)", text)
        return re.findall(r"^\| `(\w+)` \|", table[1], re.M)

    def fields(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    assert rows("lossless.md", "`CompressionConfig`:\n") == [*fields(CompressionConfig), "budget"]  # + the InitVar
    assert sorted(rows("lossless.md", "`LosslessConfig`:\n")) == sorted(fields(LosslessConfig))
    assert sorted(rows("lossy.md", "## Configuration (`LossyConfig`)")) == sorted(fields(LossyConfig))


def test_a_fresh_process_knows_every_lossy_method():
    """The package's names load lazily: a config built first thing in a new process (nothing else imported) still
    knows every registered method (the registry is filled by importing the config, not by importing the cache)."""
    import subprocess
    import sys

    code = ("from hf_kvcompress import LossyConfig; from hf_kvcompress.lossy import METHODS; "
            "print(LossyConfig(method='topk').method, len(METHODS))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    name, count = done.stdout.split()
    assert name == "topk" and int(count) >= 10


@pytest.mark.parametrize("workers", [2**40, MAX_WORKERS + 1])
def test_workers_beyond_the_bound_are_refused_at_construction(workers):
    """Each worker is a thread or process started for every block batch: an absurd count must fail here, naming
    the field and the bound, not later in generate() starting its threads (issue 47)."""
    with pytest.raises(ValueError, match=rf"LosslessConfig.workers must lie in \[1, {MAX_WORKERS}\], got {workers}"):
        LosslessConfig(workers=workers)
    assert LosslessConfig(workers=MAX_WORKERS).workers == MAX_WORKERS


def test_lossless_config_remembers_an_automatic_coder():
    """``coder=None`` becomes the predictor's coder and the config says it was chosen so; a named coder is not;
    to_dict writes the coder chosen (files keep their bytes), so a config read back names it."""
    auto = LosslessConfig()
    assert auto.coder == "huff" and auto.coder_auto
    named = LosslessConfig(coder="huff")
    assert named == auto and not named.coder_auto
    back = LosslessConfig.from_dict(auto.to_dict())
    assert back.coder == "huff" and not back.coder_auto
