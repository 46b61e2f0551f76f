"""`hf-kvcompress bench NAME --smoke`: every maintained benchmark runs in seconds on a tiny random model through the
command line and writes its results (JSON that parses, Markdown or text tables, PNG plots) under
eval-results/bench/NAME/ by default. The numbers of a smoke run mean nothing; that the benchmarks run does."""

from __future__ import annotations

import json

import pytest

from hf_kvcompress.cli import main
from hf_kvcompress_eval.bench import BENCHES

PNG = b"\x89PNG\r\n\x1a\n"
#: the files each bench writes
OUTPUTS = {
    "generate": ["bench_generate.json", "bench_generate.md", "bench_generate.png"],
    "codec": ["bench_codec.json", "bench_codec.txt", "bench_codec.png"],
    "prefix": ["results.json", "prefix_store.png"],
    "lmcache": ["results.json", "report.md"],
    "predictors": ["results.json", "frontier.md"],
    "kernels": ["bench_kernels_smoke.json"],
    "chunked": ["results.json", "table.md"],
}
NEEDS = {"lmcache": "lmcache", "kernels": "triton"}


def check_results(name: str, results: dict) -> None:
    if name == "generate":
        assert results["rows"][0]["config"] == "DynamicCache"
        assert all(r["identical"] for r in results["rows"][1:])
    elif name == "codec":
        assert results["sections"] == ["rate", "windows", "realistic", "lanes", "fast"]
        fast = {r["coder"]: r for r in results["fast"]["rows"]}
        assert set(fast) == {"huff", "lanes", "zipnn"} and fast["huff"]["bits_per_scalar"] < 16
        assert all(r["within_1pct"] for r in results["codec"]) and len(results["windows"]) == 7
        assert results["realistic"] and set(results["lanes"]["rows"]) == {"channel", "element"}
    elif name == "prefix":
        routes = next(iter(results["prefixes"].values()))["routes"]
        assert all(r["exact_tokens_and_logits"] for r in routes.values())
        assert {"store (below)", "load (below)"} <= set(routes)  # --calibrated's default: context and below
    elif name == "lmcache":
        rows = {r["method"]: r for r in results["table"]}
        assert all(r["exact"] for m, r in rows.items() if m.startswith("hf_kvcompress"))
    elif name == "predictors":
        assert set(results["rows"]) == {"generic", "none", "context", "below", "below:huff"}
        assert all(r["identical"] for r in results["rows"].values()) and set(results["held"]) == {"generic", "below"}
        # the parts cover held_bytes; below holds heads, RoPE tables and (lanes) marginals, generic none of them
        assert all(h["parts"]["other"] == 0 and h["parts"]["streams"] > 0 for h in results["held"].values())
        assert min(results["held"]["below"]["parts"][p] for p in ("heads", "rope tables", "marginals")) > 0
        assert results["held"]["generic"]["parts"]["heads"] == results["held"]["generic"]["parts"]["marginals"] == 0
    elif name == "chunked":
        rows = {r["key"]: r for r in results["rows"]}
        assert list(rows) == ["96 dynamic chunked", "96 summary chunked", "96 dynamic", "96 streaming"]
        # within budget + one chunk after every chunk, and holding less than DynamicCache
        assert 0 < rows["96 summary chunked"]["most_over_bound"] <= 1
        assert rows["96 summary chunked"]["held_mb"] < rows["96 dynamic chunked"]["held_mb"]
        assert rows["96 summary chunked"]["summaries"] >= 2 and rows["96 streaming"]["summaries"] == 1
    elif name == "kernels":
        assert results["smoke"] and all(r["check"] in (None, True) for r in results["rows"])
        assert {"decode_over_attention", "decode_ms"} <= set(results["ans_vs_attention"])


def test_every_bench_has_a_test():
    assert set(OUTPUTS) == set(BENCHES)


