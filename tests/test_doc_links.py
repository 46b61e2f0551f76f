"""The docs hold together: every link between README / docs pages reaches its file and anchor, and every
citation of a docs page in the code (``docs/<page>.md``, with a section number or a quoted heading) names a
page and a section that exist, so that a constant's source can be found."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CODE = [p for folder in ("hf_kvcompress", "hf_kvcompress_eval", "tests", "experiments") for p in (ROOT / folder).rglob("*.py")
        if p.name != Path(__file__).name]  # (this file cites missing pages on purpose)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# docs/<page>.md, then optionally "section 12.5" / ", 5.2" or a quoted / starred heading
CITATION = re.compile(r"docs/([a-z_/]+\.md)(?:(?:,|:)?\s*(?:section\s+)?(\d+(?:\.\d+)?)\b|,?\s*[\"*]([^\"*()=]{3,80})[\"*])?")


def _flat(text: str) -> str:
    """Text with line breaks (and comment markers at the start of lines) turned into single spaces."""
    return re.sub(r"\s*\n\s*(?:#:?\s*)?", " ", text)


def _headings(page: Path) -> list[str]:
    lines, out, in_code = page.read_text().splitlines(), [], False
    for line in lines:
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            out.append(line.lstrip("#").strip())
    return out


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _headings(page):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


def broken_links(pages: list[Path]) -> list[str]:
    bad = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for match in LINK.finditer(text):
            target = match.group(1)
            if re.match(r"https?://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{_name(page)}: no file {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{_name(page)}: no anchor {target}")
    return bad


def broken_citations(files: list[Path], docs: Path) -> list[str]:
    bad = []
    for path in files:
        for match in CITATION.finditer(_flat(path.read_text())):
            page, number, title = docs / match.group(1), match.group(2), match.group(3)
            where = f"{path.name}: docs/{match.group(1)}"
            if not page.exists():
                bad.append(f"{where}: no such page")
            elif number and not any(re.match(re.escape(number) + r"[. ]", h) for h in _headings(page)):
                bad.append(f"{where}: no section {number}")
            elif title and title.strip() not in _flat(page.read_text()):
                bad.append(f"{where}: no {title!r}")
    return bad


def test_links_between_pages_reach_their_files_and_anchors():
    assert len(PAGES) > 10
    assert broken_links(PAGES) == []


def test_the_code_cites_pages_and_sections_that_exist():
    assert broken_citations(CODE, ROOT / "docs") == []


@pytest.mark.parametrize("cite, problem", [
    ("docs/nowhere.md", "docs/nowhere.md: no such page"),
    ("docs/page.md section 9.9", "docs/page.md: no section 9.9"),
    ('docs/page.md, "Missing heading"', "docs/page.md: no 'Missing heading'"),
])
def test_the_citation_check_finds_what_is_broken(tmp_path, cite, problem):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "page.md").write_text("# Page\n\n## 1. One\n\nThe heading text\nover two lines.\n")
    good = tmp_path / "good.py"
    good.write_text('# docs/page.md section 1; docs/page.md, "The heading text over two lines"\n')
    bad = tmp_path / "bad.py"
    bad.write_text(f"# a constant measured in {cite}\nX = 1\n")
    assert broken_citations([good], docs) == []
    assert broken_citations([bad], docs) == [f"bad.py: {problem}"]


def test_the_link_check_finds_a_missing_file_and_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## Two\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[ok](other.md#two) [self](#page) [gone](gone.md) [no anchor](other.md#three)\n")
    assert broken_links([page]) == ["page.md: no file gone.md", "page.md: no anchor other.md#three"]
