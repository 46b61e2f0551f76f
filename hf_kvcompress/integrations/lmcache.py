"""The lossless KV chunk coder as an LMCache serde (multiprocess mode, LMCache 0.5.6).

Importing this module registers the serde type ``"hf_kvcompress"`` with LMCache
(``lmcache.v1.distributed.serde.register_serde_factory``; LMCache has no entry-point discovery, so the
process that runs the LMCache server must import it: `python -m hf_kvcompress.integrations.lmcache_server`
does). An L2 adapter then selects it::

    {"type": "fs", "base_path": "/kv", "serde": {"type": "hf_kvcompress"}}                # model-free
    {"type": "fs", "base_path": "/kv", "serde": {"type": "hf_kvcompress",
                                                 "calibration": "/path/to/calibration"}}  # below (or context) predictor

Serde kwargs (all optional; see docs/lmcache.md):
    calibration: a calibration folder (``hf-kvcompress calibrate --predictors below``, or ``context``);
    calibration_fingerprint: a model fingerprint: the calibration ``hf-kvcompress calibrate`` saved under
        ``~/.cache/hf_kvcompress/calibrations/<fingerprint>``;
    model_config: a transformers config (folder, ``config.json`` or hub id): chunks of another shape are
        refused, and model-free coding takes the model's RoPE frame instead of guessing it per chunk;
    layers, kv_heads, head_dim, rope_theta: the same by hand (``rope_theta``, standard RoPE, needs
        ``head_dim``);
    portable: ``true``: model-free coding without a RoPE frame (plain per-channel statistics: the simplest
        arithmetic, ~2 % larger payloads on SmolLM2). Not needed for tiers that machines with different CPUs
        share: every payload of format version 2 decodes on any CPU (docs/lossless.md "Where a saved file
        decodes");
    threads: codec threads per model-free chunk (default 1);
    pad_to_estimate: write payloads zero-padded to ``estimate_serialized_size`` (for 0.5.6's ``fs``
        adapter, which reads that many bytes back; see docs/lmcache.md);
    max_workers: serde thread-pool size (default 1).

Chunks are ``[2, layers, tokens, kv_heads * head_dim]`` bfloat16 / float16 tensors (``KV_2LTD``); anything
else is refused with `ChunkError`. Tensors on a GPU are copied to the host to code and the decoded chunk is
copied back into the destination on its device. A payload that cannot decode exactly raises
`ChunkPayloadError`: LMCache reports the load as failed (a miss), never a wrong chunk.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

# LMCache is an optional dependency (extra "lmcache"): a clear error rather than a bare ImportError
try:
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.serde import (
        AsyncSerdeProcessor,
        Deserializer,
        SerdeProcessor,
        Serializer,
        get_registered_serde_types,
        register_serde_factory,
    )
    from lmcache.v1.memory_management import MemoryObj
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "hf_kvcompress.integrations.lmcache needs LMCache (>= 0.5.6, multiprocess-mode serde API); "
        "see docs/lmcache.md for the install lines"
    ) from err

from ..calibration import Calibration, calibration_dir
from ..predictors.rope import RopeFrame
from ..validation import check_int, check_number
from .kv_chunk import HEADER, ChunkCoder, ChunkError

SERDE_NAME = "hf_kvcompress"
KWARGS = ("calibration", "calibration_fingerprint", "model_config", "layers", "kv_heads", "head_dim",
          "rope_theta", "portable", "threads", "pad_to_estimate", "max_workers")


def _single_group(shapes: list[torch.Size], dtypes: list[torch.dtype]) -> tuple[torch.Size, torch.dtype]:
    """The one (shape, dtype) of a KV object; several groups (hybrid models) are not supported yet."""
    if len(shapes) != 1 or len(dtypes) != 1:
        raise ChunkError(
            f"KV object with {len(shapes)} groups (shapes {[tuple(s) for s in shapes]}): the hf_kvcompress serde "
            "takes single-group [2, layers, tokens, hidden] chunks"
        )
    return shapes[0], dtypes[0]


class LosslessSerializer(Serializer):
    """LMCache `Serializer`: a KV chunk -> its `ChunkCoder` payload in the destination byte buffer."""

    def __init__(self, coder: ChunkCoder, pad_to_estimate: bool = False):
        self.coder = coder
        self.pad_to_estimate = pad_to_estimate

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        """Code ``src`` into ``dst``; returns the bytes written (the payload, or the whole buffer when
        padding)."""
        shape, dtype = _single_group(src.get_shapes(), src.get_dtypes())
        self.coder.check_chunk(shape, dtype)
        chunk, out = src.tensor, dst.tensor
        if chunk is None or out is None:
            raise ValueError("hf_kvcompress serde: source or destination MemoryObj has no tensor (invalidated?)")
        payload = self.coder.encode(chunk.reshape(shape))
        out = out.reshape(-1).view(torch.uint8)
        if len(payload) > out.numel():  # cannot happen: estimate_serialized_size bounds every payload
            raise ValueError(f"hf_kvcompress serde: payload of {len(payload)} bytes exceeds the {out.numel()}-byte buffer")
        out[: len(payload)].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        if not self.pad_to_estimate:
            return len(payload)
        out[len(payload) :].zero_()
        return out.numel()

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        """Upper bound of a payload: header plus the raw chunk (incompressible chunks are stored raw).

        Computed for any layout, without refusing chunks this coder does not take: LMCache calls this
        outside its error handling on the load path, so refusals happen in `serialize` (the store fails)
        and `deserialize` (the load is a miss) instead."""
        raw = sum(int(torch.Size(shape).numel()) * dtype.itemsize
                  for shape, dtype in zip(layout_desc.shapes, layout_desc.dtypes, strict=True))
        return HEADER.size + raw


class LosslessDeserializer(Deserializer):
    """LMCache `Deserializer`: a payload (possibly followed by unused buffer bytes) -> the exact chunk."""

    def __init__(self, coder: ChunkCoder):
        self.coder = coder

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        """Decode ``src`` into ``dst`` (checked against ``dst``'s shape and dtype)."""
        shape, dtype = _single_group(dst.get_shapes(), dst.get_dtypes())
        data, out = src.tensor, dst.tensor
        if data is None or out is None:
            raise ValueError("hf_kvcompress serde: source or destination MemoryObj has no tensor (invalidated?)")
        data = data.reshape(-1).view(torch.uint8).cpu()
        chunk = self.coder.decode(memoryview(data.numpy()), shape=shape, dtype=dtype)
        out.reshape(shape).copy_(chunk)  # to the destination's device


def coder_from_kwargs(kwargs: dict[str, Any]) -> ChunkCoder:
    """The `ChunkCoder` described by serde kwargs (see module docstring); unknown keys are an error."""
    unknown = sorted(set(kwargs) - set(KWARGS))
    if unknown:
        raise ValueError(f"hf_kvcompress serde: unknown option(s) {unknown}; known: {list(KWARGS)}")
    calibration = _calibration(kwargs)
    threads = kwargs.get("threads") if kwargs.get("threads") is not None else 1
    portable = kwargs.get("portable") if kwargs.get("portable") is not None else False
    if not isinstance(portable, bool):
        raise ValueError(f"hf_kvcompress serde: portable must be true or false, got {portable!r}")
    if portable and calibration is not None:
        raise ValueError("hf_kvcompress serde: portable is model-free coding without a RoPE frame, a calibration "
                         "codes with its below or context predictor: give one or the other (payloads of either decode on "
                         "every CPU)")
    if portable and kwargs.get("rope_theta") is not None:
        raise ValueError("hf_kvcompress serde: portable codes without a RoPE frame; give portable or rope_theta, "
                         "not both")
    if kwargs.get("model_config") is not None:
        if any(kwargs.get(k) is not None for k in ("layers", "kv_heads", "head_dim", "rope_theta")):
            raise ValueError("hf_kvcompress serde: give model_config or layers/kv_heads/head_dim/rope_theta, not both")
        source = Path(str(kwargs["model_config"]))
        if source.is_file():
            source = source.parent  # a config.json: its folder
        config = AutoConfig.from_pretrained(str(source))
        return ChunkCoder.from_model_config(config, calibration, threads=threads, portable=portable)
    sizes = {k: _optional_int(kwargs, k) for k in ("layers", "kv_heads", "head_dim")}
    rope = None
    if kwargs.get("rope_theta") is not None:
        if calibration is not None:
            raise ValueError("hf_kvcompress serde: rope_theta is for model-free coding; a calibration has its own")
        theta, head_dim = kwargs["rope_theta"], sizes["head_dim"]
        check_number("hf_kvcompress serde: rope_theta", theta, low=1.0, high=math.inf, low_open=True)
        if head_dim is None or head_dim % 2:
            raise ValueError("hf_kvcompress serde: rope_theta needs an even head_dim")
        rope = RopeFrame.standard(theta, head_dim)
    if portable:
        rope = RopeFrame(None)
    return ChunkCoder(calibration, rope=rope, threads=threads, **sizes)


def _optional_int(kwargs: dict[str, Any], name: str) -> int | None:
    value = kwargs.get(name)
    if value is not None:
        check_int(f"hf_kvcompress serde: {name}", value, minimum=1)
    return value


def _calibration(kwargs: dict[str, Any]) -> Calibration | None:
    path, fingerprint = kwargs.get("calibration"), kwargs.get("calibration_fingerprint")
    if path is not None and fingerprint is not None:
        raise ValueError("hf_kvcompress serde: give calibration or calibration_fingerprint, not both")
    if fingerprint is not None:
        if not isinstance(fingerprint, str) or not fingerprint.isalnum():
            raise ValueError(f"hf_kvcompress serde: calibration_fingerprint must be a model fingerprint, got {fingerprint!r}")
        path = calibration_dir(fingerprint)  # the model's default calibration
    if path is None:
        return None
    calibration = Calibration.load(str(path))
    if fingerprint is not None and calibration.fingerprint != fingerprint:
        raise ValueError(f"hf_kvcompress serde: {path} holds a calibration of model {calibration.fingerprint}, "
                         f"not {fingerprint}")
    return calibration


def create_serde(kwargs: dict[str, object]) -> SerdeProcessor:
    """The serde factory registered with LMCache: serde kwargs -> an `AsyncSerdeProcessor`."""
    kwargs = dict(kwargs)
    pad = kwargs.pop("pad_to_estimate", False)
    workers = kwargs.pop("max_workers", 1)
    if not isinstance(pad, bool):
        raise ValueError(f"hf_kvcompress serde: pad_to_estimate must be true or false, got {pad!r}")
    check_int("hf_kvcompress serde: max_workers", workers, minimum=1)
    coder = coder_from_kwargs(kwargs)
    return AsyncSerdeProcessor(LosslessSerializer(coder, pad), LosslessDeserializer(coder), max_workers=workers)


def register(name: str = SERDE_NAME) -> None:
    """Register the serde factory under ``name`` (once; importing this module registers the default name)."""
    if name not in get_registered_serde_types():
        register_serde_factory(name, create_serde)


def adapter_spec(base_path: str, **serde_kwargs: Any) -> str:
    """The ``--l2-adapter`` JSON of an ``fs`` adapter with this serde (a convenience for scripts and docs)."""
    return json.dumps({"type": "fs", "base_path": base_path, "serde": {"type": SERDE_NAME, **serde_kwargs}})


register()
