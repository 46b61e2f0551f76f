"""The on-disk table cache is only a shortcut: whatever it holds is verified, and a bad file is rebuilt. The
codec caches only in a folder its caller names (`set_table_cache`)."""

from __future__ import annotations

import numpy as np

from hf_kvcompress.codec import tables


def test_cache_round_trip_and_corruption(tmp_path, monkeypatch):
    reference = tables.get_tables()
    monkeypatch.setattr(tables, "_cache_dir", None)
    try:
        tables.set_table_cache(lambda: tmp_path / "codec")  # a function: nothing is created until first use
        assert not (tmp_path / "codec").exists()
        tables.get_tables.cache_clear()
        built = tables.get_tables()  # builds (empty cache folder) and writes the cache
        path = next((tmp_path / "codec").glob("tables-*.npz"))
        cached = tables._cache_load(tables.TABLES_SHA256)
        assert cached is not None and all(np.array_equal(a, b - 1) for a, b in zip(cached, built.freqs))
        for bad in (b"not an npz", None):
            if bad is None:  # a valid file with one weight changed: fails the hash, rebuilt
                w = [c.copy() for c in cached]
                w[3][0] += 1
                tables._cache_save(tables.TABLES_SHA256, w)
            else:
                path.write_bytes(bad)
            tables.get_tables.cache_clear()
            again = tables.get_tables()
            assert again.sha256 == tables.TABLES_SHA256
            assert all(np.array_equal(a, b) for a, b in zip(again.freqs, reference.freqs))
        monkeypatch.setenv("HF_KVCOMPRESS_TABLE_CACHE", "0")
        assert tables._cache_load(tables.TABLES_SHA256) is None
        monkeypatch.delenv("HF_KVCOMPRESS_TABLE_CACHE")
        tables.set_table_cache(str(tmp_path / "other"))
        tables._cache_save(tables.TABLES_SHA256, cached)
        assert (tmp_path / "other").is_dir()
        tables.set_table_cache(None)  # no folder: nothing read or written
        assert tables._cache_load(tables.TABLES_SHA256) is None
    finally:
        tables.get_tables.cache_clear()
