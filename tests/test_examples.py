"""The examples run as shipped."""

from __future__ import annotations

import pathlib
import runpy

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).parents[1] / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path, capsys):
    runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out
    assert out.strip()
    assert "False" not in out  # e.g. "identical to plain greedy: False"


def test_examples_are_found():
    assert len(EXAMPLES) >= 2
