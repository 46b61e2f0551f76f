"""Lossless coding of whole KV chunks: every layer's keys and values for one run of tokens.

A chunk is ``[2, layers, tokens, kv_heads * head_dim]`` (LMCache's ``KV_2LTD`` layout; index 0 = keys),
bfloat16 or float16. `ChunkCoder.encode` turns it into one self-checking payload and `ChunkCoder.decode`
gives it back bit for bit. Each (layer, k/v, head) is one codec stream (channel-major, as the cache codes a
block), with its mean and spread from a predictor run across the chunk's layers, bottom up:

- no calibration: per-chunk statistics (each channel's mean and spread, sent as bf16 side data, with keys
  in a RoPE frame relative to the chunk's first token: `ChunkStatsPredictor`), so any model's chunk codes
  with no set-up. The frame is the model's when configured, else guessed from the chunk
  (`guess_rope_frame`), and travels with the payload;
- with a `Calibration`: the ``below`` predictor where it has its heads (the layer below through calibrated
  linear maps, a kind at a time: payload mode 3), else ``context`` (the layer below, earlier heads, calibrated
  linear maps: mode 2); both with per-layer marginals. The chunk must then have the calibrated model's shape. Its keys are un-rotated
  at absolute positions, which a chunk does not carry: the encoder estimates the first token's position
  (`estimate_first_position`) and records it; a wrong estimate only costs ratio, never exactness.

Payload: a fixed header (magic, version, dtype, mode, shape, first position, calibration id, body length,
CRC-32 of the decoded chunk, CRC-32 of the payload) and a body (model-free: the RoPE frame first). A chunk whose coded body would not be
smaller than its raw bytes is stored raw, so the payload never exceeds `max_payload_bytes`. Anything
that cannot decode to the exact chunk raises `ChunkPayloadError`; the CRC of the decoded chunk is checked
last, so a payload never decodes to a wrong chunk silently.
"""

from __future__ import annotations

import math
import struct
import threading
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from ..blockcodec import BlockCodec
from ..blockcoder import (
    CodedStreams,
    DecodeItem,
    EncodeItem,
    decode_blocks,
    encode_blocks,
    expected_side,
    listed_problem,
    one_thread,
)
from ..calibration import Calibration
from ..codec import CodecConfig, CorruptStreamError, stream_info
from ..errors import ChunkError, ChunkPayloadError
from ..identity import kv_shape
from ..predictors.base import ROUNDING_TOLERANCE, BlockInputs, LayerValues, Predictor, PredictorSession
from ..predictors.below import BelowPredictor
from ..predictors.context import ContextPredictor
from ..predictors.generic import BlockStatsSession, block_stats
from ..predictors.grid import GridPredictor
from ..predictors.registry import head_set
from ..predictors.rope import RopeFrame
from ..validation import check_int

MAGIC = b"HFKVCHNK"
VERSION = 3  # 3: mode `MODE_GRID` (issue 48); 2: portable statistics (float64, settled; listed elements after each
#: stream of a portable session); payloads of version 2 (no grid mode) still decode
READ_VERSIONS = (2, 3)
DTYPES: dict[torch.dtype, int] = {torch.bfloat16: 1, torch.float16: 2}
MODE_RAW, MODE_STATS, MODE_CONTEXT, MODE_BELOW, MODE_GRID = 0, 1, 2, 3, 4
MODE_NAMES = {MODE_RAW: "raw", MODE_STATS: "chunk statistics", MODE_CONTEXT: "context (calibrated)",
              MODE_BELOW: "below (calibrated)", MODE_GRID: "grid (calibrated)"}
#: the calibrated modes and their predictors, in the order an encoder picks the first whose head set its
#: calibration holds: ``below``'s heads code with ``grid`` (statistics every CPU computes alike, no settled listing,
#: the ``mhuff`` coder: docs/results/lossless.md "Calibrated storage (issue 48)"), else ``context``. ``below``
#: payloads (version 2's choice) still decode
CALIBRATED_MODES = {MODE_GRID: GridPredictor, MODE_BELOW: BelowPredictor, MODE_CONTEXT: ContextPredictor}
#: modes an encoder writes today
WRITTEN_MODES = (MODE_GRID, MODE_CONTEXT)
# magic, version, dtype, mode, reserved, layers, tokens, hidden, heads (streams per layer and k/v), first
# position, model id (the calibration's; zeros model-free), body length, CRC-32 of the decoded chunk's
# bytes, CRC-32 of everything before this field plus the body
HEADER = struct.Struct("<8sBBBBIIIII8sQII")
STREAM = struct.Struct("<bI")  # std scale code (quarter octaves, see blockcoder.choose_scale), blob length
LISTED = struct.Struct("<I")  # a portable session's stream: how many listed elements follow (element, mean, std bits)
SIDE_DTYPES: dict[torch.dtype, int] = {torch.bfloat16: 1, torch.float32: 2}
# the lossless cache's default codec setting (config.LosslessConfig): the compiled interleaved-rANS ``lanes``
# coder (one window per stream, ~24-byte stream header, many streams per call), coarser mean steps (fewer
# table switches with per-element means). Spelled out, not imported: payloads of this VERSION must not
# change when the cache's defaults do.
CODEC_CONFIG = CodecConfig(coder="lanes", header="compact", fixed_window=65536, mean_steps=4)
#: a `MODE_GRID` payload's streams: the predictor's own coder (`Predictor.storage_coder`, spelled out for the same
#: reason)
GRID_CODEC_CONFIG = CodecConfig(coder="mhuff", header="compact", fixed_window=65536, mean_steps=4)

