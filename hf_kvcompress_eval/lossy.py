"""Lossy measurements: perplexity of a continuation, needle retrieval, attention-output error on held-out
queries and physical memory, for the lossy methods at several budgets and for transformers' `QuantizedCache`
backends, all against the full cache.

Every configuration starts from the same captured prefill (`capture.replay`). Perplexity: the continuation is
teacher-forced through the compressed cache in chunks of ``interval`` tokens (summaries keep running as they
would while decoding); its first token is scored from the shared full prefill. Attention error: every
``heldout_stride``-th continuation query of the full forward (never a reference query of a summary), per layer,
attends over what the cache holds after the context against the full context. Needles: the context is
compressed before the question arrives; the answer is generated greedily.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, QuantizedCache

from hf_kvcompress import CompressedCache, CompressionConfig, LossyConfig
from hf_kvcompress.lossy.blocks import block_bias

from .capture import Captured, capture, replay
from .needles import answer_correct, make_needles

NEG_INF = float("-inf")
QUANTIZED_INSTALL = {"hqq": "pip install hqq", "quanto": "pip install optimum-quanto"}


@dataclass
class Setting:
    """One cache configuration: a method (``full``, a lossy method label, ``QuantizedCache <backend>``) at one
    setting (a budget fraction or a bit width), and how to make a fresh cache for the model."""

    method: str
    setting: str
    family: str  # "full", "lossy", "quantized"
    make: Callable[[], Any]
    budget: float | None = None
    nbits: int | None = None
    config: dict[str, Any] = field(default_factory=dict)


def lossy_setting(model, label: str, fields: dict[str, Any], budget: float, *, window: int, interval: int,
                  sinks: int) -> Setting:
    merged = {"interval": interval, "sinks": sinks, **fields, "budget": float(budget)}
    config = CompressionConfig(mode="lossy", residual_tokens=window, lossy=LossyConfig.from_dict(merged))
    return Setting(label, f"{budget:g}", "lossy", lambda: CompressedCache(config, model=model), budget=float(budget),
                   config=config.to_dict())


def quantized_setting(model, spec: str, *, window: int, group: int) -> Setting | dict[str, str]:
    """A `QuantizedCache` setting, or ``{"method", "reason"}`` when the backend does not work here."""
    backend, _, bits = spec.partition("-")
    kwargs: dict[str, Any] = {}
    if backend != "fp8":
        kwargs = {"nbits": int(bits), "q_group_size": group, "residual_length": max(1, window)}
        if backend == "hqq":  # HQQ's recommended grouping (axis 0, transformers' default, is far worse here)
            kwargs.update(axis_key=1, axis_value=1)

    def make():
        return QuantizedCache(backend=backend, config=model.config, **kwargs)

    try:
        make()
    except ImportError as err:
        hint = QUANTIZED_INSTALL.get(backend, "")
        return {"method": f"QuantizedCache {backend}", "setting": spec,
                "reason": f"not installed ({hint})" if hint else f"unavailable: {err}"}
    except (ValueError, TypeError, RuntimeError) as err:
        return {"method": f"QuantizedCache {backend}", "setting": spec, "reason": f"{type(err).__name__}: {err}"}
    setting = "8-bit fp8 (per tensor)" if backend == "fp8" else f"{bits}-bit"
    return Setting(f"QuantizedCache {backend}", setting, "quantized", make, nbits=int(bits or 8),
                   config={"backend": backend, **kwargs})


# ---------------------------------------------------------------------- what a cache holds


def _nbytes(obj: Any) -> int:
    """Bytes of every tensor inside ``obj`` (tuples, lists, dicts, tensor subclasses such as quanto's)."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(_nbytes(getattr(obj, n)) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(x) for x in obj.values())
    return 0


def physical_bytes(cache) -> int:
    """Bytes a cache really holds: `CompressedCache.stats()["held_bytes"]` (blocks, side data, residual, kept
    queries), quantized tensors with their scales plus the unquantized residual, or plain K/V."""
    if isinstance(cache, CompressedCache):
        return int(cache.stats()["held_bytes"])
    total = 0
    for layer in cache.layers:
        total += _nbytes(getattr(layer, "_quantized_keys", None)) + _nbytes(getattr(layer, "_quantized_values", None))
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, torch.Tensor) and keys.dim() == 4:
            total += _nbytes(keys) + _nbytes(values)
    return total


