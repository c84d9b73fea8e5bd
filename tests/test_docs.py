"""The documentation's own contract: the generated reference is current, the README stays a quick start whose
first two commands are the demo and the tests, every relative link and every file a page names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fsd_local.cli import reference

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 300
DEMO = 'pip install -e ".[demo]" && fsd-local chat --demo wide --quality-budget 0.15'
TESTS = 'pip install -e ".[test]" && python -m pytest'


def pages() -> list[Path]:
    return [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_the_reference_is_generated_from_the_current_code():
    committed = reference.REFERENCE.read_text() if reference.REFERENCE.exists() else ""
    assert committed == reference.render(), f"docs/reference.md is stale: run `{reference.COMMAND}` and commit it"


def test_readme_opens_with_the_demo_then_the_tests():
    blocks = re.findall(r"```bash\n(.+?)\n```", README.read_text(), re.S)
    assert blocks[:2] == [DEMO, TESTS]


def test_readme_is_a_quick_start():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move the details into docs/"


def test_nothing_cites_a_design_document_outside_the_repository():
    """No page, docstring or comment cites the design document the project started from: what it said is in
    docs/design.md and the other pages, or in the module that implements it."""
    outside = "FSD" + ".md"  # spelt in two, so that this file does not cite it either
    sources = [p for d in ("fsd_local", "tests", "benchmarks") for p in sorted((ROOT / d).rglob("*.py"))]
    for path in [*pages(), *sources]:
        assert outside not in path.read_text(), path.relative_to(ROOT)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text.replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not (m := re.match(r"#{1,6} (.+)", line)):
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out | set(re.findall(r'<a id="([^"]+)"', page.read_text()))


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    for link in links(page):
        if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.relative_to(ROOT)}: {link} names a file that does not exist"
        if anchor and target.suffix == ".md":
            assert anchor in anchors(target), f"{page.relative_to(ROOT)}: {link}: no such heading"


# repository paths a page names in backticks (`fsd_local/round.py`, `native/build.sh`): they must exist. The
# measurement records are exempt: their commands are quoted as they were run at the commit they name.
PATH = re.compile(r"`((?:fsd_local|tests|native|benchmarks|docs|\.ci)/[\w./-]*)`")


@pytest.mark.parametrize(
    "page", [p for p in pages() if "measurements" not in p.parts], ids=lambda p: str(p.relative_to(ROOT))
)
def test_every_file_a_page_names_exists(page):
    for name in PATH.findall(page.read_text()):
        if "*" in name or re.search(r"[A-Z]{3,}", name):  # a pattern (`reference*.py`) or a placeholder (`PROFILE`)
            continue
        assert (ROOT / name.rstrip("/")).exists(), f"{page.relative_to(ROOT)} names {name}, which does not exist"
