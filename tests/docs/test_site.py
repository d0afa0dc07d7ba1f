"""The documentation site builds strictly: every page in the nav, every link
and anchor resolves, every ``::: module.Name`` reference is found and its
docstring renders (``mkdocs build --strict``, as ``make docs`` runs it)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Pages being written beside these docs, linked from mkdocs.yml once they land (none now).
PENDING: set[str] = set()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("mkdocs is not installed: it is in the dev extra (pip install -e '.[dev]')")
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=REPO,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return out


def test_the_site_builds_strictly(site: Path) -> None:
    nav = re.findall(r":\s*([\w/.-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.M)
    for page in nav:
        assert (REPO / "docs" / page).exists(), page
        html = site / page.removesuffix(".md") / "index.html" if page != "index.md" else site / "index.html"
        assert html.exists(), f"{page} was not built"
    # Every page under docs/ is in the nav (no orphan a reader cannot reach),
    # but a page being written now, whose nav entry lands with it.
    on_disk = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    assert on_disk - set(nav) <= PENDING, f"pages not in mkdocs.yml's nav: {sorted(on_disk - set(nav) - PENDING)}"


def test_the_reference_renders_the_docstrings(site: Path) -> None:
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in ("Sender", "Receiver", "Ticket", "MemoryPool", "SendPlan", "RecvPlan", "ShardedPlan", "Box",
                 "WeightSync", "serve_prometheus", "register_pool_source", "TensorferryTrainerInitInfo",
                 "TensorferryWeightTransferEngine"):
        assert f'id="tensorferry.' in api and re.search(rf'id="[\w.]*\b{name}"', api), f"{name} is not in the API reference"
    # A docstring's own words made it through (Sender.put's Args).
    assert "readers" in api and "lease_seconds" in api


def test_the_monitoring_guide_shows_the_files_it_includes(site: Path) -> None:
    """The scrape config and the recording rules are included from
    monitoring/ (the files the monitor tests check), not copied."""
    html = (site / "guides" / "monitoring" / "index.html").read_text()
    assert "tensorferry-pools" in html and "rule_files" in html
    assert "instance_pool:tensorferry_pool_used:ratio" in html and "--8&lt;--" not in html


# A reStructuredText role (:class:`Foo`, :meth:`Foo.bar`, ...) in a rendered
# docstring shows literally: mkdocstrings reads markdown. Write a
# cross-reference, [Foo][tensorferry.Foo], which the strict build checks, or
# `Foo` where the name is not in the reference. "class:" without its first
# colon too: a Returns line "A :class:`Foo`" reads as name "A", then text.
_ROLE = re.compile(r"(?<![\w-]):?(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj|const|ref):(?:<code>|`)")


def test_no_restructuredtext_role_renders_literally(site: Path) -> None:
    found = []
    for page in sorted(site.rglob("*.html")):
        html = page.read_text()
        for m in _ROLE.finditer(html):
            text = re.sub(r"<[^>]+>", "", html[m.start():m.end() + 80]).split("\n")[0]
            found.append(f"{page.relative_to(site)}: {text}")
    assert not found, f"{len(found)} roles rendered literally:\n" + "\n".join(found)
