"""Saving and loading a :class:`~jax_oc128.nn.SpeculativeModel` (config + parameters in one .npz), and the
default model shipped in the package.

A checkpoint is a ``.npz`` archive: ``__meta__``, the UTF-8 JSON ``{"config": {<every ModelConfig field>},
...metadata}`` as a 1-D uint8 array (the architecture only: how the model runs, its
:class:`~jax_oc128.nn.RuntimeConfig`, is given to :func:`load`), and one array per parameter, named by its
path in the model's state (``['target']['embed'].value``: ``[vocab_size, hidden_size]`` float32, ...; a
bfloat16 parameter as its bits, uint16, which the .npy format can hold). :func:`load` checks the file against
its config before it allocates anything of the model's size: the metadata, every config field, then
every tensor's name, shape and dtype (its parameter's own, no cast), read from the ``.npy`` headers before
any tensor is decompressed, by the loaders' one checker (:func:`~jax_oc128.loading.checker.check_tensors`:
every problem in one error). Nothing is unpickled. Every error is a :class:`ValueError` naming the file
(and the tensor or field).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import zipfile
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_oc128.checks import shown
from jax_oc128.controller import ONLINE, Backend
from jax_oc128.loading.checker import check_tensors
from jax_oc128.loading.names import Part
from jax_oc128.nn import ModelConfig, RuntimeConfig, SpeculativeModel
from jax_oc128.nn.functional import build_abstract

DEFAULT_MODEL = pathlib.Path(__file__).parent / "assets" / "default_model.npz"
#: the archive member holding the JSON metadata
META = "__meta__"
#: the largest metadata accepted, in bytes (read before anything else; a config is a few hundred bytes)
MAX_META_BYTES = 1 << 20
#: .npy header readers by format version (3.0 only adds UTF-8 field names, which no parameter has)
HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
#: parameter dtype -> the dtype it is stored as (its bits), for the dtypes the .npy format has not
STORED_AS = {np.dtype(jnp.bfloat16): np.dtype(np.uint16)}
#: what reading a damaged, encrypted or otherwise unreadable archive member raises
READ_ERRORS = (
    ValueError,
    OSError,
    EOFError,
    RuntimeError,
    NotImplementedError,
    zipfile.BadZipFile,
    zlib.error,
)


def _named_leaves(state) -> list[tuple[str, object]]:
    """The state's leaves, each with its path as a string (the key it is stored under)."""
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(state)]


def save(model: SpeculativeModel, path, **metadata) -> None:
    """Write the model's config, parameters and ``metadata`` (JSON-serialisable; ``config`` is reserved) to
    ``path``."""
    if "config" in metadata:
        raise ValueError("metadata: 'config' is reserved for the model's config")
    _, state = nnx.split(model)
    meta = {"config": dataclasses.asdict(model.config), **metadata}
    np.savez_compressed(
        path,
        **{META: np.frombuffer(json.dumps(meta).encode(), np.uint8)},
        **{name: _stored(np.asarray(leaf)) for name, leaf in _named_leaves(state)},
    )


def load(
    path=DEFAULT_MODEL, *, backend: Backend = ONLINE, runtime: RuntimeConfig | None = None
) -> tuple[SpeculativeModel, dict]:
    """The model stored at ``path`` (default: the shipped one) with the C128 compressor ``backend``, running
    as ``runtime`` says (None: ``RuntimeConfig()``, 4096 tokens and 8 drafts), and its metadata. Raises
    :class:`ValueError` (naming the file, and the field or tensor) for a file that is not such a checkpoint,
    before anything of the model's size is allocated; :class:`OSError` if it cannot be read."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as error:
        raise ValueError(f"{path}: not a .npz archive ({error})") from None
    with archive:
        headers = {}  # by parameter path: the .npy header
        for member in archive.namelist():
            if not member.endswith(".npy"):
                raise ValueError(f"{path}: {shown(member)} is not a .npy array")
            if member.removesuffix(".npy") in headers:
                raise ValueError(f"{path}: tensor {shown(member.removesuffix('.npy'))} is stored twice")
            headers[member.removesuffix(".npy")] = _header(archive, member, path)
        meta = _metadata(archive, headers, path)
        config = _config(meta, len(headers) - 1, path)
        graphdef, abstract = nnx.split(
            build_abstract(lambda rngs: SpeculativeModel(config, runtime, backend=backend, rngs=rngs))
        )
        expected = dict(_named_leaves(abstract))
        stored = {name: (path, shape, _dtype_name(dtype)) for name, (shape, dtype) in headers.items()}
        del stored[META]
        parts = {name: Part(name) for name in stored}
        check_tensors(path, stored, parts, expected, None, dtypes=_stored_dtypes)
        arrays = [
            jax.device_put(_read(archive, name, path).view(want.dtype)) for name, want in expected.items()
        ]
    state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract), arrays)
    return nnx.merge(graphdef, state), meta


def _stored(array: np.ndarray) -> np.ndarray:
    """``array`` as it is stored: its bits for a dtype of :data:`STORED_AS`, else itself."""
    return array.view(STORED_AS[array.dtype]) if array.dtype in STORED_AS else array


def _header(archive: zipfile.ZipFile, member: str, path) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype of the .npy ``member``, from its header alone."""
    try:
        with archive.open(member) as file:
            version = np.lib.format.read_magic(file)
            if version not in HEADER_READERS:
                raise ValueError(f".npy format version {version} (1.0 and 2.0 are read)")
            shape, _, dtype = HEADER_READERS[version](file)
    except READ_ERRORS as error:
        raise ValueError(f"{path}: {shown(member)}: not a readable .npy array ({error})") from None
    return shape, dtype