# predictor maths runs with one torch thread (blockcoder.one_thread), a process-wide setting: chunks are
# coded one at a time so concurrent serde workers cannot change it under each other
_LOCK = threading.Lock()




@dataclass(frozen=True)
class ChunkHeader:
    """The fixed header of a payload (see module docstring)."""

    dtype: torch.dtype
    mode: int
    layers: int
    tokens: int
    hidden: int
    heads: int
    first_position: int
    model_id: bytes
    body_length: int
    chunk_crc: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (2, self.layers, self.tokens, self.hidden)

    @property
    def payload_length(self) -> int:
        return HEADER.size + self.body_length


def calibration_id(calibration: Calibration | None) -> bytes:
    """8 bytes naming a calibration in payloads (from its tensors' SHA-256); zeros for none."""
    if calibration is None:
        return bytes(8)
    return bytes.fromhex(calibration.meta["tensors_sha256"][:16])


def max_payload_bytes(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> int:
    """Upper bound of a payload's size: the header plus the raw chunk (the raw fallback's size)."""
    check_layout(shape, dtype)
    return HEADER.size + int(np.prod(shape)) * torch.finfo(dtype).bits // 8


def check_layout(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> None:
    """Raise `ChunkError` unless ``shape``/``dtype`` is a ``[2, layers, tokens, hidden]`` bf16/fp16 chunk."""
    if dtype not in DTYPES:
        raise ChunkError(f"KV chunk dtype {dtype} is not supported; bfloat16 and float16 are (lossless codec)")
    shape = tuple(int(s) for s in shape)
    if len(shape) != 4 or shape[0] != 2:
        raise ChunkError(
            f"KV chunk of shape {shape} is not in the [2, layers, tokens, kv_heads * head_dim] (KV_2LTD) "
            "layout; MLA / fused-KV ([layers, tokens, dim]) and other layouts are not supported"
        )
    if min(shape) < 1:
        raise ChunkError(f"KV chunk of shape {shape} is empty")
    if max(shape) >= 1 << 32:
        raise ChunkError(f"KV chunk of shape {shape} is too large for the payload header")


def parse_header(payload: bytes | bytearray | memoryview) -> ChunkHeader:
    """The checked header of ``payload`` (which may be followed by unused buffer bytes)."""
    view = memoryview(payload).cast("B")
    if len(view) < HEADER.size:
        raise ChunkPayloadError(f"KV chunk payload of {len(view)} bytes is shorter than its {HEADER.size}-byte header")
    (magic, version, dtype_code, mode, _reserved, layers, tokens, hidden, heads, first_position, cal_id, body_length,
     chunk_crc, payload_crc) = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise ChunkPayloadError("not an hf_kvcompress KV chunk payload (bad magic bytes)")
    if version not in READ_VERSIONS or (version < 3 and mode == MODE_GRID):
        why = " (version 1 held float32 statistics; re-encode the chunk)" if version == 1 else ""
        raise ChunkPayloadError(f"KV chunk payload format version {version}"
                                f"{' with mode ' + str(mode) if version in READ_VERSIONS else ''}; this library reads "
                                f"versions {list(READ_VERSIONS)}{why}")
    if len(view) < HEADER.size + body_length:
        raise ChunkPayloadError(
            f"KV chunk payload truncated: header announces {HEADER.size + body_length} bytes, got {len(view)}"
        )
    crc = zlib.crc32(view[HEADER.size : HEADER.size + body_length], zlib.crc32(view[: HEADER.size - 4]))
    if crc != payload_crc:
        raise ChunkPayloadError("KV chunk payload corrupted: its CRC-32 does not match")
    dtypes = {code: dtype for dtype, code in DTYPES.items()}
    if dtype_code not in dtypes or mode not in MODE_NAMES or heads < 1 or hidden % heads:
        raise ChunkPayloadError(f"KV chunk payload header is inconsistent (dtype {dtype_code}, mode {mode}, "
                                f"{heads} heads of {hidden} channels)")
    return ChunkHeader(dtypes[dtype_code], mode, layers, tokens, hidden, heads, first_position, cal_id,
                       body_length, chunk_crc)


class ChunkStatsPredictor(Predictor):
    """Model-free means and spreads: each channel's mean and spread over the chunk (bf16 side data, the
    `block_stats` of the cache's generic mode), with keys taken in a RoPE frame relative to the chunk's
    first token. Rotating keys back by their offset in the chunk turns a channel pair's circling mean into a
    constant (``R(p0) * mean``), which per-channel statistics then capture; the absolute position is not
    needed. ``frame=RopeFrame(None)`` gives plain per-channel statistics."""

    name = "chunk-stats"

    def __init__(self, frame: RopeFrame):
        super().__init__()
        self.frame = frame

    def side_data(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        relative = torch.arange(keys.shape[2])
        stats = block_stats(self.frame.unrotate(keys, relative), values)
        # sums over values near the float32 limit overflow: keep the side data finite (the codec needs it)
        top = torch.finfo(torch.bfloat16).max
        return {name: torch.nan_to_num(t, nan=0.0, posinf=top, neginf=-top) for name, t in stats.items()}

    def session(self, inputs: BlockInputs) -> PredictorSession:
        return _RelativeStatsSession(inputs, self.frame)


class _RelativeStatsSession(BlockStatsSession):
    """Keys rotated back in float64 (`portable`: cos / sin round differently between CPUs), values exact."""

    def __init__(self, inputs: BlockInputs, frame: RopeFrame):
        super().__init__(inputs)
        self.frame = frame.in_float64()
        self.portable = not frame.is_identity
        self.relative = torch.arange(self.tokens)
        self._last: tuple[str, int, torch.Tensor, torch.Tensor] | None = None

    def predict(self, kind: str, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        mean, std = super().predict(kind, head)
        if kind == "k" and self.portable:
            exact = mean.double()
            mean = self.frame.rotate(exact, self.relative)
            std = self.frame.rotate_variance(std.double().square(), self.relative).sqrt()
            self._last = (kind, head, exact, std)
        return mean, std

    def bounds(self, kind: str, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        # exact side-data statistics, then one rotation: only cos / sin and a few roundings differ between CPUs
        if self._last is None or self._last[:2] != (kind, head):
            raise RuntimeError(f"bounds({kind!r}, {head}) without a matching predict() of a rotated stream")
        _, _, exact, std = self._last
        zero = torch.zeros_like(std)
        return (self.frame.rotate_tolerance(zero, exact.abs().expand_as(std), self.relative, ROUNDING_TOLERANCE),
                self.frame.rotate_tolerance(zero, std, self.relative, ROUNDING_TOLERANCE))


class ChunkCoder:
    """Codes KV chunks losslessly (see module docstring).

    Args:
        calibration: a `Calibration` with the ``below`` or ``context`` predictor (``below`` where it has both;
            None: per-chunk statistics, model-free).
        layers, kv_heads, head_dim: the model's shape; chunks of another shape are refused. With a
            calibration they come from it; model-free, any may be None (then: any layer count, any width,
            one stream per layer and k/v).
        rope: the model's rotary frame for model-free coding (`RopeFrame.from_model_config`; needs
            ``head_dim``); ``RopeFrame(None)``: plain per-channel statistics; None: `guess_rope_frame` per
            chunk. Model-free payloads carry their frame, so readers need not be configured alike. With a
            calibration, the calibration's frame.
        threads: codec threads for model-free chunks, whose streams are coded in batches (the compiled
            coder releases the GIL); calibrated chunks are coded stream by stream, each stream's prediction
            reading the ones before it.
    """

    def __init__(self, calibration: Calibration | None = None, *, layers: int | None = None,
                 kv_heads: int | None = None, head_dim: int | None = None, rope: RopeFrame | None = None,
                 threads: int = 1):
        check_int("ChunkCoder: threads", threads, minimum=1)
        self.threads = threads
        self.calibration = calibration
        self._codecs: dict[int, BlockCodec] = {}  # `_codec_config`'s, per payload mode
        if calibration is not None:
            fitted = [mode for mode in WRITTEN_MODES if head_set(CALIBRATED_MODES[mode].name) in calibration.predictors]
            if not fitted:
                raise ValueError(
                    f"this calibration has no 'below' or 'context' predictor (it has {calibration.predictors}); "
                    "fit one with: hf-kvcompress calibrate --predictors below"
                )
            model = calibration.meta["model"]
            want = {"layers": model["layers"], "kv_heads": model["kv_heads"], "head_dim": model["head_dim"]}
            for name, value in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
                if value is not None and value != want[name]:
                    raise ValueError(f"{name}={value} contradicts the calibration's model ({name}={want[name]})")
            layers, kv_heads, head_dim = want["layers"], want["kv_heads"], want["head_dim"]
            self._mode = fitted[0]
            self.predictor: Predictor | None = self._calibrated(self._mode)
            self.rope: RopeFrame | None = calibration.rope_frame()
            self.model_id = calibration_id(calibration)
        else:
            if rope is not None and not rope.is_identity and (head_dim is None or rope.inv_freq.numel() * 2 != head_dim):
                raise ValueError(f"a RoPE frame needs head_dim = 2 * {rope.inv_freq.numel()} rotary "
                                 f"frequencies, got head_dim={head_dim}")
            self.rope = rope
            self.predictor = None  # per chunk: ChunkStatsPredictor of the chunk's frame
            self.model_id = bytes(8)
        for name, value in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if value is not None:
                check_int(f"ChunkCoder: {name}", value, minimum=1)
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim

    @classmethod
    def from_model_config(cls, config, calibration: Calibration | None = None, threads: int = 1, *,
                          portable: bool = False) -> ChunkCoder:
        """A coder for chunks of the model with transformers ``config`` (shape checks; RoPE frame, or none with
        ``portable``: model-free payloads whose decoding does not depend on the CPU's float arithmetic)."""
        if portable and calibration is not None:
            raise ValueError("portable coding is model-free: it takes no calibration")
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        kv_heads, head_dim = kv_shape(text)
        if calibration is not None:
            rope = None
        else:
            rope = RopeFrame(None) if portable else RopeFrame.from_model_config(config)
        return cls(calibration, layers=text.num_hidden_layers, kv_heads=kv_heads, head_dim=head_dim, rope=rope,
                   threads=threads)

    @property
    def mode(self) -> int:
        return MODE_STATS if self.calibration is None else self._mode

    def _calibrated(self, mode: int) -> Predictor:
        """The calibrated predictor of ``mode`` (payloads of either calibrated mode decode with the calibration)."""
        if mode == getattr(self, "_mode", None) and getattr(self, "predictor", None) is not None:
            return self.predictor
        return CALIBRATED_MODES[mode](self.calibration, portable=True)  # payloads are read on other machines

    @property
    def hidden(self) -> int | None:
        """``kv_heads * head_dim`` if both are known."""
        return self.kv_heads * self.head_dim if self.kv_heads and self.head_dim else None

    def heads_of(self, hidden: int) -> int:
        """Streams per layer and k/v for a chunk ``hidden`` channels wide."""
        if self.kv_heads is not None:
            return self.kv_heads
        return hidden // self.head_dim if self.head_dim is not None else 1

    def check_chunk(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> None:
        """Raise `ChunkError` unless this coder takes chunks of ``shape`` and ``dtype``."""
        check_layout(shape, dtype)
        _, layers, _, hidden = (int(s) for s in shape)
        source = "the calibrated model" if self.calibration is not None else "the configured model"
        if self.layers is not None and layers != self.layers:
            raise ChunkError(f"KV chunk of shape {tuple(int(s) for s in shape)} has {layers} layers, {source} "
                             f"has {self.layers}: a chunk of another model")
        if self.hidden is not None and hidden != self.hidden:
            raise ChunkError(f"KV chunk of shape {tuple(int(s) for s in shape)} is {hidden} channels wide, {source} "
                             f"has {self.kv_heads} kv heads x {self.head_dim} = {self.hidden}: a chunk of another model")
        if self.head_dim is not None and hidden % self.head_dim:
            raise ChunkError(f"KV chunk width {hidden} is not a multiple of head_dim={self.head_dim}")
        if hidden % self.heads_of(hidden):
            raise ChunkError(f"KV chunk width {hidden} is not a multiple of kv_heads={self.kv_heads}")

    # ------------------------------------------------------------------ encode

    def encode(self, chunk: torch.Tensor, first_position: int | None = None) -> bytes:
        """The payload of ``chunk`` (any device; coded on the host). ``first_position``: the position of
        the chunk's first token, which the calibrated (``context``) predictor un-rotates keys with (None:
        `estimate_first_position`; unused model-free). Any value decodes exactly; the right one codes smaller."""
        if not isinstance(chunk, torch.Tensor):
            raise TypeError(f"KV chunk must be a torch.Tensor, got {type(chunk).__name__}")
        self.check_chunk(chunk.shape, chunk.dtype)
        chunk = chunk.detach().to("cpu").contiguous()
        if self.calibration is None:
            first_position = 0
        elif first_position is None:
            first_position = estimate_first_position(chunk, self.calibration)
        if not 0 <= first_position < 1 << 32:
            raise ValueError(f"first_position must lie in [0, 2^32), got {first_position}")
        raw = chunk.view(torch.int16).numpy().tobytes()
        _, layers, tokens, hidden = chunk.shape
        heads, predictor, prefix = self.heads_of(hidden), self.predictor, b""
        try:
            with _LOCK, one_thread():
                if predictor is None:  # model-free: the chunk's RoPE frame, sent first
                    frame = self.rope if self.rope is not None else guess_rope_frame(chunk, self.kv_heads, self.head_dim)
                    if not frame.is_identity:
                        heads = hidden // (2 * frame.inv_freq.numel())
                    predictor, prefix = ChunkStatsPredictor(frame), _pack_frame(frame)
                body = prefix + self._encode_layers(chunk, heads, first_position, predictor)
        except ValueError:
            # the predictor gave the codec a non-finite mean or spread (values near the float limits
            # overflow float32 statistics): such a chunk is stored raw
            body = raw
        mode = self.mode
        if len(body) >= len(raw):  # incompressible (e.g. noise): store raw, keeping the size bound
            body, mode, heads = raw, MODE_RAW, 1
        head = HEADER.pack(MAGIC, VERSION, DTYPES[chunk.dtype], mode, 0, layers, tokens, hidden, heads,
                           first_position, self.model_id, len(body), zlib.crc32(raw), 0)
        crc = zlib.crc32(body, zlib.crc32(head[:-4]))
        return head[:-4] + crc.to_bytes(4, "little") + body

    def _encode_layers(self, chunk: torch.Tensor, heads: int, first_position: int, predictor: Predictor) -> bytes:
        """The body after the frame: per layer its side data, then its streams in `stream_order`, each a `STREAM`
        record (scale code, length, blob) followed, for a portable session, by its listed elements (`LISTED`).
        Chunk statistics (independent sessions) code every layer in one block coder call; the calibrated
        predictor layer by layer, each layer's session reading the one below."""
        layers, tokens = chunk.shape[1], chunk.shape[2]
        independent = isinstance(predictor, ChunkStatsPredictor)
        sides, coded, items, below = [], [], [], None
        for layer in range(layers):
            keys, values = (_heads_view(chunk[kind, layer], heads) for kind in (0, 1))
            side = predictor.side_data(layer, keys, values)
            sides.append(_pack_side(side))
            session = predictor.session(self._inputs(layer, tokens, first_position, below, side))
            item = EncodeItem(session, keys, values, self._codec_config(layer, self.mode))
            if independent:
                items.append(item)
            else:
                coded += encode_blocks([item], self.threads)
                below = session.finish(keys, values)
        coded += encode_blocks(items, self.threads)
        parts: list[bytes] = []
        for side, streams in zip(sides, coded):
            parts.append(side)
            for index, (code, blob) in enumerate(zip(streams.codes[0], streams.blobs[0])):
                parts += [STREAM.pack(code, len(blob)), blob]
                if streams.listed is not None:
                    listed = streams.listed[0][index]
                    parts += [LISTED.pack(listed.shape[0]), listed.astype("<i4").tobytes()]
        return b"".join(parts)

    # ------------------------------------------------------------------ decode

    def decode(self, payload: bytes | bytearray | memoryview, *, shape: tuple[int, ...] | torch.Size | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """The chunk coded in ``payload`` (trailing bytes after the payload are ignored), on the host. With
        ``shape``/``dtype``, a payload of another chunk shape or dtype is refused."""
        header = parse_header(payload)
        if shape is not None and tuple(int(s) for s in shape) != header.shape:
            raise ChunkPayloadError(f"KV chunk payload holds a chunk of shape {header.shape}, expected {tuple(shape)}")
        if dtype is not None and dtype != header.dtype:
            raise ChunkPayloadError(f"KV chunk payload holds a {header.dtype} chunk, expected {dtype}")
        body = memoryview(payload).cast("B")[HEADER.size : header.payload_length]
        if header.mode == MODE_RAW:
            if len(body) * 8 != int(np.prod(header.shape)) * torch.finfo(header.dtype).bits:
                raise ChunkPayloadError("KV chunk payload (raw) has the wrong length for its shape")
            chunk = torch.frombuffer(bytearray(body), dtype=torch.int16).view(header.dtype).reshape(header.shape)
        else:
            try:
                self.check_chunk(header.shape, header.dtype)
            except ChunkError as err:
                raise ChunkPayloadError(f"KV chunk payload does not fit this coder: {err}") from err
            # model-free payloads carry all they need; calibrated ones need the writer's calibration
            calibrated = header.mode in CALIBRATED_MODES
            if calibrated and (self.calibration is None or header.model_id != self.model_id
                               or head_set(CALIBRATED_MODES[header.mode].name) not in self.calibration.predictors):
                have = f"calibration {self.model_id.hex()}" if self.calibration is not None else "no calibration"
                raise ChunkPayloadError(
                    f"KV chunk payload was coded with calibration {header.model_id.hex()}, this coder has {have}: "
                    "configure every reader with the writer's calibration"
                )
            if calibrated and header.heads != self.heads_of(header.hidden):
                raise ChunkPayloadError(f"KV chunk payload has {header.heads} streams per layer, the calibrated "
                                        f"model {self.heads_of(header.hidden)}")
            try:
                predictor, offset = self._calibrated(header.mode) if calibrated else None, 0
                if header.mode == MODE_STATS:
                    frame, offset = _unpack_frame(body, header)
                    predictor = ChunkStatsPredictor(frame)
                _check_first_stream(body, offset, header, self._codec_config(0, header.mode))
                with _LOCK, one_thread():
                    chunk = self._decode_layers(body, header, predictor, offset)
            except ChunkPayloadError:
                raise
            except (CorruptStreamError, ValueError, struct.error, RuntimeError, IndexError) as err:
                # CorruptStreamError: a stream's bytes; the others: side data or stream tables damaged
                # in a way the payload CRC did not see (or another library version's predictor)
                raise ChunkPayloadError(f"KV chunk payload does not decode: {err}") from err
        if zlib.crc32(chunk.view(torch.int16).numpy().tobytes()) != header.chunk_crc:
            raise ChunkPayloadError("KV chunk payload decoded to a chunk whose CRC-32 differs from the encoder's")
        return chunk

    def _decode_layers(self, body: memoryview, header: ChunkHeader, predictor: Predictor, offset: int) -> torch.Tensor:
        """Inverse of `_encode_layers`: chunk statistics walk the body once and decode every layer in one block
        coder call; the calibrated predictor decodes layer by layer (each layer's session reads the one below)."""
        heads, dim, tokens = header.heads, header.hidden // header.heads, header.tokens
        independent = isinstance(predictor, ChunkStatsPredictor)
        first_position = 0 if independent else header.first_position
        chunk = torch.empty(header.shape, dtype=header.dtype)
        items, below = [], None
        for layer in range(header.layers):
            side, offset = _unpack_side(body, offset)
            _check_side(side, predictor, layer, heads, dim, header.dtype)
            session = predictor.session(self._inputs(layer, tokens, first_position, below, side))
            streams, offset = _read_streams(body, offset, 2 * heads, session.portable, tokens * dim)
            item = DecodeItem(session, streams, heads, tokens, dim, dim, header.dtype,
                              self._codec_config(layer, header.mode))
            if independent:
                items.append(item)
                continue
            [(keys, values)] = decode_blocks([item], self.threads)
            below = session.finish(keys, values)
            _place(chunk, layer, keys, values)
        if offset != len(body):
            raise ChunkPayloadError(f"KV chunk payload has {len(body) - offset} unexpected trailing body bytes")
        for layer, (keys, values) in enumerate(decode_blocks(items, self.threads)):
            _place(chunk, layer, keys, values)
        return chunk

    # ------------------------------------------------------------------ shared

    def _inputs(self, layer: int, tokens: int, first_position: int, below: LayerValues | None,
                side: dict[str, torch.Tensor]) -> BlockInputs:
        positions = torch.arange(first_position, first_position + tokens)
        return BlockInputs(layer, 1, positions, below if layer > 0 else None, dict(side))

    def _codec_config(self, layer: int, mode: int) -> CodecConfig:
        """The codec setting of ``layer``'s streams in a payload of ``mode``: `CODEC_CONFIG`, with the calibration's
        marginals where the mode's predictor is calibrated (the block codec's rule, `BlockCodec.marginals`)."""
        if mode not in self._codecs:
            predictor = self._calibrated(mode) if mode in CALIBRATED_MODES else ChunkStatsPredictor(RopeFrame(None))
            self._codecs[mode] = BlockCodec(predictor, GRID_CODEC_CONFIG if mode == MODE_GRID else CODEC_CONFIG,
                                            self.calibration)
        return self._codecs[mode].codec_for(layer)


# RoPE bases of common model families (Llama 2 / Gemma 1e4, SmolLM2 1e5, Llama 3 5e5, Qwen 2.5 / Mistral 1e6,
# long-context variants 1e7) and head sizes: the candidates `guess_rope_frame` tries
ROPE_THETAS = (1e4, 1e5, 5e5, 1e6, 1e7)
ROPE_HEAD_DIMS = (64, 128, 256, 96, 80, 32, 16)
GUESS_LAYERS = 4  # layers (evenly spread) the guess looks at


def guess_rope_frame(chunk: torch.Tensor, kv_heads: int | None = None, head_dim: int | None = None) -> RopeFrame:
    """The standard RoPE frame (base in `ROPE_THETAS`, head size in `ROPE_HEAD_DIMS` or given) under which the
    chunk's keys, un-rotated by their offset in the chunk, have the smallest per-channel spread (the Gaussian
    code length ``sum log var`` the model-free coder pays), or the identity frame if none beats it. A guess
    only costs ratio: the frame is sent with the payload."""
    _, layers, tokens, hidden = chunk.shape
    if head_dim is not None:
        dims = (head_dim,)
    elif kv_heads is not None:
        dims = (hidden // kv_heads,)
    else:
        dims = tuple(d for d in ROPE_HEAD_DIMS if hidden % d == 0)
    picked = sorted({round(i * (layers - 1) / max(GUESS_LAYERS - 1, 1)) for i in range(GUESS_LAYERS)})
    keys = chunk[0, picked].to(torch.float32)  # [n, tokens, hidden]
    relative = torch.arange(tokens)

    def cost(x: torch.Tensor) -> float:
        return float(x.var(dim=-2, correction=0).clamp_min(1e-12).log().sum())

    best, best_cost = RopeFrame(None), cost(keys)
    for dim in dims:
        if dim % 2 or hidden % dim:
            continue
        heads_first = keys.reshape(len(picked), tokens, hidden // dim, dim).transpose(1, 2)  # [n, H, T, d]
        for theta in ROPE_THETAS:
            frame = RopeFrame.standard(theta, dim)
            c = cost(frame.unrotate(heads_first, relative))
            if c < best_cost:
                best, best_cost = frame, c
    return best


def _read_listed(body: memoryview, offset: int, elements: int) -> tuple[np.ndarray, int]:
    """The listed elements after a portable session's stream (checked: in range, strictly increasing)."""
    if offset + LISTED.size > len(body):
        raise ChunkPayloadError("KV chunk payload truncated before a stream's listed elements")
    (count,) = LISTED.unpack_from(body, offset)
    offset += LISTED.size
    if count > elements or offset + 12 * count > len(body):
        raise ChunkPayloadError(f"KV chunk payload lists {count} elements of a {elements}-element stream")
    entries = np.frombuffer(body, dtype="<i4", count=3 * count, offset=offset).reshape(count, 3).astype(np.int32)
    problem = listed_problem(entries[:, 0].astype(np.int64), elements)
    if problem is not None:
        raise ChunkPayloadError(f"KV chunk payload's listed elements are {problem}")
    return entries, offset + 12 * count


def _pack_frame(frame: RopeFrame) -> bytes:
    """A model-free payload's RoPE frame: u16 count, then the float32 inverse frequencies."""
    inv_freq = np.zeros(0, dtype="<f4") if frame.is_identity else frame.inv_freq.numpy().astype("<f4")
    return struct.pack("<H", inv_freq.size) + inv_freq.tobytes()


def _unpack_frame(body: memoryview, header: ChunkHeader) -> tuple[RopeFrame, int]:
    (count,) = struct.unpack_from("<H", body, 0)
    if count and header.heads * 2 * count != header.hidden:
        raise ChunkPayloadError(f"KV chunk payload's RoPE frame ({count} frequencies) does not fit {header.heads} "
                                f"heads of {header.hidden} channels")
    if 2 + 4 * count > len(body):
        raise ChunkPayloadError("KV chunk payload truncated inside its RoPE frame")
    inv_freq = np.frombuffer(body, dtype="<f4", count=count, offset=2).astype(np.float32)
    if not np.isfinite(inv_freq).all():
        raise ChunkPayloadError("KV chunk payload's RoPE frame is not finite")
    return RopeFrame(torch.from_numpy(inv_freq.copy()) if count else None), 2 + 4 * count


def estimate_first_position(chunk: torch.Tensor, calibration: Calibration, max_position: int | None = None) -> int:
    """The position of ``chunk``'s first token, from the phase of its layer-0 keys.

    RoPE turns each channel pair of a key into a phasor rotating at its own frequency. Un-rotated by their
    offsets inside the chunk, the first key head's tokens average to the calibrated pre-RoPE mean (the bias
    of the ``below`` or ``context`` head ``L0/k0``, which has no other features) rotated by ``theta * p0``; the ``p0`` in
    ``[0, max_position)`` whose rotation best matches, summed over frequencies, is returned (0 without RoPE).
    Measured on SmolLM2 (docs/lmcache.md): the exact position for every offset tried.
    """
    frame = calibration.rope_frame()
    if frame.is_identity:
        return 0
    if max_position is None:
        config = calibration.meta["model"].get("config", {})
        max_position = int(config.get("max_position_embeddings") or 131072)
    head_dim = calibration.meta["model"]["head_dim"]
    # the layer-0 key bias of a head set with no other layer-0 key features (``below`` or ``context``)
    name = next(head_set(cls.name) for cls in CALIBRATED_MODES.values() if head_set(cls.name) in calibration.predictors)
    mean = calibration.stream_heads(name, 0)[("k", 0)].weight[0].to(torch.float64)  # [head_dim]
    keys = chunk[0, 0, :, :head_dim].to(torch.float32)  # first key head of layer 0, [tokens, head_dim]
    relative = frame.unrotate(keys, torch.arange(keys.shape[0])).mean(dim=0).to(torch.float64)
    half = head_dim // 2
    seen = torch.complex(relative[:half], relative[half:])
    want = torch.complex(mean[:half], mean[half:])
    product = seen * want.conj()  # |seen||want| e^{i theta p0} ideally
    weight, phase = product.abs(), product.angle()
    inv_freq = frame.inv_freq.to(torch.float64)
    best, best_score = 0, -math.inf
    for start in range(0, max_position, 16384):  # bounded memory: 16k candidates x frequencies at a time
        candidates = torch.arange(start, min(start + 16384, max_position), dtype=torch.float64)
        score = (weight * torch.cos(candidates[:, None] * inv_freq - phase)).sum(dim=1)
        index = int(score.argmax())
        if float(score[index]) > best_score:
            best, best_score = start + index, float(score[index])
    return best


def _place(chunk: torch.Tensor, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """A decoded layer's keys and values (``[1, heads, tokens, dim]``) into ``chunk``, the inverse of `_heads_view`."""
    tokens, hidden = chunk.shape[2], chunk.shape[3]
    chunk[0, layer] = keys[0].permute(1, 0, 2).reshape(tokens, hidden)
    chunk[1, layer] = values[0].permute(1, 0, 2).reshape(tokens, hidden)


def _heads_view(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[tokens, heads * dim]`` -> ``[1, heads, tokens, dim]`` (the cache's block layout)."""
    tokens, hidden = x.shape
    return x.reshape(tokens, heads, hidden // heads).permute(1, 0, 2).unsqueeze(0)


def _pack_side(side: dict[str, torch.Tensor]) -> bytes:
    """Side data as ``u8 count`` then per tensor: name, dtype, shape, bytes (all lengths bounded)."""
    out = [struct.pack("<B", len(side))]
    for name in sorted(side):
        t = side[name].detach().cpu().contiguous()
        if t.dtype not in SIDE_DTYPES:
            raise TypeError(f"side data {name!r} has dtype {t.dtype}; {list(SIDE_DTYPES)} are supported")
        encoded = name.encode()
        out.append(struct.pack(f"<B{len(encoded)}sBB", len(encoded), encoded, SIDE_DTYPES[t.dtype], t.dim()))
        out.append(struct.pack(f"<{t.dim()}I", *t.shape))
        out.append(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return b"".join(out)


def _read_streams(body: memoryview, offset: int, count: int, portable: bool,
                  elements: int) -> tuple[CodedStreams, int]:
    """A layer's ``count`` stream records at ``offset`` (each followed by its listed elements for a ``portable``
    session, streams of ``elements`` elements) and the offset after them."""
    codes, blobs, listed = [], [], []
    for _ in range(count):
        code, blob, offset = _read_stream(body, offset)
        codes.append(code)
        blobs.append(blob)
        if portable:
            entries, offset = _read_listed(body, offset, elements)
            listed.append(entries)
    return CodedStreams([codes], [blobs], [listed] if portable else None), offset


def _read_stream(body: memoryview, offset: int) -> tuple[int, bytes, int]:
    """(std scale code, stream bytes, offset after them) of the stream record at ``offset``."""
    if offset + STREAM.size > len(body):
        raise ChunkPayloadError("KV chunk payload truncated inside a stream")
    code, length = STREAM.unpack_from(body, offset)
    offset += STREAM.size
    if offset + length > len(body):
        raise ChunkPayloadError("KV chunk payload truncated inside a stream")
    return code, bytes(body[offset : offset + length]), offset + length


def _check_first_stream(body: memoryview, offset: int, header: ChunkHeader, config: CodecConfig) -> None:
    """The first stream must declare the header's dtype and ``[dim, tokens]`` before the decoders allocate anything
    sized by the header's token count (statistics per token, the decoded layers): a payload's header may claim any
    size, its streams must hold it (every other stream is checked as it decodes)."""
    _, at = _unpack_side(body, offset)
    _, blob, _ = _read_stream(body, at)
    dtype, shape = stream_info(blob, config=config)
    want = (header.hidden // header.heads, header.tokens)
    if dtype != header.dtype or tuple(shape) != want:
        raise ChunkPayloadError(f"KV chunk payload's first stream declares {dtype} {list(shape)}, the header "
                                f"{header.dtype} {list(want)}")


def _check_side(side: dict[str, torch.Tensor], predictor: Predictor, layer: int, heads: int, dim: int,
                dtype: torch.dtype) -> None:
    """A layer's side data must be what ``predictor`` sends for it (`expected_side`; one batch row). The chunk
    coder's predictors send per-channel statistics (model-free) or nothing (calibrated), whatever the token
    count: a one-token probe, so that the token count a payload claims allocates nothing here."""
    want = {name: (t, (1, *shape)) for name, (t, shape) in expected_side(predictor, layer, heads, 1, dim,
                                                                         dtype).items()}
    got = {name: (t.dtype, tuple(t.shape)) for name, t in side.items()}
    if got != want:
        raise ChunkPayloadError(f"KV chunk payload's side data of layer {layer} is {got}, the {predictor.name!r} "
                                f"predictor sends {want}")


def _unpack_side(body: memoryview, offset: int) -> tuple[dict[str, torch.Tensor], int]:
    dtypes = {code: dtype for dtype, code in SIDE_DTYPES.items()}
    (count,) = struct.unpack_from("<B", body, offset)
    offset += 1
    side = {}
    for _ in range(count):
        (length,) = struct.unpack_from("<B", body, offset)
        name = bytes(body[offset + 1 : offset + 1 + length]).decode("ascii", errors="replace")
        offset += 1 + length
        code, ndim = struct.unpack_from("<BB", body, offset)
        offset += 2
        if code not in dtypes or ndim > 8:
            raise ChunkPayloadError(f"KV chunk payload side data {name!r} is corrupt")
        shape = struct.unpack_from(f"<{ndim}I", body, offset)
        offset += 4 * ndim
        nbytes = int(np.prod(shape)) * dtypes[code].itemsize
        if offset + nbytes > len(body):
            raise ChunkPayloadError("KV chunk payload truncated inside side data")
        data = bytearray(body[offset : offset + nbytes])
        offset += nbytes
        side[name] = torch.frombuffer(data, dtype=torch.uint8).view(dtypes[code]).reshape(shape) if nbytes else \
            torch.empty(shape, dtype=dtypes[code])
    return side, offset
