"""Checkpoints: a saved model loads back exactly; a file that does not match its config is refused with an
error naming the file and the tensor or field, before anything of the model's size is allocated, and
nothing in it is unpickled."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time

import jax
import numpy as np
import pytest
from flax import nnx

from jax_oc128 import checkpoint
from jax_oc128.nn import HCA, SLIDING, ModelConfig, RuntimeConfig, SpeculativeModel

EMBED = "['mtp']['embed'].value"  # the shared embedding (stored once, under the first path to it)
UP = "['target']['blocks'][1]['up'].value"
REMOVED = object()  # a config field removed (test_bad_metadata_is_refused)


def shipped():
    """The shipped checkpoint's tensors and metadata."""
    with np.load(checkpoint.DEFAULT_MODEL, allow_pickle=False) as data:
        tensors = {name: data[name] for name in data.files if name != checkpoint.META}
        meta = json.loads(data[checkpoint.META].tobytes())
    return tensors, meta


def write(path, tensors, meta) -> str:
    """A checkpoint of ``tensors`` with ``meta`` (a dict, or raw bytes for the metadata member)."""
    raw = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    np.savez(path, **{checkpoint.META: np.frombuffer(raw, np.uint8)}, **tensors)
    return str(path)


def with_config(meta, **fields):
    return {**meta, "config": {**meta["config"], **fields}}


@pytest.mark.parametrize("fields", [{}, {"dtype": "bfloat16", "mtp": False}], ids=["float32", "bfloat16"])
def test_saved_model_loads_back_exactly(tmp_path, fields):
    """Also a model of bfloat16 weights (stored as their bits) without a draft head."""
    config = ModelConfig.tiny(
        vocab_size=40, hidden_size=32, layer_types=(HCA, SLIDING), head_dim=32, rope_dim=8, **fields
    )
    model = SpeculativeModel(config, rngs=nnx.Rngs(3))
    checkpoint.save(model, tmp_path / "m.npz", note="hi")
    runtime = RuntimeConfig(max_len=512, max_draft=4)
    loaded, meta = checkpoint.load(tmp_path / "m.npz", runtime=runtime)
    assert loaded.config == config and loaded.runtime == runtime and meta["note"] == "hi"
    if config.mtp:
        assert loaded.mtp.embed is loaded.target.embed  # shared, as in the model built from the config
    saved, restored = (jax.tree.leaves(nnx.split(m)[1]) for m in (model, loaded))
    assert [leaf.dtype for leaf in saved] == [leaf.dtype for leaf in restored]
    assert len(saved) == len(restored) and all(map(np.array_equal, saved, restored))
    with pytest.raises(ValueError, match="metadata: 'config' is reserved"):
        checkpoint.save(model, tmp_path / "n.npz", config={})


#: the sha256 of the shipped model's parameters (each one's dtype, shape and bytes, in the state's order) as
#: shipped before its file was regenerated with today's parameter paths and every config field
SHIPPED_PARAMETERS = "e068f31b5a7ef0a3b0af58ac825045fe193b3987c19e61dfa8f83dcd723aeb8c"


def test_shipped_model_is_stored_as_today():
    """The shipped file stores every ModelConfig field and each parameter under its path today (the loader
    reads no earlier layout), and its parameters are those shipped before, bit for bit (so its tokens are
    too)."""
    tensors, meta = shipped()
    assert meta["config"].keys() == {field.name for field in dataclasses.fields(ModelConfig)}
    model, _ = checkpoint.load()
    state = nnx.split(model)[1]
    assert tensors.keys() == {
        jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(state)
    }
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(state):
        value = np.asarray(leaf)
        digest.update(f"{value.dtype}{value.shape}".encode() + value.tobytes())
    assert digest.hexdigest() == SHIPPED_PARAMETERS


def test_earlier_parameter_paths_are_refused(tmp_path):
    """An HCA layer's compressor parameters under their paths of earlier files (attributes of the attention):
    refused, naming them."""
    tensors, meta = shipped()
    earlier = {name.replace("['compressor']['", "['compressor_"): value for name, value in tensors.items()}
    with pytest.raises(ValueError, match=r"missing tensors .*\['compressor'\]\['ape'\]"):
        checkpoint.load(write(tmp_path / "earlier.npz", earlier, meta))


def refusal(path) -> list[str]:
    """The lines of the error loading the checkpoint at ``path`` raises (the checker's: the file, then each
    problem)."""
    with pytest.raises(ValueError) as error:
        checkpoint.load(path)
    lines = str(error.value).splitlines()
    assert lines[0] == f"{path}: the checkpoint does not fit its config:"
    return lines[1:]


def test_wrong_shape_is_refused(tmp_path):
    tensors, meta = shipped()
    tensors[UP] = tensors[UP][:-1]
    path = write(tmp_path / "bad.npz", tensors, meta)
    assert refusal(path) == [f"  tensor {UP}: shape (255, 128), the config gives (256, 128)"]


@pytest.mark.parametrize("dtype", ["float64", ">f4"], ids=["float64", "big-endian"])
def test_wrong_dtype_is_refused(tmp_path, dtype):
    """A parameter is stored in its own dtype (no cast), in the machine's byte order."""
    tensors, meta = shipped()
    tensors[UP] = tensors[UP].astype(dtype)
    path = write(tmp_path / "bad.npz", tensors, meta)
    assert refusal(path) == [f"  tensor {UP}: dtype {dtype}, expected float32"]


