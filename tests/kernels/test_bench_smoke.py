"""eval/bench_kernels.py is a prepared GPU script; its --smoke mode runs every section on the CPU interpreter
with tiny sizes, which keeps it from rotting on machines without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_testutil import needs_triton

ROOT = Path(__file__).resolve().parents[2]


@needs_triton
@pytest.mark.slow
def test_bench_kernels_smoke(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "eval" / "bench_kernels.py"), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "bench_kernels_smoke.json").read_text())
    assert report["smoke"] and all(r["check"] in (None, True) for r in report["rows"])
    assert {"decode_over_attention", "decode_ms"} <= set(report["ans_vs_attention"])
