"""Text in and out: ``load_tokenizer`` on a byte-level BPE trained here (64 tokens, the vocabulary of the tiny
checkpoint beside it), its chat template in jinja2's sandbox, the incremental decoder on characters split over
tokens, every bad file named; and ``jax-oc128 generate`` end to end on a copy of
tests/fixtures/v4_small_window_hf with an MTP layer added: the streamed text is the decode of the tokens,
greedy text is the same with ``--draft`` and ``--tree``, bad input is refused before anything compiles."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx
from harness import count_compiles
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jax_oc128 import __main__ as cli
from jax_oc128 import load_tokenizer, pretrained, text
from jax_oc128.controller import OFFLINE
from jax_oc128.engine import Engine
from jax_oc128.nn import ModelConfig, RuntimeConfig, SpeculativeModel
from jax_oc128.nn.functional import variable_at

HF_CHECKPOINT = pathlib.Path(__file__).parent / "fixtures" / "v4_small_window_hf"
# DeepSeek's (full-width bars, U+2581 for spaces), ids 0 and 1 as in the checkpoint's config
BOS, EOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"
CORPUS = [
    "Open the file and return a file object. Return the list of items in ascending order.",
    "A café serves crème brûlée; naïve readers read 日本語 text, and the interpreter reads the file.",
]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
PROMPT = "A café"
#: the EOS of generate's checkpoint (its generation_config.json): the 11th token of PROMPT's greedy output
EOS_ID = 63


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE of 64 tokens (the two special ones first, then the corpus's bytes and merges): few
    merges, so characters of several UTF-8 bytes stay split over tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=64, special_tokens=[BOS, EOS], show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    assert tokenizer.get_vocab_size() == 64 and tokenizer.token_to_id(EOS) == 1
    return tokenizer


def write_tokenizer(directory, *, template=TEMPLATE, **config):
    train_tokenizer().save(str(directory / text.TOKENIZER))
    fields = {"bos_token": BOS, "eos_token": {"content": EOS, "lstrip": False}, "add_bos_token": True}
    fields |= {"chat_template": template} if template else {}
    (directory / text.TOKENIZER_CONFIG).write_text(json.dumps(fields | config))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``mtp``: the small-window checkpoint as transformers saved it, with an MTP layer (random, named
    ``model.layers.4.*``), this module's tokenizer and :data:`EOS_ID`; ``plain``: the checkpoint as saved,
    with the tokenizer."""
    root = tmp_path_factory.mktemp("checkpoints")
    plain, mtp = root / "plain", root / "mtp"
    shutil.copytree(HF_CHECKPOINT, plain)
    write_tokenizer(plain)
    shutil.copytree(plain, mtp)
    config = json.loads((plain / pretrained.CONFIG).read_text()) | {"num_nextn_predict_layers": 1}
    model = SpeculativeModel(
        ModelConfig.from_hf(config), RuntimeConfig(max_len=512, max_draft=4), rngs=nnx.Rngs(3)
    )
    prefix = f"model.layers.{len(config['layer_types'])}."
    tensors = load_file(plain / pretrained.SINGLE) | {
        name: np.asarray(variable_at(model, path)[...])
        for name, path in pretrained.parameter_paths(model).items()
        if name.startswith(prefix)
    }
    save_file(tensors, mtp / pretrained.SINGLE)
    (mtp / pretrained.CONFIG).write_text(json.dumps(config))
    (mtp / text.GENERATION_CONFIG).write_text(json.dumps({"eos_token_id": EOS_ID}))
    return {"plain": plain, "mtp": mtp}


def test_round_trip_and_special_tokens(checkpoints):
    tokenizer = load_tokenizer(checkpoints["plain"])
    assert tokenizer.vocab_size == 64
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.add_bos_token) == (0, (1,), True)
    for sample in [*CORPUS, PROMPT, "日本"]:
        ids = tokenizer.encode(sample)
        assert ids[0] == 0 and 0 not in ids[1:]  # BOS once
        assert tokenizer.decode(ids) == sample
    assert tokenizer.encode(BOS + "Open")[:2] == [0, tokenizer.encode("Open")[1]]  # no second BOS
    assert len(tokenizer.encode("日")) == 1 + 3  # one token per UTF-8 byte: no merge of them


