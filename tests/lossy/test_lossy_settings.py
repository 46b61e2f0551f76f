"""Each lossy method owns its settings (a frozen dataclass with its paper, kvpress-style); `LossyConfig` keeps what
every method shares, still takes the summary's settings as the keyword arguments it took before, and reads and
writes the JSON it wrote before (a default config's keys in the same order: a lossless file's header holds it)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hf_kvcompress import CompressionConfig, LossyConfig
from hf_kvcompress.errors import ConfigTypeError
from hf_kvcompress.lossy import METHODS
from hf_kvcompress.lossy.methods import adakv, pyramidkv, snapkv
from hf_kvcompress.lossy.methods.summary import SummarySettings
from hf_kvcompress.lossy.region import FitContext, Region
from hf_kvcompress.lossy.registry import MethodSettings

D = 8

#: `CompressionConfig().to_json()` and two lossy configs as the code before method settings (5325df7) wrote them
DEFAULT_JSON = (
    '{"mode": "lossless", "block_tokens": 128, "residual_tokens": 0, "lossless": {"predictor": "generic", '
    '"save_predictor": "generic", "probe_layer": 8, "window": "fixed", "fixed_window": 65536, "header": "compact", '
    '"mean_steps": 4, "workers": null, "decoded_budget": 0.05, "coder": "huff"}, "lossy": {"method": "summary", '
    '"budget": 0.3, "budget_tokens": null, "entropy_threshold": 2.5, "error_tolerance": 0.05, "interval": 256, '
    '"sinks": 4, "reference_queries": 256, "kept_queries": 16, "selection": "mass", "fit_bias": true, "ridge": 0.001, '
    '"query_horizon": 512, "entry_format": "model"}}'
)
OLD_SUMMARY = {"method": "summary", "budget": 0.4, "budget_tokens": None, "entropy_threshold": 1.5,
               "error_tolerance": 0.2, "interval": 8, "sinks": 2, "reference_queries": 32, "kept_queries": 8,
               "selection": "entropy", "fit_bias": False, "ridge": 0.01, "query_horizon": 64, "entry_format": "int8"}
OLD_SNAPKV = {**OLD_SUMMARY, "method": "snapkv", "entropy_threshold": 2.5, "error_tolerance": 0.05,
              "selection": "mass", "fit_bias": True, "ridge": 0.001}


def test_every_method_owns_a_frozen_settings_dataclass_with_its_paper():
    shared = {f.name for f in dataclasses.fields(LossyConfig)}
    for name, method in METHODS.items():
        settings = method.settings()
        assert isinstance(settings, MethodSettings) and dataclasses.is_dataclass(settings)
        assert method.settings.PAPER.startswith("https://") and method.paper == method.settings.PAPER
        # written flat beside the shared fields: no name may mean two things
        assert not {f.name for f in dataclasses.fields(settings)} & shared, name
        assert LossyConfig(method=name).settings == settings
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapkv.SnapKVSettings().window = 4


def test_the_summary_keyword_arguments_of_before_still_work():
    config = LossyConfig(method="summary", selection="entropy", entropy_threshold=1.5, fit_bias=False, ridge=0.01,
                         error_tolerance=0.2)
    assert config.settings == SummarySettings(1.5, 0.2, "entropy", False, 0.01)
    assert (config.selection, config.fit_bias, config.ridge) == ("entropy", False, 0.01)
    assert config == LossyConfig(settings=SummarySettings(1.5, 0.2, "entropy", False, 0.01))
    # replace() carries them over and may change one
    assert dataclasses.replace(config, budget=0.5).settings == config.settings
    assert dataclasses.replace(config, ridge=0.5).ridge == 0.5
    # checked as before, named as given
    with pytest.raises(ValueError, match=r"LossyConfig\.ridge must lie in"):
        LossyConfig(ridge=-1.0)
    with pytest.raises(ConfigTypeError, match=r"LossyConfig\.fit_bias must be a bool"):
        LossyConfig(method="topk", fit_bias=1)
    # with another method: checked, not kept (that method never read them)
    assert LossyConfig(method="topk", fit_bias=False) == LossyConfig(method="topk")


def test_settings_of_another_method_are_refused_unless_at_their_defaults():
    with pytest.raises(ValueError, match=r"LossyConfig\.settings must be a SnapKVSettings"):
        LossyConfig(method="snapkv", settings=SummarySettings(ridge=0.5))
    # replace(config, method=...) carries the old method's default settings: the new method's defaults replace them
    assert dataclasses.replace(LossyConfig(), method="snapkv").settings == snapkv.SnapKVSettings()


@pytest.mark.parametrize(("settings", "field"), [
    (lambda: snapkv.SnapKVSettings(window=0), "SnapKVSettings.window"),
    (lambda: snapkv.SnapKVSettings(kernel=4), "SnapKVSettings.kernel"),
    (lambda: pyramidkv.PyramidKVSettings(beta=0.5), "PyramidKVSettings.beta"),
    (lambda: adakv.AdaKVSettings(safeguard=1.5), "AdaKVSettings.safeguard"),
    (lambda: SummarySettings(selection="random"), "SummarySettings.selection"),
])
def test_bad_settings_name_the_field_at_construction(settings, field):
    with pytest.raises(ValueError, match=rf"{field} "):
        settings()


def test_json_written_before_loads_and_a_default_config_writes_the_same_bytes():
    # the default config of before, but for calibrated storage by default since (issue 48: "auto")
    assert CompressionConfig().to_json() == DEFAULT_JSON.replace('"save_predictor": "generic"', '"save_predictor": "auto"')
    assert CompressionConfig.from_json(DEFAULT_JSON) == CompressionConfig(lossless={"save_predictor": "generic"})
    summary = LossyConfig.from_dict(OLD_SUMMARY)
    assert summary.settings == SummarySettings(1.5, 0.2, "entropy", False, 0.01) and summary.entry_format == "int8"
    assert summary.to_dict() == OLD_SUMMARY and list(summary.to_dict()) == list(OLD_SUMMARY)
    old = LossyConfig.from_dict(OLD_SNAPKV)  # the summary's keys at their defaults, as every config wrote them
    assert old.settings == snapkv.SnapKVSettings() and old.interval == 8
    again = LossyConfig.from_dict(old.to_dict())
    assert again == old and "ridge" not in old.to_dict() and old.to_dict()["window"] == snapkv.WINDOW
    whole = CompressionConfig(mode="lossy", lossy=old)
    assert CompressionConfig.from_json(json.dumps(whole.to_dict())) == whole


def test_a_method_setting_round_trips_flat_and_unknown_keys_are_refused():
    config = LossyConfig(method="snapkv", settings=snapkv.SnapKVSettings(window=64, kernel=5))
    data = config.to_dict()
    assert (data["window"], data["kernel"]) == (64, 5)
    assert LossyConfig.from_dict(data) == config
    # a suite entry names a method's setting flat, as it names the shared ones
    assert LossyConfig.from_dict({"method": "pyramidkv", "beta": 4.0}).settings.beta == 4.0
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['window'\]"):
        LossyConfig.from_dict({"method": "topk", "window": 64})


def test_a_method_reads_its_own_settings():
    """SnapKV's observation window and kernel, PyramidKV's beta and AdaKV's safeguard come from the config."""
    g = torch.Generator().manual_seed(1)
    keys, queries = torch.randn(1, 1, 24, D, generator=g), torch.randn(1, 1, 6, D, generator=g)
    own = snapkv.SnapKVSettings(window=2, kernel=3)
    none = torch.zeros(1, 1, 0, D)
    ctx = FitContext(queries, torch.ones(1, 1, 6), none, none, torch.zeros(1, 1, 0), 1.0, True,
                     LossyConfig(method="snapkv", settings=own), torch.arange(6), 6, None)
    region = Region(keys, torch.ones_like(keys), torch.zeros(1, 1, 24), tokens=24)
    per_entry = 2 * D * 4  # keys and values, float32, one head
    kept = snapkv.compress(region, 5 * per_entry, ctx)[0].keys
    best = snapkv.snap_scores(region, ctx, 2, 3)[0, 0].topk(5).indices.sort().values
    assert torch.equal(kept[0, 0], keys[0, 0, best])
    assert METHODS["pyramidkv"].layer_share(5, 6, pyramidkv.PyramidKVSettings(beta=2.0)) == pytest.approx(0.5)
    assert METHODS["pyramidkv"].layer_share(5, 6, pyramidkv.PyramidKVSettings()) == pytest.approx(1 / pyramidkv.BETA)


