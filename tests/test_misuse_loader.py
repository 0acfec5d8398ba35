"""Misuse of ``jax_oc128.load_pretrained`` by a hostile directory: the loader's work is bounded by the files'
sizes, not by numbers in the config (config.json and the index capped, regular files only, the config's
layers and experts counted against the headers' tensors before anything is made per layer or expert, the
model's shapes traced once), malformed fields are a ValueError naming the file and the field, the hash
tables may be of any integer dtype, and a shard replaced after the checks is refused, naming the tensor.
Each case is refused before any tensor is placed (the ``nothing_placed`` fixture of conftest.py)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import threading
import time

import jax
import jax.extend
import numpy as np
import pytest
from hf_fixtures import deepseek_named, fixture, target_tensors, tensors_of, write

from jax_oc128 import load_pretrained, pretrained
from jax_oc128.loading import checker, shards


@pytest.fixture(scope="module")
def small_window():
    """The small-window fixture's config and weights (transformers' names)."""
    config, weights, _ = fixture("small_window")
    return config, weights


@pytest.fixture(scope="module")
def deepseek_tensors():
    """The small-window model's tensors under DeepSeek's names (made before ``nothing_placed`` guards the
    test: from_hf places them)."""
    return deepseek_named(target_tensors("small_window"), 4)


@contextlib.contextmanager
def unblocked(fifo: pathlib.Path, after: float = 5.0):
    """While inside, a thread that waits ``after`` seconds and then, if a reader is blocked on ``fifo``,
    writes a byte and closes it, so that a loader that opened the FIFO fails (its error is not the one the
    test expects) instead of hanging the test."""
    done = threading.Event()

    def release():
        deadline = time.monotonic() + after
        while not done.wait(0.05):
            if time.monotonic() < deadline:
                continue
            try:
                writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while nobody reads
            except OSError:
                continue
            os.write(writer, b"x")
            os.close(writer)

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@pytest.mark.usefixtures("nothing_placed")
def test_config_over_the_cap(tmp_path, small_window):
    """A config.json of more than MAX_CONFIG_BYTES (valid JSON: the fields and 2 MiB of spaces) is refused
    from its size, before it is read."""
    config, weights = small_window
    directory = write(tmp_path / "ckpt", config, weights)
    (directory / pretrained.CONFIG).write_text(json.dumps(config) + " " * (2 << 20))
    with pytest.raises(ValueError, match=r"config\.json: more than 1048576 bytes"):
        load_pretrained(directory, max_len=512)


@pytest.mark.usefixtures("nothing_placed")
def test_index_over_the_cap(tmp_path, small_window, monkeypatch):
    config, weights = small_window
    directory = write(tmp_path / "ckpt", config, weights, shards=2)
    size = (directory / pretrained.INDEX).stat().st_size
    monkeypatch.setattr(shards, "MAX_INDEX_BYTES", size - 1)
    with pytest.raises(ValueError, match=rf"index\.json: more than {size - 1} bytes"):
        load_pretrained(directory, max_len=512)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory"])
@pytest.mark.usefixtures("nothing_placed")
def test_config_not_a_regular_file(tmp_path, small_window, kind):
    """config.json a FIFO (nobody writing: reading it would wait forever), a symlink to /dev/zero (reading
    it would never end) or a directory: refused, never read."""
    config, weights = small_window
    directory = write(tmp_path / "ckpt", config, weights)
    target = directory / pretrained.CONFIG
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "dev-zero":
        target.symlink_to("/dev/zero")
    else:
        target.mkdir()
    with unblocked(target), pytest.raises(ValueError, match=r"config\.json: not a regular file"):
        load_pretrained(directory, max_len=512)


def test_symlinks_to_regular_files_load(tmp_path, small_window):
    """The Hugging Face cache's layout: config.json and the shards symlinks to blobs elsewhere."""
    config, weights = small_window
    blobs = write(tmp_path / "blobs", config, weights)
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for name in (pretrained.CONFIG, pretrained.SINGLE):
        (snapshot / name).symlink_to(blobs / name)
    model = load_pretrained(snapshot, dtype="float32", max_len=512)
    assert np.array_equal(tensors_of(model)["lm_head.weight"], weights["lm_head.weight"])


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
@pytest.mark.usefixtures("nothing_placed")
def test_shard_not_a_regular_file(tmp_path, small_window, kind):
    """An indexed shard that is a FIFO (opening it would wait for a writer) or a symlink to /dev/zero."""
    config, weights = small_window
    directory = write(tmp_path / "ckpt", config, weights, shards=2)
    shard = directory / json.loads((directory / pretrained.INDEX).read_text())["weight_map"]["lm_head.weight"]
    shard.unlink()
    if kind == "fifo":
        os.mkfifo(shard)
    else:
        shard.symlink_to("/dev/zero")
    with unblocked(shard), pytest.raises(ValueError, match=rf"{shard.name}: .*not a regular file"):
        load_pretrained(directory, max_len=512)


