"""Misuse of the Engine (its constructor, init_state, generate, prefill and decode): every case raises a
TypeError (a wrong type) or a ValueError (a wrong value) whose message starts with the argument's name, before
anything is compiled or dispatched: a table of cases, each the call, the exception and the message. Then the
edges the checks must let through (an empty batch, the longest prompt, the largest seed and budget)."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx
from harness import count_compiles
from jax.sharding import Mesh
from models import DECODE_CONFIG, DECODE_RUNTIME

from jax_oc128.checks import NamedError
from jax_oc128.controller import OFFLINE
from jax_oc128.engine import MAX_STOP_TOKENS, Engine
from jax_oc128.nn import HCA, SLIDING, SpeculativeModel, sharding
from jax_oc128.tree import Tree

# the engine tests' model with one sliding and one C128 layer of 2 heads, shorter and with fewer draft banks
CONFIG = dataclasses.replace(DECODE_CONFIG, layer_types=(SLIDING, HCA), num_heads=2)
RUNTIME = dataclasses.replace(DECODE_RUNTIME, max_len=512, max_draft=4)
VOCAB, MAX_LEN, MAX_DRAFT = CONFIG.vocab_size, RUNTIME.max_len, RUNTIME.max_draft
SLOTS = 2
# with max_new_tokens = 3: the longest prompt of plain steps (N = 1) and of N = MAX_DRAFT
LONGEST_PLAIN, LONGEST_SPECULATIVE = MAX_LEN - 3 - 1, MAX_LEN - 3 - MAX_DRAFT


@pytest.fixture(scope="module")
def engine():
    model = SpeculativeModel(CONFIG, RUNTIME, rngs=nnx.Rngs(0))
    return Engine(model, slots=SLOTS, prompt_bucket=64, steps_per_dispatch=4)


@pytest.fixture(scope="module")
def foreign_states(engine):
    """States that ``engine`` must refuse: another engine's (more slots; the offline backend; the same
    layout) and one of its own already donated."""
    donated = engine.init_state()
    jax.jit(lambda state: state, donate_argnums=0)(donated)
    return {
        "more slots": Engine(engine.model, slots=SLOTS + 1).init_state(),
        "offline": Engine(
            SpeculativeModel(CONFIG, RUNTIME, backend=OFFLINE, rngs=nnx.Rngs(0)), slots=SLOTS
        ).init_state(),
        "same layout": Engine(engine.model, slots=SLOTS, prompt_bucket=64, steps_per_dispatch=4).init_state(),
        "donated": donated,
    }


def generate(prompts=([1, 2, 3],), max_new_tokens=3, **kwargs):
    """A call of ``engine.generate``, valid unless an argument is given."""
    return lambda engine, state, others: engine.generate(prompts, max_new_tokens, **kwargs)


def prefill(assignments=None, max_new_tokens=3, state=None, **kwargs):
    """A call of ``engine.prefill`` (a fresh state, or the foreign state named ``state``)."""
    assignments = {0: [1, 2, 3]} if assignments is None else assignments
    return lambda engine, fresh, others: engine.prefill(
        fresh if state is None else others[state], assignments, max_new_tokens, **kwargs
    )


def decode(state=None, **kwargs):
    """A call of ``engine.decode`` (a fresh state, or the foreign state named ``state``)."""
    return lambda engine, fresh, others: engine.decode(fresh if state is None else others[state], **kwargs)


def construct(model=None, **kwargs):
    """A call of ``Engine(...)`` (the engine's model unless ``model`` is given)."""
    return lambda engine, state, others: Engine(
        engine.model if model is None else model(engine), **{"slots": 1, **kwargs}
    )


def construct_on_mesh(axes):
    """A call of ``Engine(...)`` on a mesh of one device with the axes ``axes``."""
    return lambda engine, state, others: Engine(
        engine.model, 1, mesh=Mesh(np.array(jax.devices()[:1]).reshape(1, 1), axes)
    )


def init_state(seed):
    return lambda engine, state, others: engine.init_state(seed)


def prompts_generator(engine, state, others):
    return engine.generate(([1, 2] for _ in range(2)), 3)


CASES = [
    # Engine(...)
    (
        "Engine model None",
        construct(lambda e: None),
        TypeError,
        "model: must be a flax.nnx.Module implementing",
    ),
    (
        "Engine model target",
        construct(lambda e: e.model.target),
        TypeError,
        "model: must implement jax_oc128.protocols.Model, DeepseekV4Model has no vocab_size, max_len, ",
    ),
    ("Engine slots 0", construct(slots=0), ValueError, r"slots: must be in \[1, "),
    ("Engine slots -1", construct(slots=-1), ValueError, "slots: must be in"),
    ("Engine slots 2.0", construct(slots=2.0), TypeError, "slots: must be an int"),
    ("Engine slots True", construct(slots=True), TypeError, "slots: must be an int"),
    ("Engine prompt_bucket 0", construct(prompt_bucket=0), ValueError, "prompt_bucket: must be in"),
    ("Engine prefill_chunk 0", construct(prefill_chunk=0), ValueError, r"prefill_chunk: must be in \[1, "),
    ("Engine prefill_chunk -1", construct(prefill_chunk=-1), ValueError, "prefill_chunk: must be in"),
    ("Engine prefill_chunk 1.5", construct(prefill_chunk=1.5), TypeError, "prefill_chunk: must be an int"),
    ("Engine prefill_chunk True", construct(prefill_chunk=True), TypeError, "prefill_chunk: must be an int"),
    ("Engine context_floor 0", construct(context_floor=0), ValueError, r"context_floor: must be in \[1, "),
    (
        "Engine context_floor 200",
        construct(context_floor=200),
        ValueError,
        "context_floor: must be None or a m",
    ),
    (
        "Engine context_floor 256.0",
        construct(context_floor=256.0),
        TypeError,
        "context_floor: must be an int",
    ),
    ("Engine K '4'", construct(steps_per_dispatch="4"), TypeError, "steps_per_dispatch: must be an int"),
    ("Engine K 0", construct(steps_per_dispatch=0), ValueError, "steps_per_dispatch: must be in"),
    ("Engine mesh devices", construct(mesh=[0]), TypeError, "mesh: must be a jax.sharding.Mesh, got list"),
    ("Engine mesh axes", construct_on_mesh(("slots", "heads")), ValueError, r"mesh: axes must be \('data', "),
    # init_state: seeds are ints in [0, 2**32)
    ("init_state seed -1", init_state(-1), ValueError, r"seed: must be in \[0, 4294967295\], got -1"),
    ("init_state seed 2**32", init_state(2**32), ValueError, "seed: must be in"),
    ("init_state seed 2**70", init_state(2**70), ValueError, "seed: must be in"),
    ("init_state seed 1.5", init_state(1.5), TypeError, "seed: must be an int"),
    ("init_state seed 'x'", init_state("x"), TypeError, "seed: must be an int"),
    ("init_state seed True", init_state(True), TypeError, "seed: must be an int"),
    # generate: prompts
    ("generate prompts bytes", generate(b"abc"), TypeError, "prompts: must be a sequence of prompts"),
    ("generate prompts generator", prompts_generator, TypeError, "prompts: must be a sequence of prompts"),
    ("generate prompt int", generate([5]), TypeError, r"prompts\[0\]: must be a sequence of token ids"),
    ("generate prompt str", generate(["abc"]), TypeError, r"prompts\[0\]: must be a sequence of token ids"),
    ("generate prompt floats", generate([[1.0, 2.0]]), TypeError, r"prompts\[0\]: token ids must be ints"),
    ("generate prompt bools", generate([[1, True]]), TypeError, r"prompts\[0\]: token ids must be ints"),
    (
        "generate prompt 2-D array",
        generate([np.ones((2, 2), np.int32)]),
        TypeError,
        r"prompts\[0\]: must be a 1-D integer array",
    ),
    (
        "generate prompt float array",
        generate([np.ones(3)]),
        TypeError,
        r"prompts\[0\]: must be a 1-D integer array",
    ),
    ("generate prompt empty", generate([[1, 2], []]), ValueError, r"prompts\[1\]: length 0 must be in \[1, "),
    (
        "generate prompt too long, plain",
        generate([[1] * (LONGEST_PLAIN + 1)]),
        ValueError,
        rf"prompts\[0\]: length {LONGEST_PLAIN + 1} must be in \[1, {LONGEST_PLAIN} = max_len - max_new",
    ),
    (
        "generate prompt too long, N",
        generate([[1] * (LONGEST_SPECULATIVE + 1)], num_tokens=MAX_DRAFT),
        ValueError,
        rf"prompts\[0\]: length {LONGEST_SPECULATIVE + 1} must be in \[1, {LONGEST_SPECULATIVE} = ",
    ),
    (
        "generate prompt id vocab",
        generate([[1, VOCAB]]),
        ValueError,
        rf"prompts\[0\]: token ids must be in \[0, {VOCAB}\), got {VOCAB}",
    ),
    (
        "generate prompt id -1",
        generate([[-1, 2]]),
        ValueError,
        r"prompts\[0\]: token ids must be in .*got -1",
    ),
    ("generate prompt id 2**70", generate([[2**70]]), ValueError, r"prompts\[0\]: token ids must be in"),
    # generate: max_new_tokens, named before the prompts it leaves no room for
    (
        "generate max_new_tokens 0",
        generate(max_new_tokens=0),
        ValueError,
        r"max_new_tokens: must be in \[1, ",
    ),
    (
        "generate max_new_tokens 2.5",
        generate(max_new_tokens=2.5),
        TypeError,
        "max_new_tokens: must be an int",
    ),
    ("generate max_new_tokens True", generate(max_new_tokens=True), TypeError, "max_new_tokens: must be an"),
    (
        "generate max_new_tokens 600",
        generate(max_new_tokens=600),
        ValueError,
        rf"max_new_tokens: must be in \[1, {MAX_LEN - 2} = max_len - N - 1\], got 600",
    ),
    ("generate max_new_tokens 2**31", generate(max_new_tokens=2**31), ValueError, "max_new_tokens: must be"),
    (
        "generate max_new_tokens no room for N",
        generate(max_new_tokens=MAX_LEN - MAX_DRAFT, num_tokens=MAX_DRAFT),
        ValueError,
        rf"max_new_tokens: must be in \[1, {MAX_LEN - MAX_DRAFT - 1} = ",
    ),
    # generate: num_tokens, temperature, top_p, top_k, stop_tokens, seed, progress, stream
    (
        "generate num_tokens 1",
        generate(num_tokens=1),
        ValueError,
        r"num_tokens: must be in \[2, 4 = max_draft",
    ),
    (
        "generate num_tokens max_draft+1",
        generate(num_tokens=MAX_DRAFT + 1),
        ValueError,
        "num_tokens: must be",
    ),
    ("generate num_tokens 2.0", generate(num_tokens=2.0), TypeError, "num_tokens: must be an int"),
    ("generate num_tokens True", generate(num_tokens=True), TypeError, "num_tokens: must be an int"),
    (
        "generate temperature -1",
        generate(temperature=-1.0),
        ValueError,
        "temperature: must be finite and >= 0",
    ),
    (
        "generate temperature nan",
        generate(temperature=float("nan")),
        ValueError,
        "temperature: must be finite",
    ),
    ("generate temperature inf", generate(temperature=np.inf), ValueError, "temperature: must be finite"),
    (
        "generate temperature 10**400",  # before: a bare OverflowError from float()
        generate(temperature=10**400),
        ValueError,
        "temperature: must be finite and >= 0, got an int of 401 digits",
    ),
    ("generate temperature True", generate(temperature=True), TypeError, "temperature: must be a number"),
    ("generate temperature '1'", generate(temperature="1"), TypeError, "temperature: must be a number"),
    ("generate top_p 0", generate(top_p=0.0), ValueError, r"top_p: must be in \(0, 1\]"),
    ("generate top_p 1.5", generate(top_p=1.5), ValueError, r"top_p: must be in \(0, 1\]"),
    ("generate top_p nan", generate(top_p=float("nan")), ValueError, r"top_p: must be in \(0, 1\]"),
    ("generate top_p '0.9'", generate(top_p="0.9"), TypeError, "top_p: must be a number or None"),
    ("generate top_p True", generate(top_p=True), TypeError, "top_p: must be a number or None"),
    ("generate top_k -1", generate(top_k=-1), ValueError, "top_k: must be >= 0"),
    ("generate top_k 2.0", generate(top_k=2.0), TypeError, "top_k: must be an int"),
    (
        "generate stop 2**40",
        generate(stop_tokens=[2**40]),
        ValueError,
        r"stop_tokens: ids must be in \[0, 64\)",
    ),
    ("generate stop vocab", generate(stop_tokens=[3, VOCAB]), ValueError, "stop_tokens: ids must be in"),
    ("generate stop -1", generate(stop_tokens=[-1]), ValueError, "stop_tokens: ids must be in"),
    ("generate stop 1.5", generate(stop_tokens=[1.5]), TypeError, "stop_tokens: ids must be ints, got 1.5"),
    ("generate stop True", generate(stop_tokens=[True]), TypeError, "stop_tokens: ids must be ints"),
    ("generate stop scalar", generate(stop_tokens=5), TypeError, "stop_tokens: must be a sequence of token"),
    (
        "generate stop 0-d array",
        generate(stop_tokens=np.int32(5)),
        TypeError,
        "stop_tokens: must be a sequence",
    ),
    ("generate stop str", generate(stop_tokens="\n"), TypeError, "stop_tokens: must be a sequence"),
    (
        "generate stop too many",
        generate(stop_tokens=range(MAX_STOP_TOKENS + 1)),
        ValueError,
        f"stop_tokens: at most {MAX_STOP_TOKENS} ids, got {MAX_STOP_TOKENS + 1}",
    ),
    ("generate seed -1", generate(seed=-1), ValueError, "seed: must be in"),
    ("generate seed 2**32", generate(seed=2**32), ValueError, "seed: must be in"),
    ("generate seed 1.5", generate(seed=1.5), TypeError, "seed: must be an int"),
    ("generate progress 5", generate(progress=5), TypeError, "progress: must be callable or None, got 5"),
    ("generate stream 5", generate(stream=5), TypeError, "stream: must be callable or None, got 5"),
    # prefill
    ("prefill slot -1", prefill({-1: [1]}), ValueError, r"assignments: a slot: must be in \[0, 1\], got -1"),
    ("prefill slot slots", prefill({SLOTS: [1]}), ValueError, "assignments: a slot: must be in"),
    ("prefill slot 0.0", prefill({0.0: [1]}), TypeError, "assignments: a slot: must be an int"),
    ("prefill no request", prefill({}), ValueError, "assignments: no request"),
    (
        "prefill list",
        prefill([[1, 2]]),
        TypeError,
        r"assignments: must be a mapping \{slot: prompt\}, got list",
    ),
    ("prefill prompt empty", prefill({0: [1], 1: []}), ValueError, r"assignments\[1\]: length 0"),
    ("prefill prompt int", prefill({0: 5}), TypeError, r"assignments\[0\]: must be a sequence of token ids"),
    ("prefill prompt id vocab", prefill({0: [VOCAB]}), ValueError, r"assignments\[0\]: token ids must be in"),
    (
        "prefill prompt too long, plain",
        prefill({0: [1] * (LONGEST_PLAIN + 1)}),
        ValueError,
        rf"assignments\[0\]: length {LONGEST_PLAIN + 1} must be in \[1, {LONGEST_PLAIN} = ",
    ),
    (
        "prefill prompt too long, N",
        prefill({0: [1] * (LONGEST_SPECULATIVE + 1)}, num_tokens=MAX_DRAFT),
        ValueError,
        rf"assignments\[0\]: length {LONGEST_SPECULATIVE + 1} must be in \[1, {LONGEST_SPECULATIVE} = ",
    ),
    ("prefill max_new_tokens 0", prefill(max_new_tokens=0), ValueError, "max_new_tokens: must be in"),
    ("prefill max_new_tokens 2**40", prefill(max_new_tokens=2**40), ValueError, "max_new_tokens: must be in"),
    ("prefill num_tokens 1", prefill(num_tokens=1), ValueError, "num_tokens: must be in"),
    ("prefill temperature -1", prefill(temperature=-1), ValueError, "temperature: must be finite and >= 0"),
    ("prefill stop vocab", prefill(stop_tokens=[VOCAB]), ValueError, "stop_tokens: ids must be in"),
    ("prefill state None", prefill(state="none"), TypeError, "state: must be a DecodeState"),
    (
        "prefill state more slots",
        prefill(state="more slots"),
        ValueError,
        r"state: not this engine's: state\.cache.* is float32\[3, ",
    ),
    ("prefill state offline", prefill(state="offline"), ValueError, "state: not this engine's"),
    (
        "prefill state same layout",
        prefill(state="same layout"),
        ValueError,
        r"state: not this engine's: made by engine \d+, this is engine \d+ \(of the same layout",
    ),
    (
        "prefill state donated",
        prefill(state="donated"),
        ValueError,
        "state: already donated to an earlier call",
    ),
    # decode
    ("decode num_tokens 1", decode(num_tokens=1), ValueError, r"num_tokens: must be in \[2, "),
    ("decode num_tokens max_draft+1", decode(num_tokens=MAX_DRAFT + 1), ValueError, "num_tokens: must be in"),
    ("decode steps 0", decode(steps=0), ValueError, r"steps: must be in \[1, "),
    ("decode steps 2.0", decode(steps=2.0), TypeError, "steps: must be an int"),
    ("prefill top_p 0", prefill(top_p=0), ValueError, r"top_p: must be in \(0, 1\]"),
    ("prefill top_k -1", prefill(top_k=-1), ValueError, "top_k: must be >= 0"),
    ("decode stop scalar", decode(stop_tokens=5), TypeError, "stop_tokens: must be a sequence"),
    ("decode waiting 'no'", decode(waiting="no"), TypeError, "waiting: must be a bool"),
    ("decode context 0", decode(context=0), ValueError, r"context: must be in \[1, 512\]"),
    ("decode context max_len+1", decode(context=MAX_LEN + 1), ValueError, r"context: must be in \[1, 512\]"),
    ("decode context 1.0", decode(context=1.0), TypeError, "context: must be an int"),
    ("decode state dict", decode(state="dict"), TypeError, "state: must be a DecodeState"),
    ("decode state more slots", decode(state="more slots"), ValueError, "state: not this engine's"),
    ("decode state offline", decode(state="offline"), ValueError, "state: not this engine's"),
    (
        "decode state same layout",
        decode(state="same layout"),
        ValueError,
        "state: not this engine's: made by engine",
    ),
    (
        "decode state donated",
        decode(state="donated"),
        ValueError,
        "state: already donated to an earlier call; use the state it returned",
    ),
]


@pytest.mark.parametrize(("call", "error", "match"), [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_misuse_raises_before_anything_runs(engine, foreign_states, monkeypatch, call, error, match):
    """The exception names the argument; nothing compiled, nothing dispatched (the engine's jitted functions
    are replaced by ones that fail the test), the state given is not consumed."""
    state = engine.init_state()
    others = {**foreign_states, "none": None, "dict": {"token": state.token}}

    def dispatched(*args, **kwargs):
        pytest.fail("dispatched before the arguments were checked")

    for name in ("_init_state", "_restart", "_prefill", "_decode"):
        monkeypatch.setattr(engine, name, dispatched)
    with count_compiles() as compiles, pytest.raises(error, match=f"^{match}") as raised:
        call(engine, state, others)
    assert not compiles, compiles
    assert isinstance(raised.value, NamedError)  # its argument: what the message starts with
    assert re.fullmatch(match.split(": ")[0], raised.value.argument), raised.value.argument
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))


@pytest.mark.parametrize(
    ("data", "model", "error", "match"),
    [
        (0, 1, ValueError, "data: must be >= 1, got 0"),
        (1, 1.0, TypeError, "model: must be an int, got 1.0"),
        (2, 1, ValueError, "data: 2 x model 1 devices, but 1 are available"),
    ],
)
def test_make_mesh_misuse(data, model, error, match):
    with pytest.raises(error, match=match):
        sharding.make_mesh(data, model, jax.devices()[:1])


def test_empty_batch_returns_at_once(engine, monkeypatch):
    """generate([]) returns an empty Result, nothing dispatched; its other arguments are still checked."""
    monkeypatch.setattr(engine, "_restart", lambda *args: pytest.fail("dispatched"))
    with count_compiles() as compiles:
        result = engine.generate([], 3)
    assert (result.tokens, result.steps, result.dispatches, result.prefills) == ([], 0, 0, 0)
    assert not compiles
    with pytest.raises(ValueError, match=r"^max_new_tokens"):
        engine.generate([], 0)


def test_largest_seed_is_its_own_key(engine):
    """Seeds are 32-bit, not cast to int32: 2**31 and 2**32 - 1 give jax.random.key of themselves."""
    for seed in (2**31, 2**32 - 1):
        key = engine.init_state(seed).key
        np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(jax.random.key(seed)))