def test_missing_and_unexpected_tensors_are_refused(tmp_path):
    """Every problem at once, each tensor named."""
    tensors, meta = shipped()
    up = tensors.pop(UP)
    tensors["['target']['extra'].value"] = up
    path = write(tmp_path / "bad.npz", tensors, meta)
    assert refusal(path) == [
        "  unexpected tensors (1): ['target']['extra'].value",
        f"  missing tensors (1): {UP}",
    ]


@pytest.mark.parametrize("vocab_size", [200, 300])
def test_vocab_size_disagreeing_with_the_embedding_is_refused(tmp_path, vocab_size):
    """Before, both loaded: token ids past a smaller embedding were silently clamped."""
    tensors, meta = shipped()
    path = write(tmp_path / "bad.npz", tensors, with_config(meta, vocab_size=vocab_size))
    with pytest.raises(ValueError, match=r"tensor \['mtp'\]\['embed'\]\.value: shape \(256, 128\)"):
        checkpoint.load(path)


@pytest.mark.parametrize(
    "claim",
    [
        dict(vocab_size=2**30, hidden_size=2**16),  # an embedding of 256 TiB
        dict(layer_types=[SLIDING] * 10**6),  # a million layers: tracing their shapes would take minutes
    ],
    ids=["huge-shapes", "huge-layer-count"],
)
def test_huge_config_claimed_by_a_small_file_fails_fast(tmp_path, claim):
    """The shapes are compared before anything is allocated: the claimed model could not be allocated at
    all (nor, before this check, be randomly initialised in less than hours)."""
    tensors, meta = shipped()
    path = write(tmp_path / "huge.npz", tensors, with_config(meta, **claim))
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"huge\.npz: "):
        checkpoint.load(path)
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize(
    "meta, match",
    [
        (b"{not json", "__meta__: not UTF-8 JSON"),
        (b"\xff\xfe", "__meta__: not UTF-8 JSON"),
        (b"[1, 2]", "__meta__: must be a JSON object with a 'config' object"),
        (b'{"trained_on": "x"}', "__meta__: must be a JSON object with a 'config' object"),
        ({"vocab_sise": 256}, r"config: unknown fields \['vocab_sise'\]"),
        ({"vocab_size": REMOVED}, r"config: missing fields \['vocab_size'\]"),
        ({"vocab_size": "256"}, "config: vocab_size: must be an int, got '256'"),
        ({"max_draft": 8}, r"config: unknown fields \['max_draft'\]"),  # the runtime's, not stored
        ({"rms_norm_eps": -1.0}, "config: rms_norm_eps: must be finite and > 0"),
        ({"layer_types": "sliding_attention"}, "config: layer_types: must be a list"),
        ({"layer_types": [SLIDING, "full_attention"]}, r"config: layer_types\[1\]: must be"),
        ({"mlp_layer_types": "moe"}, "config: mlp_layer_types: must be a list"),
        ({"mlp_layer_types": ["moe"]}, "config: mlp_layer_types: must be None or a tuple of 4"),
        ({"hc_mult": 0}, r"config: hc_mult: must be in \[1, 2\*\*31\)"),
        ({"rope_dim": 15}, "config: rope_dim: must be even"),
    ],
)
def test_bad_metadata_is_refused(tmp_path, meta, match):
    tensors, shipped_meta = shipped()
    if isinstance(meta, dict):  # changed fields of the shipped config
        config = {**shipped_meta["config"], **meta}
        meta = {"config": {key: value for key, value in config.items() if value is not REMOVED}}
    with pytest.raises(ValueError, match=match):
        checkpoint.load(write(tmp_path / "bad.npz", tensors, meta))


def test_missing_metadata_damaged_files_and_non_archives_are_refused(tmp_path):
    tensors, _ = shipped()
    np.savez(tmp_path / "nometa.npz", **tensors)
    with pytest.raises(ValueError, match=r"nometa\.npz: no __meta__"):
        checkpoint.load(tmp_path / "nometa.npz")
    (tmp_path / "text.npz").write_text("not a zip archive")
    with pytest.raises(ValueError, match=r"text\.npz: not a \.npz archive"):
        checkpoint.load(tmp_path / "text.npz")
    with pytest.raises(FileNotFoundError):
        checkpoint.load(tmp_path / "absent.npz")
    damaged = bytearray(checkpoint.DEFAULT_MODEL.read_bytes())
    middle = len(damaged) // 2  # inside a compressed tensor
    damaged[middle : middle + 100] = bytes(100)
    (tmp_path / "damaged.npz").write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=r"damaged\.npz: tensor .*: unreadable"):
        checkpoint.load(tmp_path / "damaged.npz")


class Unpickled:
    """Records its own unpickling."""

    seen = False

    def __init__(self):
        self.payload = "anything"  # a state to restore: unpickling calls __setstate__

    def __setstate__(self, state):
        Unpickled.seen = True


@pytest.mark.parametrize("where", [UP, checkpoint.META])
def test_pickled_object_arrays_are_refused_unread(tmp_path, where):
    """An object array (pickled by np.savez) of the right shape, as a tensor or as the metadata, is refused
    from its header: nothing is unpickled."""
    tensors, meta = shipped()
    objects = np.empty(tensors[UP].shape if where == UP else (3,), object)
    objects[...] = Unpickled()
    path = tmp_path / "pickled.npz"
    if where == UP:
        write(path, {**tensors, UP: objects}, meta)
    else:
        np.savez(path, **{checkpoint.META: objects}, **tensors)
    Unpickled.seen = False
    with pytest.raises(ValueError, match=r"dtype object|__meta__: must be a 1-D uint8 array"):
        checkpoint.load(path)
    assert not Unpickled.seen
    with np.load(path, allow_pickle=True) as data:  # the file does hold a pickle, which a careless load runs
        data[where]
    assert Unpickled.seen
