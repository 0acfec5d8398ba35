"""The engine on a 2x2 mesh of 4 CPU devices beyond the engine tests' dense caches (test_engine_on_mesh.py):
paged caches, a chunked prefill, and the full DeepSeek-V4 of test_v4_parity with its experts split over the
model axis; each gives one device's greedy tokens. A module of its own so that pytest-xdist runs it beside
the other."""

from __future__ import annotations

from engines import NEW_TOKENS, SLOTS, N, model, one_device
from flax import nnx
from hf_fixtures import fixture
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from models import prompts

from jax_oc128.engine import Engine
from jax_oc128.nn import SpeculativeModel, sharding


def test_paged_on_a_2x2_mesh_same_greedy_tokens_as_one_device():
    """Paged caches on a 2x2 mesh (6 pages of 128 tokens, 3 per data device; requests of 45 to 244 tokens,
    so requests wait for their device's pages): the dense engine's tokens on one device, plain and
    speculative; each device's slots use its own pages (the pool split over "data" like the slots)."""
    mesh = sharding.make_mesh(2, 2)
    paged = Engine(model(), SLOTS, prompt_bucket=256, mesh=mesh, pages=6, page_size=128)
    for num_tokens in (None, N):
        tokens = paged.generate(prompts(), NEW_TOKENS, num_tokens=num_tokens).tokens
        assert tokens == one_device(num_tokens), f"N = {num_tokens}"
    assert paged.page_pool.waits > 0 and {shard for shard, _ in paged.page_pool.handed_out} == {0, 1}
    entries = paged._idle_state.cache.layers[1].entries
    assert entries.shape[0] == 6 and entries.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 3)


def test_chunked_prefill_on_a_2x2_mesh_same_greedy_tokens_as_one_device():
    """Prompts prefilled 48 positions at a time (chunks that cut the sliding windows and the C128 blocks) in
    each data device's slots: the single-forward engine's tokens on one device, plain and speculative."""
    on_mesh = Engine(model(), SLOTS, prompt_bucket=256, mesh=sharding.make_mesh(2, 2), prefill_chunk=48)
    for num_tokens in (None, N):
        tokens = on_mesh.generate(prompts(), NEW_TOKENS, num_tokens=num_tokens).tokens
        assert tokens == one_device(num_tokens), f"N = {num_tokens}"


def test_full_deepseek_v4_on_a_mesh():
    """The tiny transformers DeepSeek-V4 of test_v4_parity (sliding, CSA and C128 layers, hash and top-k MoE
    of 4 experts, hyper-connections) on the 2x2 mesh: its experts split over the model axis, its CSA caches by
    slot; speculative greedy tokens (N = 2) are one device's."""
    config, weights, data = fixture("small_window")
    v4 = SpeculativeModel.from_hf(config, weights, rngs=nnx.Rngs(0), max_len=512)
    requests = [list(map(int, prompt)) for prompt in data["prompt"]]
    engines = [Engine(v4, 2, prompt_bucket=256, mesh=mesh) for mesh in (None, sharding.make_mesh(2, 2))]
    experts = engines[1].params["target"]["blocks"][0]["moe"]["experts_gate_up"][...]
    assert experts.sharding.is_equivalent_to(NamedSharding(engines[1].mesh, P("model")), 3)
    one, on_mesh = (engine.generate(requests, 12, num_tokens=2).tokens for engine in engines)
    assert on_mesh == one