def test_the_edges_are_accepted(engine):
    """What the checks let through runs: the longest prompt of N = max_draft with the largest budget it
    leaves room for, as a numpy array; a bytes prompt; stop tokens as a numpy array; the largest seed; a
    numpy temperature."""
    budget = 3
    longest = np.arange(LONGEST_SPECULATIVE) % VOCAB
    result = engine.generate(
        [longest, b"\x01\x02"],
        budget,
        num_tokens=MAX_DRAFT,
        temperature=np.float32(0.5),
        stop_tokens=np.array([VOCAB - 1]),
        seed=2**32 - 1,
    )
    assert [1 <= len(tokens) <= budget for tokens in result.tokens] == [True, True]


def test_numpy_scalars_and_bytes_reach_the_device_as_checked(engine, monkeypatch):
    """prefill and decode take numpy ints and bools, bytes prompts and stop tokens; what they dispatch (the
    jitted functions replaced by recorders) is the int32 / bool operands and the static ints expected."""
    calls = {}
    monkeypatch.setattr(engine, "_prefill", lambda *args: calls.setdefault("prefill", args))
    monkeypatch.setattr(engine, "_decode", lambda *args: calls.setdefault("decode", args))
    state = engine.init_state()
    budget = np.int32(MAX_LEN - 4)  # the largest of plain steps leaves room for a prompt of 3
    engine.prefill(state, {np.int64(SLOTS - 1): b"\x01\x02\x03"}, budget, stop_tokens=(0, VOCAB - 1))
    _, _, tokens, starts, lengths, budgets, sampling, stops, chunk, start_bound = calls["prefill"]
    np.testing.assert_array_equal(tokens[SLOTS - 1, :4], [1, 2, 3, 0])
    np.testing.assert_array_equal(lengths, [0, 3])
    np.testing.assert_array_equal(budgets, [0, budget])  # the rows of no new request: 0
    np.testing.assert_array_equal(stops, [0, VOCAB - 1, *[-1] * (MAX_STOP_TOKENS - 2)])
    assert tokens.dtype == lengths.dtype == budgets.dtype == stops.dtype == np.int32
    np.testing.assert_array_equal(sampling.temperature, [0, 0])  # greedy, top-p and top-k off
    np.testing.assert_array_equal(sampling.top_p, [1, 1])
    np.testing.assert_array_equal(sampling.top_k, [0, 0])
    assert (
        sampling.temperature.dtype == sampling.top_p.dtype == np.float32 and sampling.top_k.dtype == np.int32
    )
    assert chunk is None and start_bound == 0 and not starts.any()  # CPU: no chunk; every prompt from 0
    engine.decode(state, num_tokens=np.int64(2), steps=np.int64(2), waiting=np.bool_(True), stop_tokens=b"\0")
    _, _, stops, waiting, steps, tree, context = calls["decode"]
    np.testing.assert_array_equal(stops, [0, *[-1] * (MAX_STOP_TOKENS - 1)])
    assert waiting and steps == 2 and type(steps) is int
    assert tree == Tree.chain(2) and context == MAX_LEN  # no context given: max_len's bucket
    calls.clear()
    engine.decode(state, context=np.int64(200))
    assert calls["decode"][-1] == 256 and type(calls["decode"][-1]) is int  # its bucket from 256


def test_a_vanishing_temperature_samples_the_greedy_tokens(engine):
    """At temperature 1e-10 or 1e-40 (accepted: any finite number > 0) sampling is greedy in float32, plain,
    speculative (N = 3) and on a tree: the greedy tokens, never a NaN's token 0 (softmax(logits / T) once
    overflowed under jit: plain sampling at 1e-40, speculative at 1e-10). tests/test_tree.py checks each
    of the sampling functions at both temperatures."""
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    greedy = engine.generate(prompts, 8).tokens
    for temperature, how in ((1e-40, {}), (1e-10, {"num_tokens": 3}), (1e-40, {"tree": Tree.default(4)})):
        got = engine.generate(prompts, 8, temperature=temperature, **how).tokens
        assert got == greedy, (temperature, how)
