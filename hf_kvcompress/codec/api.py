"""The codec's entry points: thin dispatchers to the coder a config names (`coders.CODERS`; to decode, the
coder whose magic bytes a stream starts with). Re-exported by the package (`hf_kvcompress.codec`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import CorruptStreamError
from .codec_config import CodecConfig
from .coders import CODERS
from .interface import (
    CodecStats,
    Coder,
    PendingDecode,
    check_call_data,
    check_config,
    check_parallel,
    unknown_stream,
)
from .tables import Marginal


def coder_of(config: CodecConfig | None) -> Coder:
    """The coder ``config`` names (None: `CodecConfig()`'s, the default)."""
    return CODERS[check_config(config).coder]


def coder_of_stream(blob) -> Coder:
    """The coder that wrote ``blob`` (by its magic bytes); `CorruptStreamError` if none did."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"codec: blob must be bytes, got {type(blob).__name__}")
    for coder in CODERS.values():
        if _owns(coder, blob):
            return coder
    raise unknown_stream(blob)


def _owns(coder: Coder, blob) -> bool:
    """Whether ``blob`` starts with one of ``coder``'s magic byte strings (`Coder.magic`)."""
    return any(bytes(blob[: len(m)]) == m for m in coder.magic)


def _batch_coder(blobs, cfg: CodecConfig) -> Coder:
    """``cfg``'s coder, after checking that the first of ``blobs`` is one of its streams (a clear error for
    another coder's streams; each coder checks every stream)."""
    coder = CODERS[cfg.coder]
    first = blobs[0] if isinstance(blobs, (list, tuple)) and blobs else None
    if isinstance(first, (bytes, bytearray, memoryview)) and not _owns(coder, first):
        other = next((c.name for c in CODERS.values() if _owns(c, first)), None)
        raise CorruptStreamError(f"codec.decode_batch: stream 0 is {'not a codec stream' if other is None else f'a {other!r} stream'}, "
                                 f"but the config says coder={cfg.coder!r}; pass the encoder's config")
    return coder


def encode(
    x: torch.Tensor,
    mean: torch.Tensor | float | None = None,
    std: torch.Tensor | float | None = None,
    config: CodecConfig | None = None,
) -> bytes:
    """Losslessly code ``x`` (bfloat16, float16 or float32, any shape) given a predicted ``mean`` and
    spread ``std``, each broadcastable to ``x`` (or None: mean 0 / a spread sent as side info)."""
    cfg = check_config(config)
    check_call_data(x, mean, std)
    return CODERS[cfg.coder].encode(x, mean, std, cfg)


def encode_batch(
    x: torch.Tensor,
    mean: torch.Tensor | float | None = None,
    std: torch.Tensor | float | None = None,
    config: CodecConfig | None = None,
    threads: int | None = None,
) -> list[bytes]:
    """Code ``x`` of shape ``[N, ...]`` as N independent streams (``x[i]`` each): one compiled call for a
    batched coder (``lanes``; ``threads`` > 1: one per thread, the streams split between them), stream by
    stream otherwise (``ans``).

    ``mean`` / ``std`` broadcast to ``x`` (e.g. ``[N, 1, D]`` per stream and channel, ``[1, 1, D]`` shared);
    stream ``i`` is byte-identical to ``encode(x[i], mean[i], std[i], config)`` (with ``mean[0]`` for a
    shared leading dim)."""
    cfg = check_config(config)
    check_call_data(x, mean, std)
    return CODERS[cfg.coder].encode_batch(x, mean, std, cfg, threads=threads)


def decode_batch(
    blobs: list[bytes],
    mean: torch.Tensor | float | None = None,
    std: torch.Tensor | float | None = None,
    config: CodecConfig | None = None,
    out: torch.Tensor | None = None,
    threads: int | None = None,
    verify: bool | Sequence[bool] = True,
) -> torch.Tensor:
    """Inverse of `encode_batch`: ``[N, ...]`` from N streams of one shape and dtype, into ``out`` when given:
    a tensor of that dtype and shape, or ``[*lead, *shape]`` with the N streams in row-major order of ``lead``,
    on any device, with any strides that do not overlap (``lanes`` writes a CPU view in place: a cache decodes
    its blocks straight into the tensors attention reads). ``mean`` / ``std`` as for `encode_batch`, checked
    per stream by fingerprint (`ParameterMismatchError`); `CorruptStreamError` for any stream that cannot
    decode exactly.

    ``lanes``: one compiled call (GIL released; ``threads`` > 1 splits the streams over that many threads).
    ``verify`` (True, or one bool per stream): whether to check each stream's hash of its words and decoded
    values. Pass False only for streams this process has already decoded with the check and held since as
    immutable ``bytes`` (a cache decoding its own blocks every step); the structural checks (every word
    consumed, every lane back at its initial state, values inside the dtype) run for every stream. Where it
    runs (`interface.triton_device`): when ``mean``, ``std`` or ``out`` is a CUDA tensor and Triton is
    available, the per-element model and the entropy decoding run there (`device_triton.decode_batch_triton`)
    and the result lands on that device; otherwise the compiled host decoder runs and the result is moved to
    the CUDA device if one was given. Both give the same bits (docs/codec_format.md 12.1).

    ``ans``: stream by stream, each verified whatever ``verify`` says (``threads``: forked workers over one
    stream's windows, as `decode`'s ``workers``)."""
    cfg = check_config(config)
    check_call_data(None, mean, std, out)
    return _batch_coder(blobs, cfg).decode_batch(blobs, mean, std, cfg, out=out, threads=threads, verify=verify)


def start_decode_batch(
    blobs: list[bytes],
    mean: torch.Tensor | float | None,
    std: torch.Tensor | float | None,
    config: CodecConfig,
    out: torch.Tensor | None = None,
    threads: int = 1,
    verify: bool | Sequence[bool] = True,
    chunks: int = 8,
) -> PendingDecode | None:
    """`decode_batch` begun in the background: the streams are parsed and checked here (the same errors),
    then ``threads`` background threads decode them in ``chunks`` pieces while the caller goes on; the returned
    job's ``finish()`` decodes what is left on the calling thread and returns what `decode_batch` would. None
    where the coder has no background form (``ans``) or `decode_batch` would decode on a device (Triton): call
    `decode_batch` instead."""
    cfg = check_config(config)
    check_call_data(None, mean, std, out)
    return _batch_coder(blobs, cfg).start_decode_batch(blobs, mean, std, cfg, out=out, threads=threads, verify=verify,
                                                chunks=chunks)


def decode(
    blob: bytes,
    mean: torch.Tensor | float | None = None,
    std: torch.Tensor | float | None = None,
    *,
    config: CodecConfig | None = None,
    marginal: Marginal | None = None,
    threads: int = 1,
    workers: int = 1,
) -> torch.Tensor:
    """Inverse of `encode`: the same mean/std (checked by fingerprint) give back ``x`` bit for bit. The coder
    is the one whose magic bytes ``blob`` starts with.

    ``config``: the encoder's `CodecConfig`. ``ans``: required for ``header="compact"`` streams (checked by
    digest); full streams carry their own and only take the marginal from it. ``lanes``: checked by digest;
    None checks against `CodecConfig()`. ``marginal``: the p_hat the stream was encoded with, if not the
    default (or pass it inside ``config``). ``ans`` only: ``workers > 1`` decodes windows in forked processes
    (scales: constriction holds the GIL), ``threads > 1`` on threads (overlaps only numpy work). Raises
    `CorruptStreamError` for anything that cannot decode exactly.
    """
    check_parallel(threads, workers)
    check_call_data(None, mean, std)
    return coder_of_stream(blob).decode(blob, mean, std, config, marginal, threads=threads, workers=workers)


def encode_streams(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, config: CodecConfig,
                   threads: int | None = None) -> list[bytes]:
    """`encode_batch` of ``x`` ``[N, width, tokens]`` with per-stream statistics ``[N, width, 1 or tokens]`` (compact:
    a per-channel statistic stays ``[width, 1]``), as the block coder (`hf_kvcompress.blockcoder`) codes every block:
    a batched coder takes them compact in one call; a coder that codes stream by stream (``ans``) is handed each
    stream's statistics expanded to the stream's shape, which is what its streams in saved files fingerprint. Each
    stream's bytes are those whatever the call's batch holds beside it."""
    cfg = check_config(config)
    coder = CODERS[cfg.coder]
    if coder.batched:
        return encode_batch(x, mean, std, cfg, threads=threads)
    shape = tuple(x.shape[1:])
    return [encode(x[i], mean[i].expand(shape), std[i].expand(shape), cfg) for i in range(x.shape[0])]


def decode_streams(blobs: list[bytes], mean: torch.Tensor, std: torch.Tensor, config: CodecConfig, out: torch.Tensor,
                   threads: int = 1, verify: bool | Sequence[bool] = True) -> torch.Tensor:
    """Inverse of `encode_streams`, into ``out`` (``[N, width, tokens]``, or any shape and strides `decode_batch`
    takes): one call of a batched coder, else stream by stream (``threads``: an ``ans`` stream's forked workers,
    and every stream verified). `CorruptStreamError` for a stream that does not decode to ``out``'s dtype and
    stream shape exactly."""
    cfg = check_config(config)
    coder = CODERS[cfg.coder]
    if coder.batched:  # `decode_batch` without checking cfg again
        check_call_data(None, mean, std, out)
        return _batch_coder(blobs, cfg).decode_batch(blobs, mean, std, cfg, out=out, threads=threads, verify=verify)
    shape = (mean.shape[-2], out.shape[-1])
    xs = [decode(b, m.expand(shape), s.expand(shape), config=cfg, workers=threads) for b, m, s in zip(blobs, mean, std)]
    for x in xs:
        if x.dtype != out.dtype or tuple(x.shape) != shape:
            raise CorruptStreamError(f"a stream decoded to {x.dtype} {list(x.shape)}, not the block's "
                                     f"{out.dtype} {list(shape)}")
    return out.copy_(torch.stack(xs).view(out.shape))


def decode_range(
    blob: bytes,
    start: int,
    stop: int,
    mean: torch.Tensor | float | None = None,
    std: torch.Tensor | float | None = None,
    *,
    config: CodecConfig | None = None,
    marginal: Marginal | None = None,
) -> torch.Tensor:
    """Elements ``start:stop`` of the flattened tensor (1-D). ``ans`` decodes only the windows they lie in
    (causal mode: all windows up to ``stop``, since boundaries are found serially); ``lanes`` streams are one
    window, decoded whole. ``config`` and ``marginal`` as for `decode`."""
    check_call_data(None, mean, std)
    return coder_of_stream(blob).decode_range(blob, start, stop, mean, std, config, marginal)


def stream_info(
    blob: bytes, *, config: CodecConfig | None = None, marginal: Marginal | None = None
) -> tuple[torch.dtype, tuple[int, ...]]:
    """The dtype and shape ``blob`` decodes to, from its checked header (the payload is not decoded): lets a
    container check a stream against what it expects before allocating for it. ``config`` and ``marginal``
    as for `decode`; raises `CorruptStreamError` like `decode`."""
    return coder_of_stream(blob).stream_infos([blob], config, marginal)[0]


def stream_infos(
    blobs: Sequence[bytes], *, config: CodecConfig | None = None, marginal: Marginal | None = None
) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """`stream_info` of each of ``blobs``, one coder call for streams of one coder (a block's): raises at the
    first stream that does not parse, as `stream_info` would for it."""
    coders = [coder_of_stream(blob) for blob in blobs]
    if coders and all(c is coders[0] for c in coders):
        return coders[0].stream_infos(blobs, config, marginal)
    return [c.stream_infos([blob], config, marginal)[0] for c, blob in zip(coders, blobs)]


def encode_with_stats(
    x: torch.Tensor,
    mean: torch.Tensor | float | None = None,
    std: torch.Tensor | float | None = None,
    config: CodecConfig | None = None,
    *,
    decode: bool = True,
    exact: bool = True,
) -> tuple[bytes, CodecStats]:
    """`encode` plus a `CodecStats`: sizes, rate, window histogram, timings. ``decode=True`` also decodes once
    (checking the round trip). ``ans`` adds ideal code lengths (``model_bits``; ``exact=True``: the
    exact-mixture ideal, float64, slower than coding), escapes, windows timed by size and locality; ``lanes``
    reports its stream as one window and leaves ``model_bits`` / ``escapes`` None."""
    cfg = check_config(config)
    check_call_data(x, mean, std)
    return CODERS[cfg.coder].encode_with_stats(x, mean, std, cfg, decode=decode, exact=exact)
