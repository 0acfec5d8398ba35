"""The command line: ``info`` and the demo (the main job) on the shipped model."""

from __future__ import annotations

import pytest

from jax_oc128 import __main__ as cli


def test_info_names_versions_and_targets(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "jax " in out and "flax" in out and "native targets:" in out and "oc128_verify" in out


def test_demo_runs_on_the_shipped_model(capsys):
    """A short demo: speculative output identical to plain greedy, drafts accepted, memory reported."""
    args = ["demo", "--tokens", "24", "--draft", "2", "--batch", "2", "--prompt", "Return the "]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if row.startswith("speculative N=2"))
    assert line.endswith("yes")
    assert float(line.split()[-2]) > 1.2, line  # mean accepted length: the draft head was trained
    assert "online" in out and "offline" in out


@pytest.mark.parametrize(
    "flag, value",
    [("--tokens", "0"), ("--tokens", "-5"), ("--batch", "0"), ("--draft", "0"), ("--temperature", "nan")],
)
def test_bad_demo_flags_are_refused_before_anything_runs(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", flag, value])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err