def test_the_docs_have_a_row_for_every_method_setting():
    """docs/lossy.md "Method settings": every field of every method's settings, no row for one that is gone."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "lossy.md").read_text().split("### Method settings", 1)[1]
    table = re.search(r"\| method \| settings class \| field \| default \| meaning \|\n\|---(?:\|---)*\|\n((?:\|.*\n)+)",
                      text)[1]
    documented = {name for cell in re.findall(r"^\|[^|]*\|[^|]*\| ([^|]*) \|", table, re.M)
                  for name in re.findall(r"`(\w+)`", cell)}
    declared = {f.name for method in METHODS.values() for f in dataclasses.fields(method.settings)}
    assert documented == declared


def test_pyramidkv_and_adakv_settings_extend_snapkvs():
    """PyramidKV and AdaKV select by SnapKV's scores: their settings are SnapKV's by inheritance (one declaration of
    ``window`` / ``kernel`` and their checks), plus their own field."""
    for cls, own in ((pyramidkv.PyramidKVSettings, "beta"), (adakv.AdaKVSettings, "safeguard")):
        assert issubclass(cls, snapkv.SnapKVSettings)
        assert [f.name for f in dataclasses.fields(cls)] == ["window", "kernel", own]
        assert cls().window == snapkv.WINDOW and cls().kernel == snapkv.KERNEL
        with pytest.raises(ValueError, match=rf"{cls.__name__}\.kernel must be odd"):
            cls(kernel=4)
