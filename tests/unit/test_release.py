"""The version is written in one place, and the changelog's newest release is that version."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import llmdd_async

ROOT = Path(__file__).resolve().parents[2]
RELEASE = re.compile(r"^## \[(?P<version>[^\]]+)\](?: - (?P<date>\d{4}-\d{2}-\d{2}))?$", re.M)
KINDS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def test_the_version_comes_from_the_package_alone() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]', pyproject, re.M)
    assert not re.search(r"^version = ", pyproject, re.M)  # no second copy to keep in step
    assert importlib.metadata.version("llmdd-async") == llmdd_async.__version__


def test_the_changelog_has_a_release_section_for_this_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    releases = list(RELEASE.finditer(text))
    assert releases and releases[0]["version"] == "Unreleased"
    dated = [m for m in releases if m["version"] != "Unreleased"]
    assert dated, "no release section"
    assert dated[0]["version"] == llmdd_async.__version__
    assert all(m["date"] for m in dated), "a release without its date"
    # Keep a Changelog: each release lists each kind of change once, and only known kinds.
    bounds = [m.start() for m in releases] + [len(text)]
    for m, end in zip(releases, bounds[1:], strict=True):
        kinds = re.findall(r"^### (.+)$", text[m.end() : end], re.M)
        assert len(kinds) == len(set(kinds)), (m["version"], kinds)
        assert set(kinds) <= KINDS, (m["version"], kinds)
