"""Suite files: the built-in suites load, every mistake is a `SuiteError` naming the key."""

from __future__ import annotations

import pytest

from hf_kvcompress_eval import BUILTIN_SUITES, SuiteError, load_suite, parse_suite


@pytest.mark.parametrize("name", BUILTIN_SUITES)
def test_builtin_suites_load(name):
    suite = load_suite(name)
    assert suite.name == name
    assert suite.lossless.enabled and suite.generation.enabled and suite.lossy.enabled
    assert "context" in suite.calibration_predictors()
    assert suite.to_dict()["model"]["dtype"] == "bfloat16"


def test_quick_is_smaller_than_full():
    quick, full = load_suite("quick"), load_suite("full")
    assert quick.evaluation_tokens() < full.evaluation_tokens()
    assert set(quick.calibration_predictors()) < set(full.calibration_predictors())
    assert any(label == "summary-seed" for label, _ in full.lossy_methods())


def test_empty_suite_takes_the_defaults():
    suite = parse_suite("")
    assert suite.lossless.predictors == ["generic", "none", "context"]
    assert suite.lossy.budgets == [0.25, 0.5]


def test_user_suite_from_a_path(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('name = "mine"\n[model]\nname = "some/model"\n[lossy]\nbudgets = [0.1]\n')
    suite = load_suite(str(path))
    assert (suite.name, suite.model.name, suite.lossy.budgets) == ("mine", "some/model", [0.1])
    assert suite.origin == str(path.resolve())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[lossy]\nbudget = [0.1]\n", "unknown key(s) ['budget'] in [lossy]"),
        ("colour = 1\n", "unknown key(s) ['colour'] in the top level"),
        ("[lossless]\ntokens = 'many'\n", "lossless.tokens must be an integer"),
        ("[lossless]\npredictors = ['magic']\n", "lossless.predictors"),
        ("[lossless]\nwindows = ['fixed-x']\n", "lossless.windows"),
        ("[lossy]\nbudgets = [1.5]\n", "lossy.budgets"),
        ("[lossy]\nquantized = ['quanto-3']\n", "lossy.quantized"),
        ("[lossy]\nmethods = ['magic']\n", "LossyConfig.method"),
        ("[lossy]\nmethods = [{ name = 'x', method = 'summary', colour = 1 }]\n", "unknown field"),
        ("[lossy]\nmethods = ['topk', 'topk']\n", "two methods named 'topk'"),
        ("[model]\ndtype = 'int8'\n", "model.dtype"),
        ("[calibration]\ntokens = 10\nchunk = 64\n", "calibration.tokens"),
        ("lossy = 3\n", "[lossy] must be a table"),
        ("[lossy\n", "not valid TOML"),
    ],
)
def test_mistakes_name_the_key(text, message):
    with pytest.raises(SuiteError) as err:
        parse_suite(text, "mine.toml")
    assert message in str(err.value)
    assert str(err.value).startswith("mine.toml")


def test_unknown_suite_name_lists_the_builtin_ones():
    with pytest.raises(SuiteError, match=r"unknown suite 'quik'.*'quick', 'full'"):
        load_suite("quik")


def test_missing_suite_file():
    with pytest.raises(SuiteError, match="cannot read suite file"):
        load_suite("/nonexistent/suite.toml")
