"""The README and docs/ stand on their own: no paths outside the repository, no broken links."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
OUTSIDE = ("../shared", "DESIGN.md", "/work/")
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_pages_point_only_inside_the_repository(page: Path) -> None:
    text = page.read_text()
    for words in OUTSIDE:
        assert words not in text, f"{page.name} mentions {words!r}"
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(REPO) and path.exists(), f"{page.name} links to {target}"


def test_the_design_page_names_the_source_article() -> None:
    design = (REPO / "docs" / "design.md").read_text()
    assert "大语言模型推理服务的多级优先级调度" in design
    assert "docs/design.md" in (REPO / "README.md").read_text()