def held_entries(cache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Keys, values ``[b, h, n, d]`` (float32) and per-entry logit biases ``[b, h, n]`` (or None) that
    attention sees from one layer of any cache."""
    layer = cache.layers[layer_idx]
    if hasattr(layer, "_quantized_keys") and layer._quantized_keys is not None:
        keys = layer._dequantize(layer._quantized_keys)
        values = layer._dequantize(layer._quantized_values)
        if isinstance(layer.keys, torch.Tensor) and layer.keys.dim() == 4 and layer.keys.shape[-2]:
            keys = torch.cat([keys.to(layer.keys.dtype), layer.keys], dim=-2)
            values = torch.cat([values.to(layer.values.dtype), layer.values], dim=-2)
        return keys.float(), values.float(), None
    keys, values = layer.keys.float(), layer.values.float()
    blocks = getattr(layer, "blocks", None)
    if not blocks and getattr(layer, "residual_valid", None) is None:
        return keys, values, None
    b, h = keys.shape[:2]
    parts = []
    for block in blocks or []:
        bias = block_bias(block)
        parts.append(torch.zeros(b, h, block.entries) if bias is None else bias.float())
    residual = torch.zeros(b, h, layer.residual_length)
    if getattr(layer, "residual_valid", None) is not None:
        residual = torch.where(layer.residual_valid[:, None, :], 0.0, NEG_INF).expand_as(residual)
    return keys, values, torch.cat([*parts, residual], dim=-1)


def attention_errors(cache, full: Captured, context: int, stride: int) -> list[float]:
    """Per layer: mean relative error ``|o_c - o| / |o|`` of the held-out queries' attention output over the
    context, ``o`` over the full context's K/V and ``o_c`` over what ``cache`` holds for it."""
    errors = []
    scaling = full.scaling
    for idx, (q, k, v) in enumerate(full.states):
        queries = q[..., context::stride, :].float()
        groups = queries.shape[1] // k.shape[1]
        k_full = k[..., :context, :].float().repeat_interleave(groups, 1)
        v_full = v[..., :context, :].float().repeat_interleave(groups, 1)
        o_full = torch.softmax(queries @ k_full.transpose(-1, -2) * scaling, -1) @ v_full
        k_c, v_c, bias = held_entries(cache, idx)
        k_c, v_c = k_c.repeat_interleave(groups, 1), v_c.repeat_interleave(groups, 1)
        logits = queries @ k_c.transpose(-1, -2) * scaling
        if bias is not None:
            logits = logits + bias.repeat_interleave(groups, 1)[..., None, :]
        o_c = torch.softmax(logits, -1) @ v_c
        rel = (o_c - o_full).norm(dim=-1) / o_full.norm(dim=-1).clamp_min(1e-12)
        errors.append(rel.mean().item())
    return errors


def summary_seconds(cache) -> list[float]:
    """Seconds per summary event, summed over layers (lossy caches; empty otherwise)."""
    per_layer = [getattr(layer, "summary_seconds", None) for layer in cache.layers]
    if not per_layer or any(s is None for s in per_layer):
        return []
    events = min(len(s) for s in per_layer)
    return [sum(s[i] for s in per_layer) for i in range(events)]


@torch.inference_mode()
def continuation_nll(model, cache, ids: torch.Tensor, context: int, chunk: int, first_logits: torch.Tensor):
    """``[b, continuation]`` NLL of every continuation token: the first from the (shared) full prefill's
    ``first_logits`` (``[b, vocab]``), the rest teacher-forced through the cache ``chunk`` tokens per forward."""
    cont = ids[:, context:]
    losses = [torch.nn.functional.cross_entropy(first_logits.float(), cont[:, 0], reduction="none")[:, None]]
    for start in range(0, cont.shape[1] - 1, chunk):
        piece = cont[:, start : start + chunk]
        logits = model(piece, cache=cache).logits.float()
        target = cont[:, start + 1 : start + chunk + 1]
        losses.append(torch.nn.functional.cross_entropy(logits[:, : target.shape[1]].transpose(1, 2), target,
                                                        reduction="none"))
    return torch.cat(losses, dim=1)


# ---------------------------------------------------------------------- the experiment


def _entry() -> dict[str, list]:
    return {"kept": [], "kept_end": [], "layer_errors": [], "nll": [], "needle_hits": [], "summary_seconds": [],
            "seconds": []}


def empty_results(settings: list[Setting]) -> dict:
    """The results dict `run_perplexity` and `run_needles` fill: ``"full"`` plus ``(method, setting)`` keys."""
    return {"full": _entry()} | {(s.method, s.setting): _entry() for s in settings}


def run_perplexity(model, segments: list[torch.Tensor], settings: list[Setting], results: dict, *, context: int,
                   interval: int, stride: int, step=None, errors: dict | None = None) -> None:
    """Per text segment (``[1, context + continuation]`` ids): full NLL once, then per setting the kept
    fraction, per-layer attention errors and the continuation NLL through the compressed cache."""
    step = step or (lambda name: None)
    for seg, ids in enumerate(segments):
        continuation = ids.shape[1] - context
        full = capture(model, ids, logits_to_keep=continuation + 1)
        results["full"]["nll"].extend(
            torch.nn.functional.cross_entropy(full.logits[0, :-1].float(), ids[0, context:], reduction="none").tolist()
        )
        context_states = full.slice(0, context)
        for s in settings:
            step(f"lossy: segment {seg} {s.method} {s.setting}")
            key = (s.method, s.setting)
            if errors is not None and key in errors:
                continue
            try:
                start = time.perf_counter()
                cache = replay(s.make(), context_states)
                raw = captured_bytes(context_states)
                entry = results[key]
                entry["kept"].append(physical_bytes(cache) / raw)
                entry["layer_errors"].append(attention_errors(cache, full, context, stride))
                nll = continuation_nll(model, cache, ids, context, interval, full.logits[:, 0])
                entry["nll"].extend(nll.reshape(-1).tolist())
                entry["kept_end"].append(physical_bytes(cache) / (raw * ids.shape[1] / context))
                entry["summary_seconds"].extend(summary_seconds(cache))
                entry["seconds"].append(time.perf_counter() - start)
                del cache
            except Exception as err:  # one failing configuration must not lose the others' results
                if errors is None:
                    raise
                errors[key] = f"{type(err).__name__}: {err}"
        del full, context_states


def captured_bytes(captured: Captured) -> int:
    """Bytes of the captured keys and values: what a full cache holds for them."""
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for _, k, v in captured.states)


