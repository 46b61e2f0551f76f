"""The hf-kvcompress command line: clear messages and exit codes."""

from __future__ import annotations

import pytest

from hf_kvcompress.cli import main


def test_unknown_model_exits_2_with_one_line(tmp_path, capsys):
    code = main(["demo", "--model", str(tmp_path / "missing"), "--mode", "none", "--new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "unknown or unreadable model" in err
    assert "Traceback" not in err


def test_bad_subcommand_is_rejected(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2


@pytest.mark.real_model
def test_demo_runs_on_the_default_model(capsys):
    code = main(["demo", "--mode", "none", "--prompt-tokens", "64", "--new-tokens", "8"])
    out = capsys.readouterr().out
    assert code == 0
    assert "identical_to_DynamicCache: True" in out
    assert "compression_ratio" in out
