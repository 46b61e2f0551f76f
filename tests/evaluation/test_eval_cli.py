"""`hf-kvcompress eval`: a whole suite on a tiny random model, and one clear line (exit 2) for every mistake."""

from __future__ import annotations

import json

import pytest

from hf_kvcompress.cli import main


def run_eval(capsys, *args):
    code = main(["eval", "--no-progress", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code, err, needle):
    assert code == 2
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("hf-kvcompress eval: error:")]
    assert len(lines) == 1, err
    assert needle in lines[0], err


def test_tiny_suite_writes_json_markdown_and_plots(tiny_suite, tmp_path, capsys):
    out = tmp_path / "results"
    code, stdout, err = run_eval(capsys, "--suite", tiny_suite(), "--out", str(out))
    assert code == 0, err
    for name in ("results.json", "report.md", "quality_vs_memory.png", "bits_per_layer.png", "window_histogram.png"):
        assert (out / name).is_file(), name
    results = json.loads((out / "results.json").read_text())
    assert results["suite"]["name"] == "tiny" and "[lossy]" in results["suite_toml"]
    assert results["versions"]["torch"] and results["machine"]["cpu_count"]
    assert results["calibration"]["how"].startswith("fitted for this run")
    assert (out / "calibration" / "calibration.json").is_file()

    ll = results["lossless"]
    assert [r["method"] for r in ll["predictors"]] == ["generic", "none", "context"]
    assert all(r["bit_exact"] for r in ll["predictors"])
    assert all(len(r["per_layer_k"]) == 2 and len(r["per_layer_v"]) == 2 for r in ll["predictors"])
    assert [r["method"] for r in ll["baselines"]] == ["raw bfloat16", "zstd-3", "exponent-bound"]
    assert [r["scheduler"] for r in ll["windows"]] == ["fixed-1024", "predicted"]
    assert all(sum(int(k) * v for k, v in r["window_hist"].items()) == r["scalars"] for r in ll["windows"])

    gen = results["generation"]["rows"]
    assert [r["kind"] for r in gen] == ["dynamic", "none", "lossless"]
    assert all(r["identical_to_dynamic"] for r in gen)
    assert gen[2]["bits_per_scalar"] > 0  # tiny blocks: headers dominate, no compression expected

    rows = results["lossy"]["rows"]
    assert rows[0]["family"] == "full" and rows[0]["attn_err"] == 0.0
    methods = [(r["method"], r["setting"]) for r in rows[1:]]
    assert methods == [("summary", "0.5"), ("topk", "0.5"), ("summary-entropy", "0.5"),
                       ("QuantizedCache fp8", "8-bit fp8 (per tensor)")]
    for r in rows[1:]:
        assert "error" not in r, r
        assert 0 < r["kept"] <= 0.6 and r["ppl"] > 1 and r["attn_err"] > 0
        assert r["needle_acc"] is not None
    assert results["lossy"]["not_run"][0]["method"] == "kvpress presses"

    report = (out / "report.md").read_text()
    assert "## Lossless" in report and "## Lossy" in report and "| predictor `context` |" in report
    assert "## Lossless" in stdout and "wrote" in stdout


def test_only_one_section(tiny_suite, tmp_path, capsys):
    out = tmp_path / "results"
    code, _, err = run_eval(capsys, "--suite", tiny_suite(), "--out", str(out), "--only", "lossy")
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert "lossless" not in results and "generation" not in results and results["lossy"]["rows"]
    assert results["calibration"] is None
    assert sorted(results["plots"].values()) == ["quality_vs_memory.png"]


def test_wrong_suite_name(capsys, tmp_path):
    code, _, err = run_eval(capsys, "--suite", "quik", "--out", str(tmp_path))
    assert_one_line_error(code, err, "unknown suite 'quik'")


def test_bad_suite_file(capsys, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[lossy]\nbudgets = 'half'\n")
    code, _, err = run_eval(capsys, "--suite", str(path), "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "lossy.budgets must be a list")


def test_unwritable_output_folder(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, _, err = run_eval(capsys, "--suite", "quick", "--out", str(blocker / "results"))
    assert_one_line_error(code, err, "cannot write to output folder")


def test_missing_matplotlib_is_one_line_before_any_work(capsys, tmp_path, monkeypatch):
    """Without the eval extra the run stops at once, saying what to install (it used to run the whole suite and
    die while plotting, with no results.json)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    code, _, err = run_eval(capsys, "--suite", "quick", "--out", str(tmp_path / "results"))
    assert_one_line_error(code, err, "pip install -e '.[eval]'")
    assert not (tmp_path / "results").exists()


def test_unknown_model(capsys, tmp_path):
    code, _, err = run_eval(capsys, "--suite", "quick", "--model", str(tmp_path / "no-such-model"),
                            "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "unknown model")


def test_unknown_model_folder_without_weights(capsys, tmp_path):
    (tmp_path / "empty-model").mkdir()
    code, _, err = run_eval(capsys, "--suite", "quick", "--model", str(tmp_path / "empty-model"),
                            "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "unknown or unreadable model")


def test_unknown_dataset(tiny_suite, capsys, tmp_path):
    code, _, err = run_eval(capsys, "--suite", tiny_suite(), "--dataset", str(tmp_path / "missing.txt"),
                            "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "unknown dataset")


def test_dataset_without_text_files(tiny_suite, capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    code, _, err = run_eval(capsys, "--suite", tiny_suite(), "--dataset", str(tmp_path / "empty"),
                            "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "no .txt/.md/.json/.jsonl files found")


def test_dataset_too_small_for_the_suite(tiny_suite, capsys, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("a few words only. " * 10)
    code, _, err = run_eval(capsys, "--suite", tiny_suite(), "--dataset", str(small), "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "use a smaller suite or more text")


@pytest.mark.parametrize("args", [["--only", "everything"]])  # --threads -1: a usage error (tests/test_cli.py)
def test_bad_options(args, capsys, tmp_path):
    code, _, err = run_eval(capsys, "--suite", "quick", "--out", str(tmp_path), *args)
    assert code == 2 and "Traceback" not in err