#: smoke runs of 15-23 s on 2 loaded cores (2026-12-04; chunked: four fresh processes, 33 s of CPU, 81-272 s loaded):
#: outside the fast tier (README), still in CI
SLOW_SMOKE = ("generate", "prefix", "chunked")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_SMOKE else n for n in BENCHES])
def test_bench_smoke_writes_its_results(name, tmp_path, monkeypatch, capsys):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    monkeypatch.chdir(tmp_path)  # the default results folder is relative: eval-results/bench/NAME
    assert main(["bench", name, "--smoke"]) == 0, capsys.readouterr().err
    out = tmp_path / "eval-results" / "bench" / name
    for file in OUTPUTS[name]:
        path = out / file
        assert path.is_file(), f"{name}: {file} missing in {sorted(p.name for p in out.iterdir())}"
        if file.endswith(".png"):
            assert path.read_bytes().startswith(PNG)
        elif file.endswith((".md", ".txt")):
            assert path.read_text().strip()
    check_results(name, json.loads((out / OUTPUTS[name][0]).read_text()))


def test_bench_help_lists_every_bench(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    assert all(name in shown for name in BENCHES)


@pytest.mark.parametrize("name", list(BENCHES))
def test_bench_help_never_suggests_writing_into_tracked_results(name, capsys):
    """Following a bench's --help must not overwrite the published runs in results/: it names eval-results/."""
    import re

    with pytest.raises(SystemExit) as done:
        main(["bench", name, "--help"])
    shown = capsys.readouterr().out
    assert done.value.code == 0 and f"eval-results/bench/{name}" in shown
    assert re.findall(r"(?<![\w/-])results/", shown) == [], shown


def test_bench_options_are_checked(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "generate", "--no-such-option"])
    assert done.value.code == 2 and "--no-such-option" in capsys.readouterr().err
    assert main(["bench", "codec", "--sections", "rate,nonsense", "--out", "unused"]) == 2
    assert "--sections" in capsys.readouterr().err
    assert main(["bench", "prefix", "--sliding-window", "1", "--out", "unused"]) == 2
    assert "--sliding-window must be 0 (off) or >= 2 tokens" in capsys.readouterr().err


@pytest.mark.slow  # 10-70 s on 2 shared cores (2026-12-08), as the prefix smoke run above
def test_prefix_bench_runs_the_model_as_a_sliding_window_model(tmp_path, capsys):
    """``--sliding-window``: the store and load routes on the window model continue exactly, only the generic ones
    run (calibrations cover full attention), and the model really reads through its window."""
    assert main(["bench", "prefix", "--smoke", "--sliding-window", "64", "--out", str(tmp_path)]) == 0, \
        capsys.readouterr().err
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["sliding_window"] == 64 and "window 64" in results["model"]
    entry = results["prefixes"]["256"]
    assert set(entry["routes"]) == {"store", "load (generic)"}
    assert all(r["exact_tokens_and_logits"] for r in entry["routes"].values())
    assert entry["differs_from_full_attention"] is True
    assert entry["raw_prefix_bytes"] == 2 * 256 * 2 * 2 * 16 * 2  # K and V, 256 tokens, 2 layers, 2 heads x 16, bf16


def test_sliding_window_model_keeps_the_weights_and_reads_through_its_window():
    """The Mistral copy of a Llama: float32 logits bit-identical to the Llama's within the window (same weights,
    same arithmetic), different beyond it (transformers' Llama would ignore a ``sliding_window``)."""
    import torch

    from hf_kvcompress_eval.bench.common import sliding_window_model, tiny_model

    llama = tiny_model(torch.float32)
    sliding = sliding_window_model(llama, 16)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, window = llama(ids).logits, sliding(ids).logits
    assert torch.equal(full[:, :16].view(torch.int32), window[:, :16].view(torch.int32))
    assert (full[0, 17:] != window[0, 17:]).any(-1).all()
    with pytest.raises(ValueError, match="window must be an int >= 2"):
        sliding_window_model(llama, 1)
    with pytest.raises(ValueError, match="a LlamaForCausalLM is converted, not MistralForCausalLM"):
        sliding_window_model(sliding, 16)
