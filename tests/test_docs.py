"""README.md is the front door and docs/ holds the rest: the README stays
short, its first command installs and runs the main job, every relative link
of the README and docs/ reaches a file (and a heading, for an anchor), every
timing script the docs cite exists, and nothing the user reads points
outside the repository or calls some machine "this machine"."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", page.read_text(encoding="utf-8"), re.M)}


def test_readme_is_a_front_door():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; long material belongs in docs/"
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    first, second = blocks[0].strip(), blocks[1].strip()
    assert first.startswith("python3 -m venv .venv") and "pip install" in first and first.endswith("mha check"), (
        f"the README's first command must install and run the main job: {first!r}")
    assert second == "tox", f"the README's second command: {second!r}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_reach_a_file_and_a_heading(page):
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name} (headings: {sorted(_anchors(dest))})")
    assert not broken, f"{page.name}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_nothing_points_outside_the_repository_or_says_this_machine(page):
    text = page.read_text(encoding="utf-8")
    found = [m.group(0) for m in re.finditer(r"shared/[\w./-]*|CONVENTIONS\.md|(?i:\bthis machine\b)", text)]
    assert not found, f"{page.name}: {found} (a user's clone has no shared/; name machines, never 'this machine')"


def test_every_cited_timing_script_exists():
    cited = set()
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        cited |= set(re.findall(r"python -m (conformance\.bench\.scripts\.[a-z0-9_]+)", text))
    assert cited, "docs cite no timing script: the pattern no longer matches what they say"
    missing = sorted(name for name in cited if importlib.util.find_spec(name) is None)
    assert not missing, f"docs cite timing scripts that do not exist: {missing}"