def run_needles(model, tokenizer, haystack: torch.Tensor, settings: list[Setting], results: dict, *, count: int,
                context_tokens: int, batch: int, seed: int = 0, step=None, errors: dict | None = None) -> dict:
    """Needle retrieval accuracy per setting (and for the full cache)."""
    step = step or (lambda name: None)
    needles = make_needles(tokenizer, haystack, count, context_tokens, seed=seed)
    new_tokens = needles.answer_tokens(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    everyone = [Setting("full", "-", "full", DynamicCache), *settings]
    for start in range(0, count, batch):
        context = needles.context[start : start + batch]
        prompt = torch.cat([context, needles.question.expand(context.shape[0], -1)], dim=1)
        states = capture(model, context)
        answers = needles.answers[start : start + context.shape[0]]
        for s in everyone:
            step(f"needles {start}: {s.method} {s.setting}")
            key = "full" if s.family == "full" else (s.method, s.setting)
            if errors is not None and key in errors:
                continue
            try:
                cache = replay(s.make(), states)
                with torch.inference_mode():
                    out = model.generate(prompt, cache=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                         do_sample=False, pad_token_id=pad)
                hits = [answer_correct(tokenizer, row[prompt.shape[1] :], a) for row, a in zip(out, answers)]
                results[key]["needle_hits"].extend(hits)
                del cache
            except Exception as err:
                if errors is None or key == "full":
                    raise
                errors[key] = f"{type(err).__name__}: {err}"
        del states
    return {"count": count, "context_tokens": context_tokens, "answer_tokens": new_tokens,
            "depths": needles.depths, "answers": needles.answers}


def summarise(results: dict, settings: list[Setting], errors: dict) -> list[dict[str, Any]]:
    """One row per setting (the full cache first): kept fraction, attention error (mean and worst layer),
    perplexity, needle accuracy, seconds per summary; ``error`` for settings that failed."""
    full = results["full"]
    full_ppl = math.exp(sum(full["nll"]) / len(full["nll"])) if full["nll"] else None
    rows = [{"method": "full (DynamicCache)", "setting": "-", "family": "full", "kept": 1.0, "attn_err": 0.0,
             "worst_layer": None, "worst_err": 0.0, "ppl": full_ppl,
             "needle_acc": _mean(full["needle_hits"]), "sec_per_summary": None, "per_layer_errors": None,
             "raw": _raw(full)}]
    for s in settings:
        key = (s.method, s.setting)
        e = results[key]
        row: dict[str, Any] = {"method": s.method, "setting": s.setting, "family": s.family, "budget": s.budget,
                               "nbits": s.nbits, "config": s.config}
        if key in errors:
            row["error"] = errors[key]
            rows.append(row)
            continue
        per_layer = torch.tensor(e["layer_errors"]).mean(0) if e["layer_errors"] else None
        row.update({
            "kept": _mean(e["kept"]),
            "kept_end": _mean(e["kept_end"]),
            "attn_err": per_layer.mean().item() if per_layer is not None else None,
            "worst_layer": int(per_layer.argmax()) if per_layer is not None else None,
            "worst_err": per_layer.max().item() if per_layer is not None else None,
            "ppl": math.exp(sum(e["nll"]) / len(e["nll"])) if e["nll"] else None,
            "needle_acc": _mean(e["needle_hits"]),
            "sec_per_summary": _mean(e["summary_seconds"]),
            "seconds_per_segment": _mean(e["seconds"]),
            "per_layer_errors": per_layer.tolist() if per_layer is not None else None,
            "raw": _raw(e),
        })
        rows.append(row)
    return rows


def _raw(entry: dict[str, list]) -> dict[str, list]:
    """The per-token NLLs, per-needle hits, per-segment kept fractions and layer errors behind a row."""
    return {k: v for k, v in entry.items() if v}


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def build_settings(model, suite_lossy, methods: list[tuple[str, dict[str, Any]]]) -> tuple[list[Setting], list[dict]]:
    """Settings of a suite's lossy section, plus the QuantizedCache backends that do not work here."""
    settings = []
    for label, fields in methods:
        for budget in suite_lossy.budgets:
            settings.append(lossy_setting(model, label, fields, budget, window=suite_lossy.window,
                                          interval=suite_lossy.interval, sinks=suite_lossy.sinks))
    unavailable = []
    for spec in suite_lossy.quantized:
        made = quantized_setting(model, spec, window=suite_lossy.window, group=suite_lossy.q_group_size)
        if isinstance(made, Setting):
            settings.append(made)
        else:
            unavailable.append(made)
    return settings, unavailable


def run_lossy(model, tokenizer, segments: list[torch.Tensor], haystack: torch.Tensor, suite_lossy,
              settings: list[Setting], unavailable: list[dict], *, seed: int = 0, step=None) -> dict[str, Any]:
    """The lossy table of a suite's ``[lossy]`` section on the given text (settings from `build_settings`)."""
    results = empty_results(settings)
    errors: dict = {}
    run_perplexity(model, segments, settings, results, context=suite_lossy.context, interval=suite_lossy.interval,
                   stride=suite_lossy.heldout_stride, step=step, errors=errors)
    needles = None
    if suite_lossy.needles:
        needles = run_needles(model, tokenizer, haystack, settings, results, count=suite_lossy.needles,
                              context_tokens=suite_lossy.needle_context, batch=suite_lossy.needle_batch, seed=seed,
                              step=step, errors=errors)
    return {"rows": summarise(results, settings, errors), "unavailable": unavailable, "needles": needles,
            "segments": len(segments)}


def steps_of(suite_lossy, settings: list[Setting]) -> int:
    """How many times `run_lossy` calls ``step`` (for a progress bar's total)."""
    batches = math.ceil(suite_lossy.needles / suite_lossy.needle_batch) if suite_lossy.needles else 0
    return suite_lossy.segments * len(settings) + batches * (len(settings) + 1)
