"""The hf-kvcompress command line: clear messages and exit codes."""

from __future__ import annotations

import pytest

from hf_kvcompress.cli import main


@pytest.fixture
def no_slow_work(monkeypatch):
    """Any model load (from_pretrained) or default-model conversion fails the test: errors must come first."""
    from hf_kvcompress import models

    def slow(*args, **kwargs):
        raise AssertionError("slow work started before the error")

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", slow)
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", slow)
    monkeypatch.setattr(models, "default_model_dir", slow)


def one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def test_unknown_model_folder_exits_2_with_one_line(tmp_path, capsys, no_slow_work):
    code = main(["demo", "--model", str(tmp_path / "missing"), "--mode", "none", "--new-tokens", "2"])
    assert code == 2
    one_line_error(capsys, "no such folder")


def test_unknown_hub_id_offline_exits_2_with_one_line(capsys, monkeypatch, no_slow_work):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["demo", "--model", "nobody/no-such-model-xyz", "--new-tokens", "2"]) == 2
    one_line_error(capsys, "'nobody/no-such-model-xyz' is not in the hub's cache and HF_HUB_OFFLINE is set")


def test_unreachable_hub_is_one_request_and_one_line(capsys, monkeypatch, no_slow_work):
    """No network: one `model_info` call fails at once, instead of a minute of from_pretrained's retries."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    calls = []

    def unreachable(repo_id, **kwargs):
        calls.append(repo_id)
        raise ConnectionError("[Errno -2] Name or service not known")  # what the hub's HTTP client raises, in kind

    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)
    assert main(["demo", "--model", "nobody/no-such-model-xyz", "--new-tokens", "2"]) == 2
    assert calls == ["nobody/no-such-model-xyz"]
    one_line_error(capsys, "cannot reach the Hugging Face hub", "not in the hub's cache")


@pytest.mark.parametrize("dataset", ["/no/such/texts", "./missing.txt", "nothing-*.jsonl"])
def test_missing_dataset_path_fails_before_the_model_loads(tmp_path, capsys, monkeypatch, no_slow_work, dataset):
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--dataset", dataset, "--new-tokens", "2"]) == 2
    one_line_error(capsys, f"dataset {dataset!r}: no such file or folder")


def test_unwritable_calibration_folder_fails_before_the_model_loads(tmp_path, capsys, no_slow_work):
    (tmp_path / "a-file").write_text("")
    assert main(["calibrate", "--out", str(tmp_path / "a-file" / "cal")]) == 2
    one_line_error(capsys, "cannot write to calibration folder")


def test_bad_subcommand_is_rejected(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2


@pytest.mark.real_model
def test_demo_runs_on_the_default_model(capsys, monkeypatch):
    monkeypatch.setenv("HF_KVCOMPRESS_THREADS", "2")
    code = main(["demo", "--mode", "none", "--prompt-tokens", "64", "--new-tokens", "8"])
    out = capsys.readouterr().out
    assert code == 0
    assert "threads: 1 torch thread(s), 2 codec worker(s) (2 cores: HF_KVCOMPRESS_THREADS)" in out  # the plan it ran
    assert "identical_to_DynamicCache: True" in out
    assert "compression_ratio" in out


def test_version_names_the_library_and_what_it_runs_on(capsys):
    from hf_kvcompress import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"hf-kvcompress {__version__} (transformers ") and "torch " in out
