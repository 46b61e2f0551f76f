"""The on-disk table cache is only a shortcut: whatever it holds is verified, and a bad file is rebuilt."""

from __future__ import annotations

import numpy as np

from hf_kvcompress.codec import model, table_cache


def test_cache_round_trip_and_corruption(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_KVCOMPRESS_CACHE", str(tmp_path))
    reference = model.get_tables()
    try:
        model.get_tables.cache_clear()
        built = model.get_tables()  # builds (empty cache folder) and writes the cache
        path = next((tmp_path / "codec").glob("tables-*.npz"))
        cached = table_cache.load(model.TABLES_SHA256)
        assert cached is not None and all(np.array_equal(a, b - 1) for a, b in zip(cached, built.freqs))
        for bad in (b"not an npz", None):
            if bad is None:  # a valid file with one weight changed: fails the hash, rebuilt
                w = [c.copy() for c in cached]
                w[3][0] += 1
                table_cache.save(model.TABLES_SHA256, w)
            else:
                path.write_bytes(bad)
            model.get_tables.cache_clear()
            again = model.get_tables()
            assert again.sha256 == model.TABLES_SHA256
            assert all(np.array_equal(a, b) for a, b in zip(again.freqs, reference.freqs))
        monkeypatch.setenv("HF_KVCOMPRESS_TABLE_CACHE", "0")
        assert table_cache.load(model.TABLES_SHA256) is None
    finally:
        model.get_tables.cache_clear()
