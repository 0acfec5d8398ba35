"""How attention's caches are stored: the window ring and the CSA raw rows in float32 or bfloat16, the CSA and
HCA entries in float32, bfloat16 or DeepSeek's FP8 format, the indexer keys in those or FP4; attention reads
them back in float32 (:func:`decode`) and computes in float32 (:mod:`~jax_oc128.nn.functional`).

``RuntimeConfig.kv_cache_dtype`` (:data:`KV_CACHE_DTYPES`) selects them, resolved once by
:meth:`CacheDtypes.resolve`:

* ``"auto"``: every cache in the model's dtype (``ModelConfig.dtype``), float32 or bfloat16;
* ``"float32"``, ``"bfloat16"``: every cache in that dtype, whatever the model's;
* ``"fp8"``: the window and raw rows in the model's dtype; the entries as :class:`FP8Entries` (the non-RoPE
  channels e4m3 with one power-of-two scale per entry, the RoPE channels bfloat16, as DeepSeek's inference
  stores them) and the indexer keys as FP8 too (every channel e4m3, one scale per key);
* ``"fp8_fp4"``: as ``"fp8"`` but the indexer keys as :class:`FP4Keys` (e2m1, one power-of-two scale per 32
  channels), DeepSeek's inference format: the indexer keys take half the bytes of FP8's.

A stored cache is an array, an :class:`FP8Entries` or an :class:`FP4Keys`, a pytree whose leaves share their
leading axes (batch, then the row or entry index): :func:`take`, :func:`put` and :func:`concatenate` work on
it leaf by leaf. A value is rounded to its cache's format (:func:`round_trip`) before any query reads it,
stored or not, so a verify of N tokens computes from what N decodes read. float32 caches store values as they
are: the exact path, the oracle of the others.

**Pages.** The caches that grow with the context (the CSA and HCA entries, the indexer keys) are stored per
slot, ``[batch, max_entries, ...]`` (dense, the oracle), or in a pool of pages shared by all slots,
``[pages, per_page, ...]`` (``per_page`` entries of ``page_size`` tokens), addressed through a page table
``[batch, max_pages]`` int32 of page indices (-1: no page). :func:`locate` gives where an entry is;
:class:`SlotEntries` reads entries by index where they are stored (a CSA layer's picks) and :func:`slot_view`
a slot's entries in order (its first ``count``: under a forward's context bound,
:attr:`~jax_oc128.nn.forward.ForwardBatch.context`, no entry past it is read, dense or paged); with the page
table None they are the dense layout's own indexing, so one code path serves both. A page (or a dense
slot's row) is never cleared: a stored value no query sees is read as zero (attention masks what it reads),
so whatever it held before does not leak.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_oc128.nn import quant

#: the values of ``RuntimeConfig.kv_cache_dtype``
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8", "fp8_fp4")


def check_kv_cache_dtype(value, name: str = "kv_cache_dtype") -> str:
    """``value`` if one of :data:`KV_CACHE_DTYPES`, else ValueError naming ``name``."""
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"{name}: must be one of {list(KV_CACHE_DTYPES)}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class CacheDtypes:
    """The storage of one layer's caches (static).

    Attributes:
      rows: the window ring's and the CSA raw rows' dtype, ``"float32"`` or ``"bfloat16"``.
      entries: the CSA and HCA entries' format, ``"float32"``, ``"bfloat16"`` or ``"fp8"``.
      index_keys: the indexer keys' format, one of ``entries``' or ``"fp4"``.
    """

    rows: str = "float32"
    entries: str = "float32"
    index_keys: str = "float32"

    @classmethod
    def resolve(cls, kv_cache_dtype: str, model_dtype: str) -> CacheDtypes:
        """The rule: the caches of a model of ``model_dtype`` (``"float32"`` or ``"bfloat16"``) under
        ``kv_cache_dtype`` (see the module doc)."""
        check_kv_cache_dtype(kv_cache_dtype)
        if kv_cache_dtype in ("fp8", "fp8_fp4"):
            return cls(model_dtype, "fp8", "fp4" if kv_cache_dtype == "fp8_fp4" else "fp8")
        plain = model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
        return cls(plain, plain, plain)


def _scale_exponent(x, fmt: str):
    """The exponent ``e`` (int32 ``[...]``) of the power-of-two scale ``2^e`` of each vector ``x`` ``[...,
    n]`` float32 in format ``fmt`` (:data:`~jax_oc128.nn.quant.FP8` or ``FP4``): that of ``frexp(max |x| /
    largest)`` (``largest`` the format's largest code, the quotient at least float32's smallest normal), so
    that ``max |x| / 2^e`` is in [largest / 2, largest)."""
    amax = jnp.max(jnp.abs(x), axis=-1, initial=0.0)
    _, exponent = jnp.frexp(jnp.maximum(amax / quant.LARGEST[fmt], jnp.finfo(jnp.float32).tiny))
    return exponent


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FP8Entries:
    """Vectors of ``dim`` channels in DeepSeek's FP8 cache format, a pytree: value = ``nope * scale`` on the
    leading ``dim - rope_dim`` channels, then ``rope``.

    Attributes:
      nope: ``[..., dim - rope_dim]`` float8_e4m3fn.
      scale: ``[...]`` float32, a power of two per vector: ``max |x_nope| / scale`` is in [224, 448).
      rope: ``[..., rope_dim]`` bfloat16, the RoPE channels (zero-sized for the indexer keys).
    """

    nope: jax.Array
    scale: jax.Array
    rope: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the vectors this holds, ``[..., dim]``."""
        return (*self.nope.shape[:-1], self.nope.shape[-1] + self.rope.shape[-1])

    @classmethod
    def zeros(cls, shape, rope_dim: int) -> FP8Entries:
        """Zeros of ``shape`` ``[..., dim]``, the trailing ``rope_dim`` channels bfloat16."""
        *lead, dim = shape
        return cls(
            jnp.zeros((*lead, dim - rope_dim), jnp.float8_e4m3fn),
            jnp.zeros(lead, jnp.float32),
            jnp.zeros((*lead, rope_dim), jnp.bfloat16),
        )

    @classmethod
    def encode(cls, x, rope_dim: int) -> FP8Entries:
        """``x`` ``[..., dim]`` float32 quantized: the scale is the power of two ``2^e`` of ``frexp(max
        |x_nope| / 448)`` (at least float32's smallest normal), the non-RoPE channels ``x / scale`` rounded
        to e4m3 (nearest even), the RoPE channels rounded to bfloat16."""
        nope, rope = x[..., : x.shape[-1] - rope_dim], x[..., x.shape[-1] - rope_dim :]
        scale = jnp.ldexp(jnp.float32(1), _scale_exponent(nope, quant.FP8))
        return cls((nope / scale[..., None]).astype(jnp.float8_e4m3fn), scale, rope.astype(jnp.bfloat16))

    def decode(self):
        """``[..., dim]`` float32."""
        nope = self.nope.astype(jnp.float32) * self.scale[..., None]
        return jnp.concatenate([nope, self.rope.astype(jnp.float32)], axis=-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FP4Keys:
    """Vectors of ``dim`` channels (a multiple of 32) in FP4, a pytree: e2m1 codes and one power-of-two
    scale per 32 channels, :mod:`~jax_oc128.nn.quant`'s FP4 format (the released checkpoints' experts'):
    value = code's value * 2^(exponent - 127).

    Attributes:
      codes: ``[..., dim / 2]`` uint8, two e2m1 codes a byte (the even channel the low nibble).
      exponents: ``[..., dim / 32]`` uint8 e8m0 exponents: ``max |x| / scale`` over a group is in [3, 6).
    """

    codes: jax.Array
    exponents: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the vectors this holds, ``[..., dim]``."""
        return (*self.codes.shape[:-1], 2 * self.codes.shape[-1])

    @classmethod
    def zeros(cls, shape) -> FP4Keys:
        """Zeros of ``shape`` ``[..., dim]``."""
        *lead, dim = shape
        group = quant.GROUP[quant.FP4]
        if dim % group:
            raise ValueError(f"shape: FP4 keys need a multiple of {group} channels, got {tuple(shape)}")
        return cls(jnp.zeros((*lead, dim // 2), jnp.uint8), jnp.zeros((*lead, dim // group), jnp.uint8))

    @classmethod
    def encode(cls, x) -> FP4Keys:
        """``x`` ``[..., dim]`` float32 quantized: per group of 32 channels the scale is the power of two
        ``2^e`` of ``frexp(max |x| / 6)`` (at least float32's smallest normal), the channels ``x / scale``
        rounded to e2m1 (nearest even, :func:`~jax_oc128.nn.quant.e2m1_codes`)."""
        groups = x.reshape(*x.shape[:-1], -1, quant.GROUP[quant.FP4])
        exponent = _scale_exponent(groups, quant.FP4)
        scaled = groups / jnp.ldexp(jnp.float32(1), exponent)[..., None]
        codes = quant.pack_nibbles(quant.e2m1_codes(scaled).reshape(x.shape))
        return cls(codes, (exponent + quant.E8M0_BIAS).astype(jnp.uint8))

    def decode(self):
        """``[..., dim]`` float32."""
        values = quant.e2m1_values(self.codes)
        groups = values.reshape(*values.shape[:-1], -1, quant.GROUP[quant.FP4])
        return (groups * quant.scale_values(self.exponents)[..., None]).reshape(values.shape)


def zeros(shape, fmt: str, rope_dim: int = 0):
    """An empty cache of vectors ``shape`` ``[..., dim]`` in ``fmt`` (``"float32"``, ``"bfloat16"``,
    ``"fp8"``: :class:`FP8Entries` with ``rope_dim`` RoPE channels, or ``"fp4"``: :class:`FP4Keys`)."""
    if fmt == "fp8":
        return FP8Entries.zeros(shape, rope_dim)
    if fmt == "fp4":
        return FP4Keys.zeros(shape)
    return jnp.zeros(shape, jnp.dtype(fmt))


def encode(x, like):
    """``x`` ``[..., dim]`` float32 in the format of the stored cache ``like``."""
    if isinstance(like, FP8Entries):
        return FP8Entries.encode(x, like.rope.shape[-1])
    if isinstance(like, FP4Keys):
        return FP4Keys.encode(x)
    return x.astype(like.dtype)


def decode(stored):
    """A stored cache's values, float32."""
    return stored.decode() if isinstance(stored, FP8Entries | FP4Keys) else stored.astype(jnp.float32)


def round_trip(x, like):
    """``x`` float32 as a query reads it once stored in ``like``'s format (``x`` itself for float32)."""
    return decode(encode(x, like))


def take(stored, index):
    """``stored[index]`` (an index of its leading axes), in its format."""
    return jax.tree.map(lambda leaf: leaf[index], stored)


def put(stored, index, values):
    """``stored`` with ``stored[index]`` set to ``values`` (stored values of its format; out-of-range
    indices dropped)."""
    return jax.tree.map(lambda leaf, value: leaf.at[index].set(value, mode="drop"), stored, values)


def put_nodes(stored, values):
    """``stored`` ``[batch, max_draft, ...]`` with its first ``values.shape[1]`` nodes set to ``values``
    (stored values of its format) by ``dynamic_update_slice``: a scatter here crashes jax 0.11.2's partitioner
    inside the engine's ``shard_map`` (``scripts/repro_data_parallel_crash.py``)."""
    return jax.tree.map(
        lambda leaf, value: jax.lax.dynamic_update_slice_in_dim(leaf, value, 0, 1), stored, values
    )


def store(stored, index, x):
    """``stored`` with ``stored[index]`` set to ``x`` float32, encoded (out-of-range indices dropped)."""
    return put(stored, index, encode(x, stored))


def clear(stored, index):
    """``stored`` with ``stored[index]`` zeroed (out-of-range indices dropped)."""
    return put(stored, index, jax.tree.map(lambda leaf: jnp.zeros((), leaf.dtype), stored))


def slot_view(stored, page_table, count: int | None = None):
    """A stored cache's first ``count`` entries per slot in order (default: all, :func:`slot_entries`):
    ``stored[:, :count]`` for the dense layout (``page_table`` None), else the pool ``[pages, per_page,
    ...]`` gathered through the first ``ceil(count / per_page)`` columns of ``page_table`` ``[batch,
    max_pages]`` int32 into ``[batch, count, ...]``, zeros where a slot has no page (-1). Nothing past
    ``count`` is read."""
    count = slot_entries(stored, page_table) if count is None else count
    if page_table is None:
        return jax.tree.map(lambda leaf: leaf[:, :count], stored)

    def gather(leaf):
        columns = page_table[:, : -(-count // leaf.shape[1])]
        index = jnp.where(columns >= 0, columns, leaf.shape[0])
        pages = jnp.take(leaf, index, axis=0, mode="fill", fill_value=0)
        gathered = columns.shape[1] * leaf.shape[1]  # not -1: a leaf may have no channels (FP8 keys' RoPE)
        return pages.reshape(page_table.shape[0], gathered, *leaf.shape[2:])[:, :count]

    return jax.tree.map(gather, stored)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotEntries:
    """A forward's entries of each slot, read by index where they are stored (no copy of them all, dense or
    paged): entry ``i < count`` is the slot's stored entry i (:func:`locate` in ``stored``), entry ``count +
    n`` a tree verify's node n of ``nodes``.

    Attributes:
      stored: a stored cache, ``[batch, E, ...]`` (dense) or a pool of pages ``[pages, per_page, ...]``.
      page_table: ``[batch, max_pages]`` int32, or None (dense).
      nodes: None, or ``[batch, N, ...]`` stored values of ``stored``'s format.
      count: how many of each slot's stored entries are read (static).
    """

    stored: jax.Array | FP8Entries | FP4Keys
    page_table: jax.Array | None
    nodes: jax.Array | FP8Entries | FP4Keys | None
    count: int = dataclasses.field(metadata={"static": True})

    @property
    def rows(self) -> int:
        """The entries a slot reads: ``count``, then the nodes (static)."""
        return self.count + (0 if self.nodes is None else rows(self.nodes))

    def take(self, index):
        """The entries ``index`` ``[batch, ...]`` int32 (in ``[0, rows)``; any other index reads some entry
        of the pool, to be masked) of each slot, stored values ``[batch, ..., dim]``."""
        slots = jnp.arange(index.shape[0]).reshape(-1, *[1] * (index.ndim - 1))
        values = take(self.stored, locate(self.stored, self.page_table, slots, index))
        if self.nodes is None:
            return values
        node = index - self.count
        from_nodes = take(self.nodes, (slots, jnp.clip(node, 0, rows(self.nodes) - 1)))

        def pick(value, from_node):
            channels = value.ndim - node.ndim
            return jnp.where((node >= 0).reshape(*node.shape, *[1] * channels), from_node, value)

        return jax.tree.map(pick, values, from_nodes)

    def view(self):
        """Every entry a slot reads, in order: ``[batch, rows, ...]`` stored values (a copy where paged:
        :func:`slot_view`)."""
        view = slot_view(self.stored, self.page_table, self.count)
        return view if self.nodes is None else concatenate(view, self.nodes, axis=1)


def rows(stored) -> int:
    """The rows along a stored cache's second axis (static): ``E`` of entries ``[batch, E, ...]`` (a slot's
    rows), ``per_page`` of a pool of pages ``[pages, per_page, ...]`` (a page's rows)."""
    return jax.tree.leaves(stored)[0].shape[1]


def slot_entries(stored, page_table) -> int:
    """How many entries a slot addresses in ``stored``: ``E`` of the dense ``[batch, E, ...]``, else
    ``max_pages * per_page`` (static)."""
    return rows(stored) if page_table is None else page_table.shape[1] * rows(stored)


def locate(stored, page_table, rows, index):
    """Where entry ``index`` of slot ``rows`` goes in ``stored`` (broadcastable int32 arrays; an index past
    the slot's entries, or in a page it has no page for, is out of range: a :func:`put` there is dropped,
    never another slot's page): ``(rows, index)`` for the dense layout (``page_table`` None), else the page
    from ``page_table`` ``[batch, max_pages]`` and the entry within it."""
    if page_table is None:
        return rows, index
    pages, per_page = jax.tree.leaves(stored)[0].shape[:2]
    max_pages = page_table.shape[1]
    slot_page = index // per_page
    page = page_table[rows, jnp.clip(slot_page, 0, max_pages - 1)]
    inside = (index >= 0) & (slot_page < max_pages) & (page >= 0)
    return jnp.where(inside, page, pages), index % per_page


def concatenate(stored, more, axis: int):
    """Two stored caches of one format joined along a leading ``axis``."""
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=axis), stored, more)