@pytest.mark.usefixtures("nothing_placed")
def test_experts_counted_not_listed(tmp_path, small_window, deepseek_tensors):
    """n_routed_experts 10**5 on a checkpoint of 4 experts stored one by one (DeepSeek's names): the missing
    expert tensors counted and the first MAX_LISTED named, a short message (before: every missing name
    listed, 1.2 million, and 10**9 experts never finished)."""
    config, _ = small_window
    directory = write(tmp_path / "ckpt", config | {"n_routed_experts": 10**5}, deepseek_tensors)
    missing = 4 * 3 * (10**5 - 4)  # 4 layers, w1 w2 w3 per expert
    with pytest.raises(
        ValueError, match=rf"missing tensors \({missing}\): layers\.0\.ffn\.experts\.4\.w1"
    ) as e:
        load_pretrained(directory, max_len=512)
    lines = str(e.value).splitlines()  # then the routers' and hash tables' shapes
    assert lines[1].endswith(f" and {missing - checker.MAX_LISTED} more")
    assert len(str(e.value)) < 3000


@pytest.mark.usefixtures("nothing_placed")
def test_layers_counted_before_the_model_is_traced(tmp_path, small_window, monkeypatch):
    """A config of 200000 layers (DeepSeek's compress_ratios, 400 KB) on a checkpoint of 100 tensors: refused
    from the count, before the model is built (linear in the layers)."""
    config, weights = small_window
    layers = 200_000
    theirs = {k: v for k, v in config.items() if k not in ("layer_types", "mlp_layer_types")}
    theirs |= {"num_hidden_layers": layers, "compress_ratios": [0] * layers, "num_hash_layers": 0}
    directory = write(tmp_path / "ckpt", theirs, weights)

    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before its layers were counted")

    monkeypatch.setattr(pretrained, "build_abstract", refuse)
    with pytest.raises(ValueError, match=rf"the config has {layers} layers, the checkpoint {len(weights)} "):
        load_pretrained(directory, max_len=512)


def test_the_model_is_built_without_tracing(tmp_path, small_window, monkeypatch):
    """The model the tensors are checked against is built with shapes only: no primitive is bound (tracing
    the construction cost a few ms per parameter, and searching the tracers' origins made it quadratic in
    the layers: 24 layers 7 s, 61 layers about a minute; tests/test_model.py has the 61-layer timings)."""
    binds, built = [], []
    original_bind, original_build = jax.extend.core.Primitive.bind, pretrained.build_abstract

    def counted(self, *args, **params):
        binds.append(self.name)
        return original_bind(self, *args, **params)

    def build(make):
        monkeypatch.setattr(jax.extend.core.Primitive, "bind", counted)
        try:
            built.append(original_build(make))
        finally:
            monkeypatch.setattr(jax.extend.core.Primitive, "bind", original_bind)
        return built[-1]

    monkeypatch.setattr(pretrained, "build_abstract", build)
    config, weights = small_window
    model = load_pretrained(write(tmp_path / "ckpt", config, weights), max_len=512)
    assert built == [model] and not binds


