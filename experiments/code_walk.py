"""Walking the code: how often one decode step, one save and one load enter each package file (docs/architecture.md,
"Walking the code").

Every call between package functions is recorded (`sys.setprofile`) while a 6-layer tiny Llama (tests/helpers.py)
takes one decode step with a lossless cache (blocks of 16, nothing kept decoded), then while that cache is saved,
then while the file is loaded (three walks). A file is *entered* when a function that goes on into yet another file is called from a different
file; a helper that stays in its own file (a check, an accessor) is looked up, not walked through. Entries count
once per (caller function, file): a reader following a function reads each file it calls into once.

    python experiments/code_walk.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import torch
from helpers import fresh_tiny_model, random_ids

import hf_kvcompress
from hf_kvcompress import CompressedCache, CompressionConfig, LosslessConfig

PKG = str(Path(hf_kvcompress.__file__).parent)

def walk(fn):
    """Follow one call: every call between package functions, as (caller function, callee function). A file is
    *entered* when a function that calls on into yet another file (not a helper that stays in its own file: a
    check, an accessor) is called from another file; entries are counted once per (caller function, callee file), since a reader following a
    function reads each file it calls into once. Returns {file: entries} and the entering edges."""
    edges = set()
    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PKG):
            back = frame.f_back
            while back is not None and not back.f_code.co_filename.startswith(PKG):
                back = back.f_back
            callee = (frame.f_code.co_filename, frame.f_code.co_firstlineno, frame.f_code.co_name)
            caller = None if back is None else (back.f_code.co_filename, back.f_code.co_firstlineno, back.f_code.co_name)
            edges.add((caller, callee))
        return None
    sys.setprofile(tracer)
    try:
        fn()
    finally:
        sys.setprofile(None)
    # functions through which the walk goes on into another file (the others are helpers a reader looks up)
    callers = {c for c, callee in edges if c is not None and callee[0] != c[0]}
    entries = {}
    for caller, callee in edges:
        if callee not in callers:  # a leaf
            continue
        if caller is not None and caller[0] == callee[0]:
            continue
        rel = os.path.relpath(callee[0], PKG)
        entries.setdefault(rel, set()).add("<test>" if caller is None else f"{os.path.relpath(caller[0], PKG)}:{caller[2]}")
    return entries

model = fresh_tiny_model("llama-gqa", torch.bfloat16, layers=6)
config = CompressionConfig(mode="lossless", block_tokens=16, residual_tokens=16, lossless=LosslessConfig(decoded_budget=0))
ids = random_ids(1, 80)
cache = CompressedCache(config, model=model)
with torch.no_grad():
    model(ids, cache=cache, use_cache=True)
    model(random_ids(1, 1, seed=3), cache=cache, use_cache=True)  # warm: numba, lazy imports
def step():
    with torch.no_grad():
        model(random_ids(1, 1, seed=4), cache=cache, use_cache=True)
d = tempfile.mkdtemp()
def save():
    cache.save(os.path.join(d, "c.kvc"))


def load():
    CompressedCache.load(os.path.join(d, "c.kvc"), model=model)
for name, fn in (("decode step", step), ("save", save), ("load", load)):
    entries = walk(fn)
    print(f"== {name}: {len(entries)} files entered; most entries {max(len(v) for v in entries.values())}")
    for f, v in sorted(entries.items(), key=lambda t: -len(t[1])):
        print(f"  {len(v)}  {f}   from {sorted(v)}")
