"""The README's and deploy/README.md's links into the repository (docs/ui/ screenshots, configs,
files) name files that exist, and each screenshot stays small enough to ship."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# [text](target) and ![alt](target); external and in-page links are not files here
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _local_targets(doc: Path) -> list[str]:
    targets = [m.group(1).split("#", 1)[0] for m in _LINK.finditer(doc.read_text())]
    return [t for t in targets if t and not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("doc", ["README.md", "deploy/README.md"])
def test_relative_links_name_existing_files(doc: str) -> None:
    path = ROOT / doc
    missing = [t for t in _local_targets(path) if not (path.parent / t).exists()]
    assert not missing, f"{doc} links to missing files: {missing}"


def test_readme_shows_every_dashboard_view() -> None:
    linked = {Path(t).name for t in _local_targets(ROOT / "README.md")
              if t.startswith("docs/ui/")}
    shipped = {p.name for p in (ROOT / "docs/ui").glob("*.png")}
    assert shipped and linked == shipped, (linked, shipped)
    for png in (ROOT / "docs/ui").glob("*.png"):
        assert png.stat().st_size <= 150_000, f"{png.name} is {png.stat().st_size} bytes"