#: (change to the fixture's config, the field the message names); each a ValueError naming config.json
BAD_FIELDS = {
    "rope-empty": ({"rope_parameters": {}}, r"rope_parameters\['main'\]: must be an object, got None"),
    "rope-main-null": (
        {"rope_parameters": {"main": None, "compress": {"rope_theta": 1.0}}},
        r"rope_parameters\['main'\]: must be an object, got None",
    ),
    "rope-not-an-object": ({"rope_parameters": [1, 2]}, r"rope_parameters: must be an object"),
    "rope-theta-missing": (
        {"rope_parameters": {"main": {"rope_type": "default"}, "compress": {"rope_theta": 1.0}}},
        r"rope_parameters\['main'\]: missing field 'rope_theta'",
    ),
    "yarn-factor-missing": (
        {
            "rope_parameters": {
                "main": {"rope_theta": 1e4, "partial_rotary_factor": 0.25},
                "compress": {
                    "rope_type": "yarn",
                    "rope_theta": 1.6e5,
                    "original_max_position_embeddings": 128,
                },
            }
        },
        r"rope_parameters\['compress'\]: missing field 'factor'",
    ),
    "yarn-original-missing": (
        {
            "rope_parameters": {
                "main": {"rope_theta": 1e4, "partial_rotary_factor": 0.25},
                "compress": {"rope_type": "yarn", "rope_theta": 1.6e5, "factor": 4.0},
            }
        },
        r"rope_parameters\['compress'\]: missing field 'original_max_position_embeddings'",
    ),
    "rope-theta-string": (
        {"rope_parameters": {"main": {"rope_theta": "big"}, "compress": {"rope_theta": 1.0}}},
        r"rope_parameters\['main'\]\['rope_theta'\]: must be a finite number, got 'big'",
    ),
    "layers-3": (
        {"num_hidden_layers": 3},
        r"num_hidden_layers: must be the number of layers of layer_types \(4\), got 3",
    ),
    "layers-5": (
        {"num_hidden_layers": 5},
        r"num_hidden_layers: must be the number of layers of layer_types \(4\), got 5",
    ),
    "layers-0": ({"num_hidden_layers": 0}, r"num_hidden_layers: must be >= 1, got 0"),
    "layers-negative": ({"num_hidden_layers": -5}, r"num_hidden_layers: must be >= 1, got -5"),
    "layers-string": ({"num_hidden_layers": "four"}, r"num_hidden_layers: must be an int, got 'four'"),
    "layers-null": ({"num_hidden_layers": None}, r"num_hidden_layers: must be an int, got None"),
    "layer-types-not-a-list": ({"layer_types": 4}, r"layer_types: must be a list, got 4"),
    "mlp-types-not-a-list": ({"mlp_layer_types": "moe"}, r"mlp_layer_types: must be a list, got 'moe'"),
    "int-field-float": ({"hc_mult": 2.5}, r"hc_mult: must be an int, got 2\.5"),
}
#: DeepSeek's fields (the fixture's transformers fields removed)
BAD_DEEPSEEK_FIELDS = {
    "ratios-not-a-list": ({"compress_ratios": 4}, r"compress_ratios: must be a list, got 4"),
    "ratios-short": (
        {"compress_ratios": [0, 4, 128]},
        r"num_hidden_layers: must be the number of layers of compress_ratios \(3\), got 4",
    ),
    "hash-layers": (
        {"num_hash_layers": 5},
        r"num_hash_layers: must be in \[0, 4 = num_hidden_layers\], got 5",
    ),
    "head-dim-zero": ({"head_dim": 0}, r"head_dim: must be >= 1, got 0"),
    "rope-scaling-list": ({"rope_scaling": [4]}, r"rope_scaling: must be an object or null, got \[4\]"),
}


@pytest.mark.parametrize("case", BAD_FIELDS)
@pytest.mark.usefixtures("nothing_placed")
def test_malformed_fields_are_named(tmp_path, small_window, case):
    change, match = BAD_FIELDS[case]
    config, weights = small_window
    with pytest.raises(ValueError, match=r"config\.json: (config: )?" + match):
        load_pretrained(write(tmp_path / "ckpt", config | change, weights), max_len=512)


