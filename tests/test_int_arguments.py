"""Every integer argument outside the config dataclasses goes through `validation.check_int` (issue 51): one wording
("<where> must be an integer, got ..." / "<where> must be >= n, got ..."), a `ConfigTypeError` (a ``TypeError`` and
a ``ValueError``) for a wrong type and a ``ValueError`` for a value out of range."""

from __future__ import annotations

import pytest
import torch

from hf_kvcompress import codec
from hf_kvcompress.cache.container import check_int as file_int
from hf_kvcompress.errors import CacheFileError, ConfigTypeError
from hf_kvcompress.generation import prefill_in_chunks
from hf_kvcompress.integrations.kv_chunk import ChunkCoder
from hf_kvcompress.layer import RawStorage, SlidingWindowLayer
from hf_kvcompress.threads import configure_threads, torch_threads


def _blob() -> bytes:
    return codec.encode(torch.zeros(16, dtype=torch.bfloat16))


def _serde(**kwargs):
    pytest.importorskip("lmcache.v1.distributed.serde", reason="LMCache is not installed (extra: lmcache)")
    from hf_kvcompress.integrations.lmcache import coder_from_kwargs, create_serde

    return create_serde(kwargs) if "max_workers" in kwargs else coder_from_kwargs(kwargs)


#: (where the message starts, a call taking the integer); each minimum is 1 but torch_threads' (0)
CALLS = [
    ("codec: threads", lambda v: codec.decode(_blob(), threads=v)),
    ("configure_threads: cores", lambda v: configure_threads(v)),
    ("torch_threads: count", lambda v: torch_threads(v)),
    ("prefill_in_chunks: chunk_size", lambda v: prefill_in_chunks(None, torch.zeros(1, 4, dtype=torch.long), None, v)),
    ("ChunkCoder: threads", lambda v: ChunkCoder(threads=v)),
    ("ChunkCoder: head_dim", lambda v: ChunkCoder(head_dim=v)),
    ("layer 3: sliding_window", lambda v: SlidingWindowLayer(RawStorage(), sliding_window=v, block_tokens=4,
                                                             residual_tokens=4, layer_idx=3)),
    ("hf_kvcompress serde: layers", lambda v: _serde(layers=v)),
    ("hf_kvcompress serde: max_workers", lambda v: _serde(max_workers=v)),
]


#: decode_range's bounds: the type checked alike, the range as one relation ("need 0 <= start <= stop <= n")
TYPED = [*CALLS, ("codec: stop", lambda v: codec.decode_range(_blob(), 0, v))]


@pytest.mark.parametrize(("where", "call"), TYPED, ids=[where for where, _ in TYPED])
@pytest.mark.parametrize("value", [True, "2", 2.0])
def test_a_wrong_type_is_a_config_type_error_in_one_wording(where, call, value):
    with pytest.raises(ConfigTypeError, match=rf"^{where}.* must be an integer, got {type(value).__name__} "):
        call(value)


@pytest.mark.parametrize(("where", "call"), CALLS, ids=[where for where, _ in CALLS])
def test_a_value_out_of_range_is_a_value_error_in_one_wording(where, call):
    with pytest.raises(ValueError, match=rf"^{where}.* must (be >= [01]|lie in \[1, \d+\]), got -1$") as info:
        call(-1)
    assert not isinstance(info.value, TypeError)


def test_a_files_integer_is_a_cache_file_error_in_the_same_wording():
    assert file_int(5, "block start", 0) == 5
    with pytest.raises(CacheFileError, match=r"^block start must lie in \[0, 4\], got 7$"):
        file_int(7, "block start", 0, 4)
    with pytest.raises(CacheFileError, match=r"^block start must be an integer, got bool True$"):
        file_int(True, "block start", 0)


def test_rope_theta_is_a_finite_number_above_one():
    for bad in (1, float("inf"), True):
        with pytest.raises(ValueError, match=r"^hf_kvcompress serde: rope_theta must "):
            _serde(rope_theta=bad, head_dim=64)
