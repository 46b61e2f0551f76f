"""`save` replaces a file atomically: a save that fails on a full disk (RLIMIT_FSIZE stands in for it) or whose
process is killed mid-write leaves the old file byte for byte as it was, and loadable; the new file gets the mode
a plain ``open`` would give it."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from helpers import random_ids, same_bits, tiny_model

from hf_kvcompress import CompressedCache, CompressionConfig

TESTS = Path(__file__).resolve().parents[1]
CONFIG = CompressionConfig(mode="lossless", block_tokens=16, residual_tokens=4)

#: run in a subprocess: a cache of ``TOKENS`` tokens saved over ``TARGET`` after a warm-up save elsewhere (its
#: kernels compiled, so that nothing but the save writes once the fault is armed); ``MODE`` arms the fault
_SCRIPT = textwrap.dedent("""
    import os, resource, signal, sys
    import torch
    from pathlib import Path
    from helpers import random_ids, tiny_model
    from hf_kvcompress import CompressedCache, CompressionConfig
    from hf_kvcompress.cache import files

    mode, target, tokens = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    model = tiny_model("llama-gqa", torch.bfloat16)
    cache = CompressedCache(CompressionConfig(mode="lossless", block_tokens=16, residual_tokens=4), model=model)
    with torch.no_grad():
        model(random_ids(1, tokens, seed=11), cache=cache)
    warm = cache.save(target.parent / "warm-up" / "w.kvc")
    size = warm.stat().st_size
    warm.unlink()
    if mode == "fsize":  # a disk that fills up after 4 KiB: writes past it fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    else:  # killed once the file's first piece (prefix) has been handed to the write
        frame = files.frame

        def killing_frame(*args, **kwargs):
            pieces = frame(*args, **kwargs)
            yield pieces[0]
            os.kill(os.getpid(), signal.SIGKILL)
            yield from pieces[1:]

        files.frame = killing_frame
    try:
        cache.save(target)
    except OSError as err:
        print("OSError", err.errno, size, flush=True)
        sys.exit(3)
    print("saved", size, flush=True)
""")


def _good_file(folder: Path) -> tuple[Path, bytes, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A good saved cache (20 tokens): its path, bytes and K/V."""
    model = tiny_model("llama-gqa", torch.bfloat16)
    cache = CompressedCache(CONFIG, model=model)
    with torch.no_grad():
        model(random_ids(1, 20, seed=3), cache=cache)
    path = cache.save(folder / "cache.kvc")
    return path, path.read_bytes(), [(layer.keys.clone(), layer.values.clone()) for layer in cache.kv_layers()]


def _run(mode: str, target: Path) -> subprocess.CompletedProcess:
    (target.parent / "warm-up").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", _SCRIPT, mode, str(target), "200"], capture_output=True, text=True,
                          env=env, timeout=300)


def _intact(path: Path, data: bytes, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    assert path.read_bytes() == data
    loaded = CompressedCache.load(path, model=tiny_model("llama-gqa", torch.bfloat16))
    for layer, (keys, values) in zip(loaded.kv_layers(), kv):
        assert same_bits(layer.keys, keys) and same_bits(layer.values, values)


def _others(folder: Path, keep: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p != keep and p.name != "warm-up")


def test_a_save_that_fills_the_disk_leaves_the_old_file_as_it_was(tmp_path):
    path, data, kv = _good_file(tmp_path)
    done = _run("fsize", path)
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    errno_, size = (int(x) for x in done.stdout.split()[1:3])
    assert errno_ == errno.EFBIG and size > 4096  # the new file would not fit under the limit
    _intact(path, data, kv)
    assert _others(tmp_path, path) == []  # the temporary file is gone


def test_a_save_killed_mid_write_leaves_the_old_file_as_it_was(tmp_path):
    path, data, kv = _good_file(tmp_path)
    done = _run("kill", path)
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr[-3000:]
    _intact(path, data, kv)
    left = _others(tmp_path, path)  # a killed writer's hidden temporary file may stay, never under the target name
    assert all(name.startswith(".cache.kvc.") and name.endswith(".tmp") for name in left), left


def test_a_saved_file_has_the_mode_open_would_give_it(tmp_path):
    model = tiny_model("llama-gqa", torch.bfloat16)
    cache = CompressedCache(CONFIG, model=model)
    with torch.no_grad():
        model(random_ids(1, 20, seed=3), cache=cache)
    old = os.umask(0o027)
    try:
        new = cache.save(tmp_path / "new.kvc")
    finally:
        os.umask(old)
    assert stat.S_IMODE(new.stat().st_mode) == 0o640  # 0o666 less the umask, not mkstemp's 0o600
    new.chmod(0o604)
    assert stat.S_IMODE(cache.save(new).stat().st_mode) == 0o604  # a replaced file keeps its mode
    link = tmp_path / "link.kvc"
    link.symlink_to(new)
    cache.save(link)  # written through the link, as open() would
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["link.kvc", "new.kvc"]