@pytest.mark.parametrize("case", BAD_DEEPSEEK_FIELDS)
@pytest.mark.usefixtures("nothing_placed")
def test_malformed_deepseek_fields_are_named(tmp_path, small_window, case):
    change, match = BAD_DEEPSEEK_FIELDS[case]
    config, weights = small_window
    theirs = {
        k: v for k, v in config.items() if k not in ("layer_types", "mlp_layer_types", "rope_parameters")
    }
    theirs |= {"compress_ratios": [0, 4, 128, 4, 0], "num_hash_layers": 2, "qk_rope_head_dim": 8}
    with pytest.raises(ValueError, match=r"config\.json: " + match):
        load_pretrained(write(tmp_path / "ckpt", theirs | change, weights), max_len=512)


@pytest.mark.parametrize(
    "text, match",
    [
        ("[" * 100_000 + "]" * 100_000, r"nested too deeply"),
        ('{"vocab_size": 1' + "0" * 5000 + "}", r"digits"),
        ("\xff\xfe{", r"codec can't decode"),
        ("{", r"Expecting property name"),
    ],
    ids=["deep", "5000-digits", "not-utf8", "truncated"],
)
@pytest.mark.usefixtures("nothing_placed")
def test_unreadable_json_names_the_file(tmp_path, small_window, text, match):
    config, weights = small_window
    for file in (pretrained.CONFIG, pretrained.INDEX):
        directory = write(tmp_path / file, config, weights, shards=2)
        (directory / file).write_bytes(text.encode("latin-1"))
        with pytest.raises(ValueError, match=rf"{file}: not a readable JSON file .*{match}"):
            load_pretrained(directory, max_len=512)


@pytest.mark.usefixtures("nothing_placed")
def test_layer_index_of_many_digits_is_an_unexpected_tensor(tmp_path, small_window):
    config, weights = small_window
    name = "layers." + "1" * 5000 + ".attn.wq_a.weight"
    with pytest.raises(ValueError, match=r"unexpected tensors \(1\): layers\.1111"):
        load_pretrained(
            write(tmp_path / "ckpt", config, weights | {name: np.zeros(1, np.float32)}), max_len=512
        )


TABLE = "model.layers.0.mlp.gate.tid2eid"


@pytest.mark.parametrize("dtype", [np.uint64, np.uint32, np.int16, np.uint8])
def test_hash_tables_of_any_integer_dtype(tmp_path, small_window, dtype):
    """The token -> expert tables stored as U64, U32, I16 or U8: the same ids (int32 in the model)."""
    config, weights = small_window
    table = weights[TABLE]
    model = load_pretrained(
        write(tmp_path / "ckpt", config, weights | {TABLE: table.astype(dtype)}), dtype="float32", max_len=512
    )
    got = tensors_of(model)[TABLE]
    assert got.dtype == np.int32 and np.array_equal(got, table)


@pytest.mark.parametrize("value", [2**64 - 1, 2**63, 4])
@pytest.mark.usefixtures("nothing_placed")
def test_hash_table_ids_out_of_range_in_u64(tmp_path, small_window, value):
    config, weights = small_window
    table = weights[TABLE].astype(np.uint64)
    table[3, 1] = value
    with pytest.raises(ValueError, match=rf"tensor {TABLE}: expert ids must be in \[0, 4\)"):
        load_pretrained(write(tmp_path / "ckpt", config, weights | {TABLE: table}), max_len=512)


