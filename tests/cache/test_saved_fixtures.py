"""Files written by earlier releases: refused with a clear request to re-save, never misread (fixtures under
tests/fixtures/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_kvcompress import CompressedCache
from hf_kvcompress.cache.persist import CacheFileError

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def test_a_version_1_file_is_refused_with_a_request_to_re_save():
    # written by hf_kvcompress 0.1.0 at commit 248945f (format version 1: the header was not checksummed,
    # `ans` streams, three layers of 40 tokens)
    with pytest.raises(CacheFileError, match=r"version 1.*re-save"):
        CompressedCache.load(FIXTURES / "v1_generic.kvc")
