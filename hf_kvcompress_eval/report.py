"""The Markdown report and the PNG plots of an evaluation run, from its results dict (the JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 2**20


def _f(value: Any, spec: str = ".3f", none: str = "-") -> str:
    if value is None:
        return none
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def table(headers: list[str], rows: list[list[str]], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(headers) - 1)
    marks = {"l": ":---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(marks[a] for a in align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------- tables


def lossless_table(lossless: dict[str, Any]) -> str:
    rows = []
    for r in lossless["predictors"]:
        rows.append([f"predictor `{r['method']}`", _f(r["k_bits"]), _f(r["v_bits"]), _f(r["bits_per_scalar"]),
                     _f(r["ratio"], ".2f"), _f(r["enc_mps"], ".2f"), _f(r["dec_mps"], ".2f"),
                     _f(r["rerun_fraction_of_prefill"], ".2f") if r["rerun_s"] else "-", _f(r["bit_exact"])])
    for r in lossless["baselines"]:
        name = {"exponent-bound": "exponent-Huffman bound (ideal)"}.get(r["method"], r["method"])
        if not r.get("available", True):
            rows.append([name, "-", "-", "-", "-", "-", "-", "-", r.get("reason", "unavailable")])
            continue
        exact = "yes" if r["method"].startswith(("zstd", "zipnn")) else "-"
        rows.append([name, _f(r["k_bits"]), _f(r["v_bits"]), _f(r["bits_per_scalar"]), _f(r["ratio"], ".2f"),
                     _f(r.get("enc_mps"), ".2f"), _f(r.get("dec_mps"), ".2f"), "-", exact])
    headers = ["method", "K bits", "V bits", "all bits*", "ratio", "encode M/s", "decode M/s", "rerun / prefill",
               "exact"]
    return table(headers, rows)


def per_layer_table(lossless: dict[str, Any]) -> str:
    cols = [r for r in lossless["predictors"]] + [
        r for r in lossless["baselines"] if r.get("available", True) and not r["method"].startswith("raw")
    ]
    headers = ["layer"] + [f"`{r['method']}` K/V" if r["kind"] == "predictor" else f"{r['method']} K/V" for r in cols]
    rows = []
    for i in range(lossless["layers"]):
        rows.append([str(i)] + [f"{r['per_layer_k'][i]:.2f} / {r['per_layer_v'][i]:.2f}" for r in cols])
    return table(headers, rows)


def window_table(windows: list[dict[str, Any]]) -> str:
    rows = []
    for r in windows:
        hist = {int(k): v for k, v in r["window_hist"].items()}
        top = sorted(hist.items(), key=lambda kv: -kv[0] * kv[1])[:3]
        share = ", ".join(f"{k}: {100 * k * v / r['scalars']:.0f}%" for k, v in top)
        rows.append([r["scheduler"], _f(r["bits_per_scalar"], ".4f"), _f(r["ideal_bits_per_scalar"], ".4f"),
                     str(r["windows"]), _f(r["mean_window"], ".0f"), share, _f(r["encode_mps"], ".2f")])
    return table(["scheduler", "bits/scalar", "ideal bits", "windows", "mean length",
                  "largest shares (length: % of elements)", "encode M/s"], rows)


def generation_table(rows_in: list[dict[str, Any]]) -> str:
    rows = []
    for r in rows_in:
        peak = r["peak_rss_growth_bytes"]
        rows.append([r["cache"], _f(r["tokens_per_s"], ".2f"), _f(r.get("speed_vs_dynamic"), ".2f") + "x",
                     _f(r["held_bytes"] / MIB, ".2f"), _f(peak / MIB if peak is not None else None, ".1f"),
                     _f(r.get("bits_per_scalar"), ".2f", "16 (raw)" if r["kind"] == "dynamic" else "-"),
                     _f(r["identical_to_dynamic"])])
    return table(["cache", "tokens/s", "vs DynamicCache", "held MiB", "peak RSS growth MiB", "bits/scalar",
                  "identical"], rows)


def lossy_table(lossy: dict[str, Any]) -> str:
    rows_in = lossy["rows"]
    full_ppl = rows_in[0]["ppl"]
    rows = []
    for r in rows_in:
        if "error" in r:
            rows.append([r["method"], r["setting"], "failed: " + r["error"][:80], "", "", "", "", "", ""])
            continue
        worst = "-" if r["worst_layer"] is None else f"{r['worst_err']:.3f} (L{r['worst_layer']})"
        dppl = None if r["ppl"] is None or full_ppl is None else r["ppl"] - full_ppl
        rows.append([r["method"], r["setting"], _f(r["kept"]), _f(r["attn_err"], ".4f"), worst, _f(r["ppl"], ".3f"),
                     "-" if r["family"] == "full" else _f(dppl, "+.3f"), _f(r["needle_acc"], ".2f"),
                     _f(r["sec_per_summary"], ".3f")])
    return table(["method", "setting", "kept (bytes)", "attn err", "worst layer", "ppl", "d ppl", "needle acc",
                  "s / summary"], rows)


def markdown(results: dict[str, Any]) -> str:
    """The whole report: what ran where, then every table."""
    suite = results["suite"]
    meta = results["run"]
    parts = [f"# hf_kvcompress evaluation: suite `{suite['name']}`", ""]
    if suite.get("description"):
        parts += [suite["description"], ""]
    versions = results["versions"]
    machine = results["machine"]
    parts += [
        f"- model: {meta['model']} ({suite['model']['dtype']}); text: {meta['data']}",
        f"- calibration: {meta.get('calibration') or 'none needed'}",
        f"- run: {meta['started']}, {meta['wall_s'] / 60:.1f} min wall, {machine['torch_threads']} torch thread(s), "
        f"{machine.get('cpu_model') or machine['processor']} x {machine['cpu_count']}, "
        f"load average {_load(machine)}",
        f"- versions: hf_kvcompress {versions.get('hf_kvcompress')}, torch {versions.get('torch')}, transformers "
        f"{versions.get('transformers')}, python {versions.get('python')}",
        "",
    ]
    ll = results.get("lossless")
    if ll:
        parts += [
            f"## Lossless: {ll['tokens']} held-out tokens, {ll['layers']} layers x {ll['kv_heads']} KV heads x "
            f"{ll['head_dim']} ({ll['dtype']}); bits per scalar",
            "",
            lossless_table(ll),
            "",
            "\\* whole file for predictors (streams, scales, side data, header with token ids); baselines code each "
            "layer's K and V as one tensor each. Predictor encode/decode M/s: M scalars per second of `save` / "
            "`load` (predictor and entropy coder, wall clock). `rerun / prefill`: model rerun a probe/twin "
            "file needs at save and at load, relative to a plain prefill. The exponent-Huffman bound is the "
            "entropy of each tensor's exponent field plus its raw sign and mantissa bits (DFloat11 style).",
            "",
        ]
        if ll.get("windows"):
            parts += [f"### Window scheduler on the first {results['suite']['lossless']['window_tokens']} tokens "
                      "(per-channel mean/std)", "", window_table(ll["windows"]), ""]
        parts += ["<details><summary>Bits per scalar per layer (K / V)</summary>", "", per_layer_table(ll), "",
                  "</details>", ""]
    gen = results.get("generation")
    if gen:
        g0 = gen["rows"][0]
        parts += [f"### Generation: {g0['prompt_tokens']}-token prompt + {g0['new_tokens']} new tokens "
                  f"(block {gen['block_tokens']}, residual {gen['residual_tokens']})", "", generation_table(gen["rows"]),
                  "", "Peak RSS growth: the process's resident-memory high-water mark during `generate` minus its "
                  "size before (everything generation allocates, not only the cache). Held: bytes the cache holds "
                  "at the end.", ""]
    ly = results.get("lossy")
    if ly:
        s = suite["lossy"]
        needles = ly.get("needles") or {}
        parts += [
            f"## Lossy: {ly['segments']} x ({s['context']} context + {s['continuation']} continuation) tokens; "
            f"{needles.get('count', 0)} needles in {needles.get('context_tokens', '-')}-token contexts",
            "",
            lossy_table(ly),
            "",
            "kept: bytes the cache holds after the context (side data included) over a full cache's. attn err: "
            "mean relative attention-output error of held-out queries, over layers. ppl: perplexity of the "
            f"continuation (chunks of {s['interval']} tokens through the cache). Window {s['window']} recent "
            f"tokens exact, {s['sinks']} sinks.",
            "",
        ]
        skipped = ly.get("unavailable", []) + ly.get("not_run", [])
        if skipped:
            parts += ["Not run here:", ""] + [f"- {u['method']} ({u['setting']}): {u['reason']}" for u in skipped] + [""]
    plots = results.get("plots", {})
    if plots:
        parts += ["## Plots", ""] + [f"![{name}]({path})" for name, path in plots.items()] + [""]
    return "\n".join(parts)


def _load(machine: dict[str, Any]) -> str:
    la = machine.get("load_average")
    return "-" if not la else f"{la[0]:.1f}"


# ---------------------------------------------------------------------- plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_quality_vs_memory(lossy: dict[str, Any], path: Path) -> None:
    plt = _plt()
    rows = [r for r in lossy["rows"] if "error" not in r]
    full = rows[0]
    panels = [("ppl", "perplexity of the continuation"), ("needle_acc", "needle retrieval accuracy"),
              ("attn_err", "attention-output error (held-out queries)")]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    methods = list(dict.fromkeys(r["method"] for r in rows[1:]))
    for ax, (key, title) in zip(axes, panels):
        for method in methods:
            mine = sorted((r for r in rows if r["method"] == method and r.get(key) is not None), key=lambda r: r["kept"])
            if not mine:
                continue
            style = "s--" if mine[0]["family"] == "quantized" else "o-"
            ax.plot([r["kept"] for r in mine], [r[key] for r in mine], style, label=method)
        if full.get(key) is not None:
            ax.axhline(full[key], color="black", linestyle=":", label="full cache")
        ax.set_title(title)
        ax.set_xlabel("memory kept (fraction of the full cache's bytes)")
        ax.grid(alpha=0.3)
    from matplotlib.ticker import ScalarFormatter

    for ax, key, spread in ((axes[0], "ppl", 2), (axes[2], "attn_err", 20)):
        values = [r[key] for r in rows if r.get(key)]
        if values and max(values) / min(values) > spread:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(ScalarFormatter())
            ax.tick_params(axis="y", which="minor", labelsize=7)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bits_per_layer(lossless: dict[str, Any], path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6), sharey=True)
    for r in lossless["predictors"]:
        for ax, key in zip(axes, ("per_layer_k", "per_layer_v")):
            ax.plot(r[key], marker=".", label=f"predictor {r['method']}")
    for r in lossless["baselines"]:
        if not r.get("available", True) or r["method"].startswith("raw"):
            continue
        for ax, key in zip(axes, ("per_layer_k", "per_layer_v")):
            ax.plot(r[key], linestyle="--", label=r["method"])
    for ax, title in zip(axes, ("keys", "values")):
        ax.set_title(f"{title}: bits per scalar by layer ({lossless['dtype']} raw = "
                     f"{lossless['baselines'][0]['bits_per_scalar']:.0f})")
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("bits / scalar")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_window_histogram(windows: list[dict[str, Any]], path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, len(windows), figsize=(4.2 * len(windows), 3.8), squeeze=False)
    for ax, r in zip(axes[0], windows):
        hist = sorted((int(k), v) for k, v in r["window_hist"].items())
        lengths = [k for k, _ in hist]
        share = [100 * k * v / r["scalars"] for k, v in hist]
        ax.bar(range(len(lengths)), share, color="tab:blue")
        ax.set_xticks(range(len(lengths)))
        ax.set_xticklabels([str(k) for k in lengths], rotation=60, fontsize=7)
        ax.set_title(f"{r['scheduler']}: {r['bits_per_scalar']:.3f} b/s, {r['windows']} windows", fontsize=9)
        ax.set_xlabel("window length (elements)")
    axes[0][0].set_ylabel("% of elements")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(results: dict[str, Any], out: Path) -> dict[str, str]:
    """The PNGs a run has data for; returns {title: file name}."""
    made = {}
    if results.get("lossy"):
        plot_quality_vs_memory(results["lossy"], out / "quality_vs_memory.png")
        made["quality vs memory per method"] = "quality_vs_memory.png"
    if results.get("lossless"):
        plot_bits_per_layer(results["lossless"], out / "bits_per_layer.png")
        made["bits per scalar per layer"] = "bits_per_layer.png"
        if results["lossless"].get("windows"):
            plot_window_histogram(results["lossless"]["windows"], out / "window_histogram.png")
            made["window-size histogram"] = "window_histogram.png"
    return made