@pytest.mark.parametrize("change", ["shape", "dtype", "gone", "fifo"])
def test_shard_replaced_after_the_checks(tmp_path, small_window, monkeypatch, change):
    """The checkpoint's file replaced between the header checks and the reads (lm_head (3, 5) against the
    config's (64, 32), F16 instead of BF16, lm_head gone, the file a FIFO): refused when the tensor is read,
    naming it (before: the model held the new (3, 5) lm_head and failed only at its first forward)."""
    config, weights = small_window
    directory = write(tmp_path / "ckpt", config, weights)
    file = directory / pretrained.SINGLE
    replaced = dict(weights)
    if change == "shape":
        replaced["lm_head.weight"] = np.zeros((3, 5), np.float32)
    elif change == "dtype":
        replaced["lm_head.weight"] = weights["lm_head.weight"].astype(np.float16)
    elif change == "gone":
        del replaced["lm_head.weight"]
    replacement = write(tmp_path / "replacement", config, replaced) / pretrained.SINGLE
    checks = pretrained.check_tensors

    def check_then_replace(*args):
        checks(*args)
        if change == "fifo":
            file.unlink()
            os.mkfifo(file)
        else:
            replacement.replace(file)

    monkeypatch.setattr(pretrained, "check_tensors", check_then_replace)
    match = {
        "shape": r"lm_head\.weight: now shape \(3, 5\) and dtype BF16, checked as \(64, 32\) and BF16",
        "dtype": r"lm_head\.weight: now shape \(64, 32\) and dtype F16, checked as \(64, 32\) and BF16",
        "gone": r"tensor lm_head\.weight: not readable",
        "fifo": r"model\.safetensors: not a regular file",
    }[change]
    with unblocked(file), pytest.raises(ValueError, match=match):
        load_pretrained(directory, max_len=512)


@pytest.mark.parametrize("change", ["gone", "fifo"])
def test_shard_replaced_while_it_is_read(tmp_path, small_window, monkeypatch, change):
    """The checkpoint's file replaced (its lm_head gone, or a FIFO in its place) after the loader opened it
    for the reads: every tensor is read from the descriptor the checks were made on, so the model holds the
    checked weights (before: the loader reopened the file by its path for each tensor's offsets, a bare
    KeyError for the gone tensor, and an open of the FIFO that blocked)."""
    config, weights = small_window
    directory = write(tmp_path / "ckpt", config, weights)
    file = directory / pretrained.SINGLE
    gone = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    replacement = write(tmp_path / "replacement", config, gone)
    read_after = []  # the tensors read after the replacement

    class Replacing(shards.Shard):
        def read(self, name, *args):
            if not read_after and not name.endswith("tid2eid"):  # the first read of the placing pass
                file.unlink()
                if change == "fifo":
                    os.mkfifo(file)
                else:
                    (replacement / pretrained.SINGLE).replace(file)
            if not name.endswith("tid2eid"):
                read_after.append(name)
            return super().read(name, *args)

    monkeypatch.setattr(pretrained, "Shard", Replacing)
    with unblocked(file):
        model = load_pretrained(directory, dtype="float32", max_len=512)
    assert "lm_head.weight" in read_after[1:]
    got = tensors_of(model)
    for name in ("lm_head.weight", "model.norm.weight", "model.layers.3.self_attn.q_b_proj.weight"):
        assert np.array_equal(got[name], weights[name])


def _raw_safetensors(file: pathlib.Path, entries: dict[str, dict], data: bytes) -> None:
    """A safetensors file of the header ``entries`` (name -> dtype, shape, data_offsets) and ``data``, as
    written by hand (what safetensors' writer would refuse to write)."""
    header = json.dumps(entries).encode()
    file.write_bytes(len(header).to_bytes(8, "little") + header + data)