def _read(archive: zipfile.ZipFile, name: str, path) -> np.ndarray:
    """The array ``name``, never unpickled."""
    try:
        with archive.open(name + ".npy") as file:
            return np.lib.format.read_array(file, allow_pickle=False)
    except READ_ERRORS as error:
        raise ValueError(f"{path}: tensor {shown(name)}: unreadable ({error})") from None


def _metadata(archive: zipfile.ZipFile, headers: dict, path) -> dict:
    """The metadata: a JSON object, at most :data:`MAX_META_BYTES`, with a ``config`` object."""
    if META not in headers:
        raise ValueError(f"{path}: no {META} (the metadata with the model's config)")
    shape, dtype = headers[META]
    if dtype != np.uint8 or len(shape) != 1 or shape[0] > MAX_META_BYTES:
        raise ValueError(f"{path}: {META}: must be a 1-D uint8 array of at most {MAX_META_BYTES} bytes")
    try:
        meta = json.loads(_read(archive, META, path).tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: {META}: not UTF-8 JSON ({error})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        raise ValueError(f"{path}: {META}: must be a JSON object with a 'config' object")
    return meta


def _config(meta: dict, tensors: int, path) -> ModelConfig:
    """The :class:`~jax_oc128.nn.ModelConfig` of ``meta["config"]``: exactly its fields, each checked by the
    config itself; no more layers than the file has ``tensors`` (each layer has
    parameters: a small file claiming a huge number of layers is refused before the model is built)."""
    raw = meta["config"]
    fields = {field.name for field in dataclasses.fields(ModelConfig)}
    for problem, names in (
        ("unknown", raw.keys() - fields),
        ("missing", fields - raw.keys()),
    ):
        if names:
            raise ValueError(f"{path}: config: {problem} fields {shown(repr(sorted(names)))}")
    tuples = {}
    for name in ("layer_types", "mlp_layer_types"):
        value = raw.get(name)
        if name in raw and not isinstance(value, list) and not (name == "mlp_layer_types" and value is None):
            raise ValueError(f"{path}: config: {name}: must be a list, got {value!r}")
        if isinstance(value, list):
            tuples[name] = tuple(value)
    if len(raw["layer_types"]) > tensors:
        raise ValueError(
            f"{path}: config: layer_types: {len(raw['layer_types'])} layers but only {tensors} tensors"
        )
    try:
        return ModelConfig(**{**raw, **tuples})
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: config: {error}") from None


def _dtype_name(dtype: np.dtype) -> str:
    """How the checker names a stored dtype: its name (``float32``), its code where its byte order is not
    the machine's (``>f4``)."""
    return dtype.name if dtype.isnative else dtype.str


def _stored_dtypes(dtype) -> tuple[set[str], str]:
    """The one dtype a parameter of ``dtype`` is stored as (:data:`STORED_AS`), and how a message says it."""
    dtype = np.dtype(dtype)
    if dtype in STORED_AS:
        return {STORED_AS[dtype].name}, f"{dtype} (stored as {STORED_AS[dtype]})"
    return {dtype.name}, dtype.name
