"""The predictor registry: every list of predictor names derives from it, make_predictor checks what a
predictor's traits say it needs, and the coder and the calibration fit share one surprise recursion."""

from __future__ import annotations

import pytest
import torch

from hf_kvcompress import codec
from hf_kvcompress.calibration import FIRST_USE_PREDICTORS, Calibration
from hf_kvcompress.cli import build_parser
from hf_kvcompress.codec import CodecConfig
from hf_kvcompress.config import LosslessConfig
from hf_kvcompress.predictors import linear, registry
from hf_kvcompress.predictors.base import REGISTERED, Predictor, register


def test_every_name_list_is_the_registrys():
    # the built-in ones, in name order (a new predictor module joins every list with nothing else to change)
    assert {"context", "framed", "generic", "none", "probe", "self", "twin"} <= set(registry.NAMES)
    assert list(registry.NAMES) == sorted(registry.NAMES)
    assert LosslessConfig.PREDICTORS == registry.NAMES
    assert LosslessConfig.STORAGE_ONLY == registry.STORAGE_ONLY and {"probe", "twin"} <= set(registry.STORAGE_ONLY)
    assert not {"context", "generic", "none", "framed", "self"} & set(registry.STORAGE_ONLY)
    assert {"context", "none", "probe", "twin"} <= set(registry.FITTED)
    assert not {"generic", "framed", "self"} & set(registry.FITTED)
    assert Calibration.fit.__kwdefaults__["predictors"] == registry.FITTED
    calibrate = build_parser().parse_args(["calibrate"])
    assert calibrate.predictors == registry.FITTED  # "all", converted by the option's type at parse time



def test_the_first_use_fit_and_each_coder_come_from_the_registry():
    # a first-use calibration fits what calibrated storage reads (grid reads below's heads), not a list of its own
    assert FIRST_USE_PREDICTORS == registry.FIRST_USE == (registry.head_set(registry.CALIBRATED_STORAGE),)
    assert registry.FIRST_USE == ("below",)
    # the coder is each predictor's trait: the default config takes generation's default predictor's
    for name, cls in registry.PREDICTORS.items():
        assert {cls.coder, cls.storage_coder} <= set(codec.CODERS), name
        if name not in registry.STORAGE_ONLY:
            assert LosslessConfig(predictor=name).coder == cls.coder
    assert LosslessConfig().coder == registry.PREDICTORS["generic"].coder == codec.GENERATION_CODER == "huff"
    assert CodecConfig().coder == Predictor.coder == Predictor.storage_coder == codec.DEFAULT_CODER == "lanes"


def test_one_module_per_predictor_and_names_match():
    modules = [cls.__module__ for cls in registry.PREDICTORS.values()]
    assert len(set(modules)) == len(modules), modules
    for name, cls in registry.PREDICTORS.items():
        assert issubclass(cls, Predictor) and cls.name == name
        assert cls.practical_in_generation or cls.needs_model  # storage-only because it reruns the model


@pytest.mark.parametrize("name", registry.NAMES)
def test_make_predictor_checks_the_traits(name):
    cls = registry.PREDICTORS[name]
    if cls.needs_model:
        with pytest.raises(ValueError, match="reruns the model"):
            registry.make_predictor(name, calibration=object())
    if cls.needs_calibration:
        with pytest.raises(ValueError, match="needs a calibration"):
            registry.make_predictor(name, model=torch.nn.Linear(1, 1))
    if not cls.needs_model and not cls.needs_calibration:
        assert type(registry.make_predictor(name)) is cls


def test_unknown_names_are_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown predictor 'nope'.*'generic'"):
        registry.make_predictor("nope")
    with pytest.raises(ValueError, match=r"LosslessConfig\.predictor must be one of"):
        LosslessConfig(predictor="nope")
    with pytest.raises(ValueError, match="storage only"):
        LosslessConfig(predictor=registry.STORAGE_ONLY[0])
    with pytest.raises(ValueError, match=r"unknown predictor\(s\) \['generic'\]"):
        Calibration.fit(torch.nn.Linear(1, 1), None, predictors=("generic",))


