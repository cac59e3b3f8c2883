"""The README and docs/ hold together without mkdocs installed.

CI builds the site with ``mkdocs build --strict`` (broken links and anchors
between pages fail it), but mkdocs sees only docs/: it cannot check the
README, nor a docs page's link to a repository file outside docs/. This test
checks every relative Markdown link (``[text](path)``, ``![alt](path)``) of
README.md and docs/*.md against the checkout, every page against mkdocs.yml's
nav, and the README's length (a front page, not the manual). File paths in
code spans are prose, not links, and are not checked here.
"""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README_MAX_LINES = 250

# [text](target) or ![alt](target), target up to the first space or ')'
# (a title after the space is allowed); not inside code.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
NAV_PAGE = re.compile(r":\s*([\w./-]+\.md)\s*$")


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def _links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link outside code blocks and spans."""
    found, in_fence = [], False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line.lstrip()):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            found.append((number, match.group(1)))
    return found


def _local(target: str) -> bool:
    return not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) and not target.startswith("#")


def test_every_relative_link_points_to_a_file():
    broken = []
    for page in _pages():
        for number, target in _links(page):
            if not _local(target):
                continue
            path = target.split("#", 1)[0].split("?", 1)[0]
            if target.startswith("/") or not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)}:{number}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_readme_anchors_exist():
    """The README's own #anchors name one of its headings (as GitHub slugs them)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
             for h in re.findall(r"^#+\s+(.*)$", readme, re.M)}
    missing = [t for _, t in _links(REPO / "README.md") if t.startswith("#") and t[1:] not in slugs]
    assert not missing, f"README anchors without a heading: {missing}"


def test_every_docs_page_is_in_the_nav():
    config = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    nav = config.split("\nnav:", 1)[1]
    nav = re.split(r"\n(?=\S)", nav, maxsplit=1)[0]
    listed = {m.group(1) for line in nav.splitlines() if (m := NAV_PAGE.search(line))}
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages - listed == set(), f"docs pages missing from mkdocs.yml's nav: {sorted(pages - listed)}"
    assert listed - pages == set(), f"nav entries without a page: {sorted(listed - pages)}"


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_link_finder_sees_links_not_code(tmp_path):
    """The checks above are only as good as the link finder."""
    sample = tmp_path / "probe.md"
    sample.write_text("see [a](x.md#y) and ![i](img.png \"t\") and `[no](code.md)`\n"
                      "```\n[no](fenced.md)\n```\n[b](https://example.com) [c](#top)\n")
    assert [t for _, t in _links(sample)] == ["x.md#y", "img.png", "https://example.com", "#top"]