def test_stream_gives_characters_once_complete_and_joins_to_the_decode(checkpoints):
    tokenizer = load_tokenizer(checkpoints["plain"])
    stream = tokenizer.decode_stream()
    first, second, third = tokenizer.encode("日")[1:]
    assert [stream.push([first]), stream.push([second]), stream.push([third])] == ["", "", "日"]
    rng = random.Random(0)
    for _ in range(300):  # random ids, invalid UTF-8 and special tokens included, in random pieces
        ids = [rng.randrange(64) for _ in range(rng.randrange(1, 40))]
        stream, pieces, i = tokenizer.decode_stream(), [], 0
        while i < len(ids):
            k = rng.randrange(1, 6)
            pieces.append(stream.push(ids[i : i + k]))
            i += k
        assert "".join(pieces) + stream.finish() == tokenizer.decode(ids), ids


def test_chat_template(checkpoints, tmp_path):
    tokenizer = load_tokenizer(checkpoints["plain"])
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == f"{BOS}<user>hi\n<assistant>"
    ids = tokenizer.encode("hi", chat=True)
    assert ids == tokenizer.tokenizer.encode(rendered, add_special_tokens=False).ids and ids.count(0) == 1
    # chat_template.jinja takes precedence over tokenizer_config.json's
    shutil.copy(checkpoints["plain"] / text.TOKENIZER, tmp_path)
    shutil.copy(checkpoints["plain"] / text.TOKENIZER_CONFIG, tmp_path)
    (tmp_path / text.CHAT_TEMPLATE).write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"
    # the sandbox: no way out through Python's attributes
    (tmp_path / text.CHAT_TEMPLATE).write_text("{{ ().__class__.__base__.__subclasses__() }}")
    with pytest.raises(ValueError, match=r"chat: the chat template of .* failed .*unsafe"):
        load_tokenizer(tmp_path).encode("hi", chat=True)
    # a runtime error names the template's file (before: a bare ZeroDivisionError)
    (tmp_path / text.CHAT_TEMPLATE).write_text("{{ 1 / 0 }}")
    match = r"chat: the chat template of .*chat_template\.jinja failed \(ZeroDivisionError: division by zero"
    with pytest.raises(ValueError, match=match):
        load_tokenizer(tmp_path).encode("hi", chat=True)
    (tmp_path / text.CHAT_TEMPLATE).unlink()
    write_tokenizer(tmp_path, template=None)
    with pytest.raises(ValueError, match=r"chat: .* has no chat template \(chat_template.jinja"):
        load_tokenizer(tmp_path).encode("hi", chat=True)


#: (what is written into a checkpoint directory with the tokenizer, the error's pattern)
BAD_FILES = {
    "no tokenizer.json": ({text.TOKENIZER: None}, r"path: .* has no tokenizer\.json"),
    "tokenizer.json not JSON": ({text.TOKENIZER: "{"}, r"tokenizer\.json: not a readable JSON file"),
    "tokenizer.json a directory": ({text.TOKENIZER: "/"}, r"tokenizer\.json: not a regular file"),
    "tokenizer.json not a tokenizer": (
        {text.TOKENIZER: '{"model": 5}'},
        r"tokenizer\.json: not a tokenizer the tokenizers package reads",
    ),
    "config not an object": ({text.TOKENIZER_CONFIG: "[]"}, r"tokenizer_config\.json: must be a JSON object"),
    "bos not a token": (
        {text.TOKENIZER_CONFIG: '{"bos_token": "<s>"}'},
        r"tokenizer_config\.json: bos_token: '<s>' is not a token of tokenizer\.json",
    ),
    "eos not text": (
        {text.TOKENIZER_CONFIG: '{"eos_token": 1}'},
        r"tokenizer_config\.json: eos_token: must be a token's text, got 1",
    ),
    "add_bos_token not a bool": (
        {text.TOKENIZER_CONFIG: '{"add_bos_token": "yes"}'},
        r"tokenizer_config\.json: add_bos_token: must be a bool",
    ),
    "chat_template a number": (
        {text.TOKENIZER_CONFIG: '{"chat_template": 5}'},
        r"tokenizer_config\.json: chat_template: must be a string",
    ),
    "chat_template not Jinja": (
        {text.CHAT_TEMPLATE: "{% for %}"},
        r"chat_template\.jinja: chat_template: not a Jinja template",
    ),
    "tokenizer.json without tokens": (  # before: loaded, then encode raised a bare Exception
        {text.TOKENIZER: '{"version": "1.0", "model": {"type": "Unigram", "unk_id": null, "vocab": []}}'},
        r"tokenizer\.json: has no tokens",
    ),
    "eos id past the vocabulary": (
        {text.GENERATION_CONFIG: '{"eos_token_id": [1, 64]}'},
        r"generation_config\.json: eos_token_id: must be a token id in \[0, 64\) or a list of them",
    ),
}


