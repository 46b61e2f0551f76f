"""experiments/device_generate.py, the prepared device run of issue 53, in its CPU dry run (the tiny random model):
so that the script a device session runs in one go cannot rot between sessions."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "device_generate.py"


def test_device_script_dry_run(tmp_path):
    spec = importlib.util.spec_from_file_location("device_generate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "result.json"
    assert module.main(["--dry-run", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["context"], r["coder"], r["auto"]) for r in result["rows"]] == [
        (48, "huff", True), (48, "lanes", False), (80, "huff", True), (80, "lanes", False)]
    assert all(r["identical"] and r["step_x"] > 0 and 0 < r["held_x"] < 1 for r in result["rows"])
    assert [(d["context"], d["coder"]) for d in result["decode"]] == [
        (c, coder) for c in (48, 80) for coder in ("huff", "lanes", "mhuff")]
    assert all(d["exact"] and d["GB_s"] > 0 for d in result["decode"])
    assert all((d["host_seconds"] is None) == (d["coder"] == "lanes") for d in result["decode"])
