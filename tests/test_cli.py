"""The command line: ``info``, the demo (the main job) on the shipped text model, bad flags refused by
argparse before anything compiles, and progress without carriage returns when stderr is not a terminal."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys

import pytest
import tokenizers
from harness import count_compiles

from jax_oc128 import __main__ as cli
from jax_oc128.engine import Engine
from jax_oc128.generate_command import StopStrings
from jax_oc128.pretrained import CONFIG
from jax_oc128.text import SHIPPED_MODEL, TOKENIZER, load_tokenizer


def run_cli(*args, env=None):
    """``python -m jax_oc128 *args`` in a subprocess (with this test's jax_oc128), its output captured."""
    env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "jax_oc128", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_info_names_versions_and_targets(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "jax " in out and "flax" in out and "native targets:" in out and "oc128_verify" in out


#: the demo tests' prompts and flags (one set of shapes: the tree of 8 sets the model's draft banks, so the
#: processes of the other demo tests get their executables from the run's cache)
PROMPTS = ["Return the ", "Open the file and"]
DEMO = ["demo", "--tokens", "24", "--draft", "2", "--batch", "2"] + [
    f"--prompt={prompt}" for prompt in PROMPTS
]
#: the demo's modes: plain greedy, a chain of N = 2, the online state's default tree of 8
MODES = ("plain", "speculative N=2", "tree N=8")


def test_demo_prints_the_text_of_the_shipped_text_model(capsys, monkeypatch):
    """A short demo: each prompt and the decode of the tokens plain greedy generated from the prompt's
    tokens (the shipped model's tokenizer), speculative output identical to plain greedy, drafts accepted,
    memory reported."""
    generated = []
    original = Engine.generate

    def recording(engine, prompts, *args, **kwargs):
        result = original(engine, prompts, *args, **kwargs)
        generated.append((prompts, kwargs, result.tokens))
        return result

    monkeypatch.setattr(Engine, "generate", recording)
    assert cli.main(DEMO) == 0
    out = capsys.readouterr().out
    tokenizer = load_tokenizer(SHIPPED_MODEL)
    plain = [(ids, tokens) for ids, kw, tokens in generated if "num_tokens" not in kw and "tree" not in kw]
    assert len(plain) == 2 and plain[0] == plain[1]  # run twice, the second timed
    ids, plain = plain[0]
    assert ids == [tokenizer.encode(prompt) for prompt in PROMPTS]
    for prompt, tokens in zip(PROMPTS, plain, strict=True):
        assert f"{prompt} >>> {tokenizer.decode(tokens)}\n" in out
        assert any(c.isalpha() for c in tokenizer.decode(tokens))  # words, not noise
    for mode in MODES[1:]:  # the tree: the default mode of the online state
        line = next(row for row in out.splitlines() if row.startswith(mode))
        assert line.endswith("yes")
        assert float(line.split()[-2]) > 1.2, line  # mean accepted length: the draft head was trained
    assert "online" in out and "offline" in out and "model text_model" in out
    assert "2 prompts x 24 new tokens, 2 slots" in out


def test_progress_into_a_pipe_has_no_carriage_returns():
    """stderr piped: no live updates (before, a carriage return per update), each mode's bar once at the
    end, full (the tokens generated: EOS may stop a request early), and a line as each phase starts and
    ends, in order (a cold run compiles for minutes: a log shows where it is). The demo test's flags: its
    executables come from the run's compilation cache."""
    result = run_cli(*DEMO)
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr
    lines = result.stderr.splitlines()
    for mode in MODES:
        [line] = [row for row in lines if row.startswith(mode)]
        assert re.search(r" (\d+)/\1 tokens", line), line
    phases = [row for row in lines if row.startswith("demo, ")]
    assert len(phases) == 3 * len(MODES), phases
    for mode, (start, first, timed) in zip(MODES, (phases[:3], phases[3:6], phases[6:]), strict=True):
        assert start == f"demo, {mode}: compiling and a first run"
        assert re.fullmatch(rf"demo, {mode}: first run in [\d.]+ s, timing the second", first), first
        assert re.fullmatch(rf"demo, {mode}: \d+ tokens in [\d.]+ s", timed), timed


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Checkpoint directories for the ``--model`` cases, copies of the shipped text model: one whose
    tokenizer has a token past the model's vocabulary (``xyzzy``), one whose config disagrees with its
    tensors; and a file that is not a checkpoint."""
    folder = tmp_path_factory.mktemp("checkpoints")
    shutil.copytree(SHIPPED_MODEL, folder / "extra_token")
    tokenizer = tokenizers.Tokenizer.from_file(str(SHIPPED_MODEL / TOKENIZER))
    tokenizer.add_tokens(["xyzzy"])  # id 1024, the model's vocab_size
    tokenizer.save(str(folder / "extra_token" / TOKENIZER))
    shutil.copytree(SHIPPED_MODEL, folder / "mismatched")
    config = json.loads((SHIPPED_MODEL / CONFIG).read_text())
    (folder / "mismatched" / CONFIG).write_text(json.dumps(config | {"hidden_size": 128}))
    (folder / "notes.txt").write_text("not a checkpoint")
    return folder


#: (the flag named in the message, demo arguments; {dir}: the checkpoints' folder)
BAD_FLAGS = [
    ("--tokens", ["--tokens", "0"]),
    ("--tokens", ["--tokens", "-5"]),
    ("--tokens", ["--tokens", "ten"]),
    ("--tokens", ["--tokens", "4090"]),  # a prompt + 4090 tokens + N exceed max_position_embeddings (4096)
    ("--draft", ["--draft", "1"]),
    ("--draft", ["--draft", "2", "2"]),
    ("--draft", ["--draft", "17"]),  # past MAX_DRAFT (16)
    ("--batch", ["--batch", "0"]),
    ("--batch", ["--batch", "1.5"]),
    ("--temperature", ["--temperature", "nan"]),
    ("--temperature", ["--temperature", "-1"]),
    ("--temperature", ["--temperature", "inf"]),
    ("--seed", ["--seed", "-1"]),
    ("--seed", ["--seed", str(2**32)]),  # seeds are 32-bit: 2**32 would be seed 0 again
    ("--steps-per-dispatch", ["--steps-per-dispatch", "0"]),
    ("--prompt", ["--prompt="]),
    ("--prompt", ["--prompt", "caf\udce9"]),  # what os.fsdecode makes of bytes that are not UTF-8
    ("--prompt", ["--model", "{dir}/extra_token", "--prompt", "xyzzy"]),  # not in the model's vocabulary
    ("--backend", ["--backend", "gpu"]),
    ("--model", ["--model", "{dir}/absent"]),
    ("--model", ["--model", "{dir}/notes.txt"]),
    ("--model", ["--model", "{dir}/mismatched"]),
    ("--tree", ["--tree", "1"]),
    ("--tree", ["--tree", "4", "4"]),
    ("--tree", ["--tree", "17"]),  # past MAX_DRAFT (16)
    ("--tree", ["--backend", "offline", "--tree", "8"]),  # the offline state verifies chains only
]


def bad_flag_cases(subset=None):
    """``(flag, demo arguments)`` of :data:`BAD_FLAGS` (those of ``subset``), with readable ids."""
    cases = [BAD_FLAGS[i] for i in subset] if subset else BAD_FLAGS
    return pytest.mark.parametrize("flag, args", cases, ids=[" ".join(args) for _, args in cases])


def demo_args(args, folder):
    return ["demo", *(arg.format(dir=folder) for arg in args)]


@bad_flag_cases()
def test_bad_demo_flags_are_refused_before_anything_compiles(checkpoints, flag, args, capsys):
    """Every case in this process (fast): exit status 2 and argparse's message naming the flag; nothing
    compiled."""
    with count_compiles() as compiles, pytest.raises(SystemExit) as exit_info:
        cli.main(demo_args(args, checkpoints))
    assert exit_info.value.code == 2
    assert f"error: argument {flag}: " in capsys.readouterr().err
    assert not compiles


@bad_flag_cases(subset=(0, 6, 13, 17, 21))
def test_bad_demo_flags_from_the_shell(checkpoints, flag, args):
    """Some cases as a user runs them (a process each: about 3 s of imports), every compilation logged:
    exit status 2, the flag named, no compilation, no traceback."""
    result = run_cli(*demo_args(args, checkpoints), env={"JAX_LOG_COMPILES": "1"})
    assert result.returncode == 2, result.stderr
    assert f"error: argument {flag}: " in result.stderr
    assert "Compiling" not in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    "args",
    [["info"], DEMO],
    ids=["info", "demo"],
)
def test_output_into_a_closed_pipe_is_quiet(args):
    """``jax-oc128 info | true`` and ``demo | head -1``: the reader gone before the output is written (its
    end of the pipe closed at once): status 0, no traceback (before: a BrokenPipeError's, status 1)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "jax_oc128", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    process.stdout.close()
    err = process.stderr.read()
    assert process.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err


def test_stop_strings_cut_exactly_however_the_text_arrives():
    """The text up to the first stop string (of any), never containing one, whatever the pieces."""
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 30)))
        word = lambda: "".join(rng.choice("abc") for _ in range(rng.randrange(1, 5)))  # noqa: E731
        stops = [word() for _ in range(rng.randrange(1, 3))]
        found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
        expected = text[: min(found)] if found else text
        cut, pieces, i = StopStrings(stops), [], 0
        while i < len(text):
            k = rng.randrange(1, 6)
            pieces.append(cut.push(text[i : i + k]))
            i += k
        pieces.append(cut.finish())
        assert "".join(pieces) == expected and cut.stopped == bool(found), (text, stops, pieces)
        assert not any(stop in "".join(pieces) for stop in stops)