@pytest.mark.parametrize("files, match", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_bad_files_are_named(checkpoints, tmp_path, files, match):
    shutil.copy(checkpoints["plain"] / text.TOKENIZER, tmp_path)
    for name, content in files.items():
        (tmp_path / name).unlink(missing_ok=True)
        if content == "/":
            (tmp_path / name).mkdir()
        elif content is not None:
            (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=match):
        load_tokenizer(tmp_path)


def test_generation_config_eos_ids(checkpoints, tmp_path):
    shutil.copy(checkpoints["plain"] / text.TOKENIZER, tmp_path)
    (tmp_path / text.GENERATION_CONFIG).write_text('{"eos_token_id": [1, 5, 1]}')
    assert load_tokenizer(tmp_path).eos_token_ids == (1, 5)  # and no BOS: add_bos_token defaults to false
    assert load_tokenizer(tmp_path).encode("Open")[0] != 0


GENERATE = ["--prompt", PROMPT, "--max-new-tokens", "24", "--steps-per-dispatch", "4"]


@pytest.fixture(scope="module")
def generated(checkpoints):
    """``generate`` in this process, plainly and with a chain on the offline C128 state whose prompt is
    prefilled in chunks of 8 into caches named float32 (the tree runs in a process of its own): {mode:
    (stdout, stderr, the tokens generate returned, the token lists streamed, generate's stop tokens, the
    engine)}."""
    runs = {}
    original = Engine.generate

    def recording(engine, *args, stream, **kwargs):
        pieces = []
        result = original(engine, *args, stream=lambda i, t: (pieces.append(t), stream(i, t)), **kwargs)
        recorded.append((result.tokens[0], pieces, kwargs["stop_tokens"], engine))
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Engine, "generate", recording)
        chunked = ["--draft", "3", "--prefill-chunk", "8", "--kv-cache-dtype", "float32", "--mesh", "data=1"]
        chunked += ["--backend", "offline"]
        chunked += ["--temperature", "1.7", "--top-k", "1", "--top-p", "0.9"]  # one token kept: greedy
        for mode, flags in (("plain", []), ("draft", chunked)):
            recorded = []
            out, err = _run_in_process(["generate", str(checkpoints["mtp"]), *GENERATE, *flags])
            [(tokens, pieces, stops, engine)] = recorded
            runs[mode] = (out, err, tokens, pieces, stops, engine)
    return runs


