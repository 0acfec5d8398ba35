"""The docs name only what exists: every repository path that README.md and docs/*.md mention (a file under
docs/, examples/, scripts/, bench/, tests/, jax_oc128/ or ffi/) is there."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: a path of the repository: a top folder, then names, ending in a file's extension
PATH = re.compile(
    r"\b(?:docs|examples|scripts|bench|tests|jax_oc128|ffi)/[\w./-]*\w\.(?:py|md|npz|json|h|cc|cu|png)\b"
)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_path_a_page_names_exists(page):
    named = set(PATH.findall(page.read_text()))
    missing = sorted(p for p in named if "YYYY" not in p and not (ROOT / p).exists())  # not a template
    assert not missing, f"{page.name} names paths that do not exist: {missing}"