@pytest.mark.parametrize("dtype", ["FOO", "F8", 3])
@pytest.mark.usefixtures("nothing_placed")
def test_unknown_dtype_names_the_tensor(tmp_path, small_window, dtype):
    """A shard header giving a tensor a dtype that safetensors has not: "tensor X: unknown dtype FOO"
    (before: safetensors' own parse error, cut short, naming no tensor)."""
    config, weights = small_window
    directory = write(tmp_path / "ckpt", config, weights, shards=2)
    name = "lm_head.weight"
    shard = directory / json.loads((directory / pretrained.INDEX).read_text())["weight_map"][name]
    _raw_safetensors(shard, {name: {"dtype": dtype, "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
    shown = dtype if isinstance(dtype, str) else repr(dtype)
    with pytest.raises(ValueError, match=rf"{shard.name}: tensor lm_head\.weight: unknown dtype {shown}$"):
        load_pretrained(directory, max_len=512)


@pytest.mark.parametrize(
    ("offsets", "match"),
    [
        ([0, 9], r"data_offsets \[0, 9\] outside"),
        ([0, 4], r"4 bytes for shape \(2,\) of F32"),
        ([4], "\\[begin, end\\]"),
    ],
)
@pytest.mark.usefixtures("nothing_placed")
def test_bad_data_offsets_name_the_tensor(tmp_path, small_window, offsets, match):
    """A tensor's bytes past the file's end, too few for its shape, or not a pair: named."""
    config, weights = small_window
    directory = write(tmp_path / "ckpt", config, weights)
    entries = {"lm_head.weight": {"dtype": "F32", "shape": [2], "data_offsets": offsets}}
    _raw_safetensors(directory / pretrained.SINGLE, entries, bytes(8))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor lm_head\.weight: .*" + match):
        load_pretrained(directory, max_len=512)


@pytest.mark.parametrize("shard", ["", ".."])
@pytest.mark.usefixtures("nothing_placed")
def test_index_mapping_to_no_file_names_the_tensor(tmp_path, small_window, shard):
    """An index mapping a tensor to "" or "..": refused naming the tensor (before: "" was the directory
    itself, refused as "not a regular file" naming no tensor)."""
    config, weights = small_window
    directory = write(tmp_path / "ckpt", config, weights, shards=2)
    index = json.loads((directory / pretrained.INDEX).read_text())
    index["weight_map"]["lm_head.weight"] = shard
    (directory / pretrained.INDEX).write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match=rf"weight_map\[lm_head\.weight\]: must be a file name .*, got '{shard}'"
    ):
        load_pretrained(directory, max_len=512)


HOSTILE = {
    "newline": ("x\n  missing tensors (0): none", r"x\n  missing tensors (0): none"),
    "escape": ("x\x1b[2Jy", r"x\x1b[2Jy"),
    "nul": ("x\x00y", r"x\x00y"),
    "right-to-left": ("x\u202eyz", r"x\u202eyz"),
    "backslash": ("x\\ny", r"x\\ny"),
}


@pytest.mark.parametrize("case", HOSTILE)
@pytest.mark.usefixtures("nothing_placed")
def test_tensor_names_are_escaped_in_messages(tmp_path, small_window, case):
    """An unexpected tensor whose name holds a newline (forging a line of the message), ESC, NUL, a
    right-to-left mark or a backslash: the message shows it escaped (checks.shown), one line per problem
    (before: printed as is)."""
    config, weights = small_window
    name, escaped = HOSTILE[case]
    directory = write(tmp_path / "ckpt", config, weights | {name: np.zeros(1, np.float32)})
    with pytest.raises(ValueError) as error:
        load_pretrained(directory, max_len=512)
    message = str(error.value)
    assert message.endswith(f"unexpected tensors (1): {escaped}")
    assert name not in message and len(message.splitlines()) == 2


@pytest.mark.parametrize("index", ["\u0660", "\uff10", "00", "01"])
@pytest.mark.usefixtures("nothing_placed")
def test_layer_indices_are_ascii_digits(tmp_path, small_window, index):
    """A layer's tensor under a layer index of an Arabic-Indic or fullwidth zero, or with a leading zero:
    an unexpected tensor, and layer 0's missing (before: ``\\d`` matched, and int() read it as layer 0)."""
    config, weights = small_window
    name = "model.layers.0.input_layernorm.weight"
    renamed = {k: v for k, v in weights.items() if k != name} | {
        name.replace(".0.", f".{index}.", 1): weights[name]
    }
    with pytest.raises(
        ValueError, match=rf"unexpected tensors \(1\): model\.layers\.{index}\.input"
    ) as error:
        load_pretrained(write(tmp_path / "ckpt", config, renamed), max_len=512)
    assert "missing tensors (1): model.layers.0.input_layernorm.weight" in str(error.value)