def _run_in_process(argv):
    """``cli.main(argv)`` with stdout and stderr captured (capsys is per test): (stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert cli.main(argv) == 0
    return out.getvalue(), err.getvalue()


def test_generate_streams_the_decode_of_its_tokens(checkpoints, generated):
    tokenizer = load_tokenizer(checkpoints["mtp"])
    out, err, tokens, pieces, stops, engine = generated["plain"]
    assert len(pieces) > 2 and [t for piece in pieces for t in piece] == tokens  # over several dispatches
    assert out == tokenizer.decode(tokens) + "\n" and "\ufffd" in out  # bytes of no character included
    assert stops == (EOS_ID,) and tokens.index(EOS_ID) == len(tokens) - 1 == 10  # EOS ends it
    assert f"{len(tokens)} tokens in " in err and "tokens/s; mean accepted length 1.00" in err
    assert err.count("\n") == 1  # the report alone: no progress display off a terminal
    assert engine.prefill_chunk is None and engine.model.runtime.kv_cache_dtype == "auto"


def test_generate_several_prompts_as_jsonl(checkpoints, generated, tmp_path):
    """--prompts-file: one JSON object per prompt, in order, with its text cut before a --stop string (each
    request's own), its tokens, finish reason, times and tokens per step; 3 requests through 2 slots."""
    plain_text, tokens = generated["plain"][0].removesuffix("\n"), generated["plain"][2]
    pairs = (plain_text[i : i + 2] for i in range(3, len(plain_text)))
    stop = next(pair for pair in pairs if "\ufffd" not in pair)
    requests = [PROMPT, {"id": "x", "prompt": "Open the file"}, {"prompt": PROMPT}]
    lines = [json.dumps(request) for request in requests]
    (tmp_path / "prompts.jsonl").write_text("\n\n".join(lines))  # blank lines are skipped
    file = tmp_path / "prompts.jsonl"
    flags = ["--prompts-file", str(file), "--stop", stop, "--stop", "\x00", "--slots", "2"]
    out, err = _run_in_process(["generate", str(checkpoints["mtp"]), *GENERATE[2:], *flags])
    first, other, again = map(json.loads, out.splitlines())
    assert first["text"] == plain_text[: plain_text.index(stop)] and stop not in first["text"]
    assert (first["tokens"], first["finish_reason"], first["tokens_per_step"]) == (len(tokens), "stop", 1.0)
    assert first["prompt_tokens"] == len(load_tokenizer(checkpoints["mtp"]).encode(PROMPT))
    assert 0 < first["first_token_seconds"] <= first["seconds"]
    assert (other["index"], other["id"], again["index"]) == (1, "x", 2) and "id" not in again
    assert {k: v for k, v in again.items() if "seconds" not in k} == {
        k: v for k, v in first.items() if "seconds" not in k
    } | {"index": 2}
    assert other["finish_reason"] in ("stop", "length") and 1 <= other["tokens"] <= 24
    assert "3 prompts, " in err and err.count("\n") == 1


def test_generate_greedy_text_is_the_same_with_a_chain(generated):
    """... and with the prompt prefilled in chunks on a mesh of one device, sampled at --temperature 1.7
    with --top-k 1 (the most probable token alone: greedy), on the offline C128 state: --prefill-chunk,
    --kv-cache-dtype, --mesh, the sampling flags and --backend reach the engine."""
    out, err, tokens, _, _, engine = generated["draft"]
    assert engine.model.target.backend is OFFLINE
    assert engine.prefill_chunk == 8 and engine.model.runtime.kv_cache_dtype == "float32"
    assert dict(engine.mesh.shape) == {"data": 1, "model": 1}
    assert (out, tokens) == (generated["plain"][0], generated["plain"][2])
    assert float(err.split("mean accepted length ")[1]) >= 1.0


def test_generate_from_the_shell(checkpoints, generated, tmp_path):
    """As a user runs it (one process), with a draft tree: the plain greedy text, the report on stderr, no
    progress display in a pipe; its executables in the persistent compilation cache under
    ``$XDG_CACHE_HOME`` (no JAX_COMPILATION_CACHE_DIR set)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    result = subprocess.run(
        [sys.executable, "-m", "jax_oc128", "generate", str(checkpoints["mtp"]), *GENERATE, "--tree", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env | {"XDG_CACHE_HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    cached = list((tmp_path / "jax_oc128" / "xla").iterdir())
    assert len(cached) >= 4, cached  # the placement, the restart, the prefill and the decode loop at least
    assert result.stdout == generated["plain"][0]
    assert result.stderr.count("\n") == 1 and "mean accepted length" in result.stderr, result.stderr
    assert float(result.stderr.split("mean accepted length ")[1]) >= 1.0


def test_compile_cache_flags(tmp_path, monkeypatch):
    """The command line's cache: $XDG_CACHE_HOME/jax_oc128/xla (all executables) unless JAX's settings name
    another or none; --no-compile-cache turns JAX's off."""
    import jax

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cli.compile_cache_dir() == tmp_path / "jax_oc128" / "xla"
    names = ("enable_compilation_cache", "compilation_cache_dir", "persistent_cache_min_compile_time_secs")
    saved = {name: getattr(jax.config, f"jax_{name}") for name in names}
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        cli._use_compile_cache(True)
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "jax_oc128" / "xla")
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
        jax.config.update("jax_compilation_cache_dir", "/elsewhere")
        cli._use_compile_cache(True)
        assert jax.config.jax_compilation_cache_dir == "/elsewhere"  # JAX_COMPILATION_CACHE_DIR's
        cli._use_compile_cache(False)
        assert not jax.config.jax_enable_compilation_cache
    finally:
        for name, value in saved.items():
            jax.config.update(f"jax_{name}", value)