def test_surprise_is_the_clamped_rms_of_standardised_errors():
    torch.manual_seed(0)
    below = torch.rand(2, 5) * 20
    tracker = linear.Surprise(below)
    assert torch.equal(tracker.current((2, 5)), below.clamp(*linear.SURPRISE_RANGE))
    assert torch.equal(linear.Surprise(None).current((2, 5)), torch.ones(2, 5))
    zs = [torch.randn(2, 5, 8) * scale for scale in (0.01, 1.0, 30.0)]
    for i, z in enumerate(zs):
        tracker.add(z)
        rms = torch.stack([x.square().mean(dim=-1) for x in zs[: i + 1]]).mean(dim=0).sqrt()
        assert torch.allclose(tracker.current((2, 5)), rms.clamp(*linear.SURPRISE_RANGE), rtol=1e-6)
    low, high = linear.SURPRISE_RANGE
    assert tracker.current((2, 5)).min() >= low and tracker.current((2, 5)).max() <= high


def test_a_name_registered_twice_is_refused():
    class Again(Predictor):
        name = "generic"

        def session(self, inputs):
            raise NotImplementedError

    with pytest.raises(ValueError, match="'generic' is registered twice"):
        register(Again)
    assert REGISTERED["generic"] is registry.PREDICTORS["generic"] is not Again


def test_a_predictor_with_history_declares_itself_self_fitting():
    """The block codec asks `history` only of `Predictor.self_fitting` predictors (and decodes a layer's blocks
    together only for the others): a predictor that fits on the cache's blocks must say so."""
    for name, cls in registry.PREDICTORS.items():
        fits = cls.history is not Predictor.history or cls.absorb is not Predictor.absorb
        assert cls.self_fitting == fits, name


def test_predictor_settings_are_the_predictors_own():
    """``probe_layer`` is `ProbeSettings`' (declared once: default and check), as a lossy method's settings are its
    `MethodSettings`: `LosslessConfig.probe_layer` exposes it, `make_predictor` and `build` take settings, no
    ``probe_layer`` argument (issue 51)."""
    import dataclasses
    import inspect
    from types import SimpleNamespace

    from hf_kvcompress.predictors.base import PredictorSettings
    from hf_kvcompress.predictors.probe import ProbePredictor, ProbeSettings
    from hf_kvcompress.predictors.rope import RopeFrame

    assert registry.PREDICTORS["probe"].settings is ProbeSettings
    assert LosslessConfig().probe_layer == ProbeSettings().probe_layer == 8
    config_fields = {f.name for f in dataclasses.fields(LosslessConfig)}
    for name, cls in registry.PREDICTORS.items():  # a config sets every predictor's settings by field name
        assert issubclass(cls.settings, PredictorSettings), name
        assert {f.name for f in dataclasses.fields(cls.settings)} <= config_fields, name
        assert "probe_layer" not in inspect.signature(cls.build).parameters, name
    assert "probe_layer" not in inspect.signature(registry.make_predictor).parameters
    # the same check, each naming its owner
    with pytest.raises(ValueError, match=r"LosslessConfig\.probe_layer must be >= 1, got 0"):
        LosslessConfig(probe_layer=0)
    with pytest.raises(ValueError, match=r"ProbeSettings\.probe_layer must be >= 1, got 0"):
        registry.settings_for("probe", {"probe_layer": 0})
    # from a config's dict or a header's object: its own fields taken, the rest ignored, defaults where absent
    assert registry.settings_for("probe", LosslessConfig(probe_layer=3).to_dict()) == ProbeSettings(3)
    assert registry.settings_for("probe", {"name": "probe"}) == ProbeSettings(8)
    assert type(registry.settings_for("generic", {"probe_layer": 3})) is PredictorSettings
    assert LosslessConfig(probe_layer=3).predictor_settings() == PredictorSettings()  # generation's "generic"
    calibration = SimpleNamespace(rope_frame=lambda: RopeFrame(None))
    model = torch.nn.Linear(1, 1)
    built = registry.make_predictor("probe", calibration=calibration, model=model, settings=ProbeSettings(3))
    assert isinstance(built, ProbePredictor) and built.k == 3
    assert registry.make_predictor("probe", calibration=calibration, model=model).k == 8  # None: the defaults
    with pytest.raises(TypeError, match="the probe predictor's settings are a ProbeSettings, got PredictorSettings"):
        registry.make_predictor("probe", calibration=calibration, model=model, settings=PredictorSettings())