#: (the flag named, generate's arguments after the checkpoint's; {dir}: a checkpoint without a tokenizer)
BAD_GENERATE = [
    ("path", "{bare}", []),
    ("--chat", "{untemplated}", ["--chat"]),
    ("--draft", "{plain}", ["--draft", "2"]),  # no MTP layer
    ("--tree", "{plain}", ["--tree", "4"]),
    ("--draft", "{mtp}", ["--draft", "1"]),
    ("--tree", "{mtp}", ["--draft", "2", "--tree", "4"]),
    ("--tree", "{mtp}", ["--backend", "offline", "--tree", "4"]),  # the offline state verifies chains only
    ("--backend", "{mtp}", ["--backend", "gpu"]),
    ("--max-new-tokens", "{mtp}", ["--max-new-tokens", "0"]),
    ("--prompt", "{mtp}", ["--prompt="]),
    ("--prefill-chunk", "{mtp}", ["--prefill-chunk", "0"]),
    ("--kv-cache-dtype", "{mtp}", ["--kv-cache-dtype", "float16"]),
    # before: "argument path" (index_head_dim 16 is no whole FP4 group of 32)
    ("--kv-cache-dtype", "{mtp}", ["--kv-cache-dtype", "fp8_fp4"]),
    ("--prompt", "{mtp}", ["--prompt", "caf\udce9"]),  # b"caf\xe9" as argv: before, a TypeError
    ("--temperature", "{mtp}", ["--temperature", "1" + "0" * 400]),
    ("--top-p", "{mtp}", ["--top-p", "0"]),
    ("--top-p", "{mtp}", ["--top-p", "1.5"]),
    ("--top-p", "{mtp}", ["--top-p", "nan"]),
    ("--top-k", "{mtp}", ["--top-k", "-1"]),
    # max_position_embeddings is 512: before, 10**8 sized the caches and ran out of memory
    ("--max-new-tokens", "{mtp}", ["--max-new-tokens", str(10**8)]),
    ("--max-new-tokens", "{mtp}", ["--max-new-tokens", str(10**12)]),  # before: "argument path"
    ("--max-new-tokens", "{mtp}", ["--max-len", "128", "--max-new-tokens", "126"]),
    ("--max-len", "{mtp}", ["--max-len", "513"]),
    ("--stop", "{mtp}", ["--stop="]),
    ("--mesh", "{mtp}", ["--mesh", "data=2,tensor=2"]),
    ("--mesh", "{mtp}", ["--mesh", "data=64"]),  # more devices than there are
    ("--prompts-file", "{mtp}", ["--prompts-file", "{tmp}/absent.jsonl"]),
    ("--prompts-file", "{mtp}", ["--prompts-file", "{tmp}/bad.jsonl"]),  # line 2 not JSON
    ("--prompts-file", "{mtp}", ["--prompts-file", "{tmp}/blank.jsonl"]),  # no prompt
    ("--prompts-file", "{mtp}", ["--prompts-file", "{tmp}/number.jsonl"]),  # {"prompt": 5}
]


@pytest.mark.parametrize(
    "flag, path, args", BAD_GENERATE, ids=[" ".join([p, *a])[:60] for _, p, a in BAD_GENERATE]
)
def test_bad_generate_input_is_refused_before_the_model_runs(checkpoints, tmp_path, flag, path, args, capsys):
    bare, untemplated = tmp_path / "bare", tmp_path / "untemplated"
    shutil.copytree(HF_CHECKPOINT, bare)
    shutil.copytree(checkpoints["plain"], untemplated)
    write_tokenizer(untemplated, template=None)
    folders = {"bare": bare, "untemplated": untemplated, **checkpoints}
    for name, lines in (("bad", ['"A"', "{"]), ("blank", ["", " "]), ("number", ['{"prompt": 5}'])):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    prompt = [] if flag in ("--prompt", "--prompts-file") else ["--prompt", PROMPT]
    args = [arg.format(tmp=tmp_path) for arg in args]
    argv = ["generate", path.format(**folders), *prompt, *args]
    with count_compiles() as compiles, pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert f"error: argument {flag}: " in capsys.readouterr().err
    if path == "{plain}":  # refused once loaded: the loader's placement compiled, the engine nothing
        assert not compiles.keys() & {"init_state", "restart", "prefill", "decode"}, compiles
    else:
        assert not compiles
