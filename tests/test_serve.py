"""``jax-oc128 serve`` live on 127.0.0.1 with the shipped model, through the official ``openai`` client and
plain HTTP, one server (one engine process) for the module (speculating with a chain of 2, paged caches),
the offline references computed by ``Engine.generate`` in its engine process before it serves: completions
and chat, streamed (one event per step's tokens) and not, equal to ``Engine.generate``'s greedy tokens, and
on the offline C128 state (``--backend offline``: a server of its own) equal to them too; stop
strings and stop token ids with their usage; seeded sampling reproducible and equal to generate's; bad
requests refused with 400 naming the field and the engine untouched; a full server answers 503 and loses
nothing; a load of 200 streamed requests from 32 clients, a fifth leaving mid-stream, leaks no slot or page
and /health answers throughout."""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import random
import time

import httpx
import openai
import pytest
from serving import build, live, wait_idle

from jax_oc128.controller import OFFLINE
from jax_oc128.serve import cli

SLOTS, PAGES, MAX_QUEUED, K = 4, 12, 40, 8
FLAGS = ("--draft", "2", "--slots", str(SLOTS), "--pages", str(PAGES), "--steps-per-dispatch", str(K))
FLAGS += ("--max-queued", str(MAX_QUEUED), "--max-len", "1024")
PROMPTS = [
    "Return the number of items",
    "Open the file and",
    "Create a new thread",
    "This module provides access to",
    "Raise an exception if",
    "Return a new list containing",
]
NEW = 12  # max_tokens of the greedy requests
VOCAB = 1024  # the shipped text model's
#: seeded sampling (top_p, and vLLM's top_k), the request's and generate's
SAMPLED = dict(temperature=0.8, seed=7, top_p=0.9, top_k=20)
#: the references, generate's tokens (tests/serving.py's jobs): greedy, of PROMPTS and of the same prompts as
#: chat messages, and PROMPTS[1] sampled as SAMPLED
JOBS = [
    dict(prompts=PROMPTS, max_new_tokens=NEW),
    dict(prompts=PROMPTS, chat=True, max_new_tokens=NEW),
    dict(prompts=PROMPTS[1:2], max_new_tokens=NEW, **SAMPLED),
]


@pytest.fixture(scope="module")
def gate():
    """Holds the engine process's steps while clear (set: they run)."""
    gate = multiprocessing.get_context("spawn").Event()
    gate.set()
    return gate


@pytest.fixture(scope="module")
def plain(gate):
    """The server and the greedy tokens of :data:`PROMPTS` and of the same prompts as chat messages, from
    its own engine's ``generate`` before it serves, with its speculation (one compilation for both; the
    speculative greedy tokens are the plain ones: tests/test_decode.py), and the sampled tokens of
    :data:`SAMPLED`."""
    server = build(*FLAGS, gate=gate, jobs=JOBS)
    expected, expected_chat, sampled = server.engine.extra
    with live(server) as base:
        yield server, base, expected, expected_chat, sampled


def client(base: str, cls=openai.OpenAI):
    return cls(base_url=f"{base}/v1", api_key="none", timeout=120, max_retries=0)


def test_completions_and_chat_equal_generate(plain):
    """Completions and chat, streamed and not, give the text of generate's greedy tokens, with their usage;
    a stream sends a step's tokens as one event (at most one per dispatch of K steps, the prefill's first
    token one more), the last one with the finish reason."""
    server, base, expected, expected_chat, _ = plain
    decode = server.tokenizer.decode
    api = client(base)
    assert [m.id for m in api.models.list().data] == ["shipped"]
    for prompt, tokens, chat_tokens in zip(PROMPTS, expected, expected_chat, strict=True):
        done = api.completions.create(model="shipped", prompt=prompt, max_tokens=NEW, temperature=0)
        assert done.choices[0].text == decode(tokens)
        assert done.choices[0].finish_reason == "length"
        usage = (done.usage.prompt_tokens, done.usage.completion_tokens)
        assert usage == (len(server.tokenizer.encode(prompt)), NEW)
        assert done.usage.prompt_tokens_details.cached_tokens == 0  # no prefix cache
        chunks = list(
            api.completions.create(model="shipped", prompt=prompt, max_tokens=NEW, temperature=0, stream=True)
        )
        assert "".join(c.choices[0].text for c in chunks) == decode(tokens)
        assert all(c.choices[0].text for c in chunks) and len(chunks) <= 1 + math.ceil((NEW - 1) / K)
        assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
        messages = [{"role": "user", "content": prompt}]
        done = api.chat.completions.create(model="shipped", messages=messages, max_tokens=NEW, temperature=0)
        assert done.choices[0].message.content == decode(chat_tokens)
        chunks = api.chat.completions.create(
            model="shipped", messages=messages, max_tokens=NEW, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == decode(chat_tokens)


def test_the_offline_c128_state_serves_the_same_greedy_tokens(plain):
    """``--backend offline`` (the module's flags otherwise) builds the scheduler on the offline C128 state;
    that server gives, streamed and not, its own ``Engine.generate``'s greedy tokens, which are the online
    state's (the module's server's: the backends agree, tests/test_decode.py)."""
    _, _, expected, _, _ = plain
    flags = (*FLAGS, "--backend", "offline")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.scheduler(parser.parse_args(list(flags))).engine.model.target.backend is OFFLINE
    server = build(*flags, jobs=[dict(JOBS[0], prompts=PROMPTS[:2])])  # two prompts: cheap, enough
    (offline,) = server.engine.extra
    assert offline == expected[:2]
    decode = server.tokenizer.decode
    with live(server) as base:
        api = client(base)
        for prompt, tokens in zip(PROMPTS[:2], offline, strict=True):
            done = api.completions.create(model="shipped", prompt=prompt, max_tokens=NEW, temperature=0)
            assert done.choices[0].text == decode(tokens)
        chunks = api.completions.create(
            model="shipped", prompt=PROMPTS[0], max_tokens=NEW, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in chunks) == decode(offline[0])


def test_stop_strings_and_token_ids(plain):
    """A stop string cuts the text before it (finish_reason stop), streamed or not, the usage counting the
    tokens through the one that completes it; a stop token id ends the request at it, kept, as generate's
    stop_tokens (its greedy tokens through the first one: greedy tokens do not depend on where they stop)."""
    server, base, expected, _, _ = plain
    decode = server.tokenizer.decode
    api = client(base)
    text = decode(expected[0])
    for stop in (text[3:5], [text[7:10], text[5:7]]):
        first = min(text.index(s) for s in ([stop] if isinstance(stop, str) else stop))
        end = first + min(
            len(s) for s in ([stop] if isinstance(stop, str) else stop) if text.startswith(s, first)
        )
        # the usage counts the tokens up to the one that completes the stop string
        ends = next(t for t in range(1, len(expected[0]) + 1) if len(decode(expected[0][:t])) >= end)
        done = api.completions.create(
            model="shipped", prompt=PROMPTS[0], max_tokens=NEW, temperature=0, stop=stop
        )
        assert done.choices[0].text == text[:first] and done.choices[0].finish_reason == "stop"
        assert done.usage.completion_tokens == ends, (stop, done.usage)
        chunks = list(
            api.completions.create(
                model="shipped",
                prompt=PROMPTS[0],
                max_tokens=NEW,
                temperature=0,
                stop=stop,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks[:-1]) == text[:first]
        assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-1].usage.completion_tokens == ends
    token = expected[0][4]
    offline = expected[0][: expected[0].index(token) + 1]
    done = api.completions.create(
        model="shipped",
        prompt=PROMPTS[0],
        max_tokens=NEW,
        temperature=0,
        extra_body={"stop_token_ids": [token]},
    )
    assert done.choices[0].text == decode(offline) and done.choices[0].finish_reason == "stop"
    assert offline[-1] == token and len(offline) < NEW


def test_seeded_sampling_is_reproducible(plain):
    """A sampled request with a seed, top_p and top_k (vLLM's extension) gives the same text twice,
    generate's at that seed and with those parameters (it runs alone)."""
    server, base, _, _, sampled = plain
    api = client(base)
    options = dict(SAMPLED)
    top_k = options.pop("top_k")
    texts = [
        api.completions.create(
            model="shipped", prompt=PROMPTS[1], max_tokens=NEW, extra_body={"top_k": top_k}, **options
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert texts[0] == texts[1] == server.tokenizer.decode(sampled[0])


BAD = [
    ("/v1/completions", '{"model": "shipped", "prompt": "x",', None, "the request body is not JSON"),
    (
        "/v1/completions",
        {"model": "shipped", "prompt": "x", "max_tokens": 0},
        "max_tokens",
        "max_tokens: must be in [1, 1021 = max_len - N - 1], got 0",
    ),
    (
        "/v1/completions",
        {"model": "shipped", "prompt": "x", "max_tokens": 1023},
        "max_tokens",
        "max_tokens: must be in [1, 1021 = max_len - N - 1], got 1023",
    ),
    ("/v1/completions", {"model": "shipped", "prompt": "x", "max_tokens": "5"}, "max_tokens", None),
    (
        "/v1/completions",
        # a character of two bytes that no merge of the ASCII corpus joins: 1200 tokens and the BOS token
        {"model": "shipped", "prompt": "\u00e9" * 600, "max_tokens": 8},
        "prompt",
        "prompt: length 1201 must be in [1, 1014 = max_len - max_new_tokens - N]",
    ),
    (
        "/v1/completions",
        {"model": "shipped", "prompt": [1, VOCAB]},
        "prompt",
        f"prompt: token ids must be in [0, {VOCAB}), got {VOCAB}",
    ),
    (
        "/v1/completions",
        {"model": "shipped", "prompt": ["a", "b"]},
        "prompt",
        "prompt: one prompt per request",
    ),
    ("/v1/completions", {"model": "shipped", "prompt": "x", "n": 2}, "n", None),
    ("/v1/completions", {"model": "shipped", "prompt": "x", "top_p": 1.5}, "top_p", None),
    ("/v1/completions", {"model": "shipped", "prompt": "x", "top_p": 0}, "top_p", None),
    ("/v1/completions", {"model": "shipped", "prompt": "x", "top_k": -2}, "top_k", None),
    ("/v1/completions", {"model": "shipped", "prompt": "x", "temperature": -1}, "temperature", None),
    (
        "/v1/completions",
        {"model": "shipped", "prompt": "x", "stop_token_ids": [99999]},
        "stop_token_ids",
        f"stop_token_ids: ids must be in [0, {VOCAB}), got 99999",
    ),
    ("/v1/completions", {"model": "shipped", "prompt": "x", "stop": [""]}, "stop", None),
    ("/v1/completions", {"model": "other", "prompt": "x"}, "model", None),
    ("/v1/completions", {"model": "shipped"}, "prompt", None),
    ("/v1/chat/completions", {"model": "shipped", "messages": []}, "messages", None),
    ("/v1/chat/completions", {"model": "shipped", "messages": [{"role": "user"}], "seed": -1}, "seed", None),
    (
        "/v1/chat/completions",
        {"model": "shipped", "messages": [{"role": "user", "content": "\u00e9" * 600}], "max_tokens": 8},
        "messages",
        "messages: length 1216 must be in [1, 1014 = max_len - max_new_tokens - N]",  # with the template
    ),
]


@pytest.mark.parametrize(("path", "body", "param", "message"), BAD, ids=[f"{p}-{b}"[:60] for p, b, *_ in BAD])
def test_bad_requests_are_400_naming_the_field(plain, path, body, param, message):
    """Each bad request: 400, an OpenAI error body naming the field (the message starting with it; the
    scheduler's wording where it checks), nothing queued or run."""
    _, base, _, _, _ = plain
    before = wait_idle(base)
    send = dict(content=body) if isinstance(body, str) else dict(json=body)
    response = httpx.post(f"{base}{path}", timeout=30, **send)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert param is None or error["message"].startswith(f"{param}:"), error
    assert message is None or error["message"].startswith(message), error
    assert httpx.get(f"{base}/health").json() == before


def test_a_full_server_answers_503_and_loses_nothing(plain, gate):
    """With the engine process's steps held, the server takes slots + max_queued requests and refuses the
    next with 503; released, every request it took completes with generate's text."""
    server, base, expected, _, _ = plain
    gate.clear()
    capacity = SLOTS + MAX_QUEUED

    async def run():
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            body = {"model": "shipped", "max_tokens": NEW, "temperature": 0}
            taken = [
                asyncio.create_task(http.post("/v1/completions", json=body | {"prompt": PROMPTS[i % 6]}))
                for i in range(capacity)
            ]
            while (await http.get("/health")).json()["outstanding"] < capacity:
                await asyncio.sleep(0.05)
            refused = await http.post("/v1/completions", json=body | {"prompt": "x"})
            gate.set()
            return refused, await asyncio.gather(*taken)

    try:
        refused, taken = asyncio.run(run())
    finally:
        gate.set()
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_busy"
    decode = server.tokenizer.decode
    assert [r.json()["choices"][0]["text"] for r in taken] == [
        decode(expected[i % 6]) for i in range(capacity)
    ]


def test_load_with_disconnects_leaks_nothing(plain):
    """200 streamed requests from 32 concurrent clients, a random fifth leaving after their first chunk:
    each completed one is generate's text, the others are aborted; afterwards no request is held, no slot
    runs and every page is free (the engine process's counts); /health answered within a second
    throughout."""
    server, base, expected, _, _ = plain
    decode = server.tokenizer.decode
    rng = random.Random(0)
    leave = set(rng.sample(range(200), 40))
    health_times = []

    async def run():
        api = client(base, openai.AsyncOpenAI)
        jobs = asyncio.Queue()
        for i in range(200):
            jobs.put_nowait(i)
        results = {}

        async def one_client():
            while not jobs.empty():
                i = jobs.get_nowait()
                n = 64 if i in leave else NEW
                stream = await api.completions.create(
                    model="shipped", prompt=PROMPTS[i % 6], max_tokens=n, temperature=0, stream=True
                )
                pieces = []
                async for chunk in stream:
                    pieces.append(chunk.choices[0].text)
                    if i in leave:
                        await stream.close()
                        break
                results[i] = "".join(pieces)

        async def watch(done: asyncio.Event):
            async with httpx.AsyncClient(base_url=base, timeout=10) as http:
                while not done.is_set():
                    start = time.monotonic()
                    assert (await http.get("/health")).status_code == 200
                    health_times.append(time.monotonic() - start)
                    await asyncio.sleep(0.1)

        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        await asyncio.gather(*(one_client() for _ in range(32)))
        done.set()
        await watcher
        return results

    results = asyncio.run(run())
    for i in range(200):
        if i not in leave:
            assert results[i] == decode(expected[i % 6]), i
    health = wait_idle(base)
    assert health["free_pages"] == PAGES and health["running"] == health["waiting"] == 0
    assert health["finished"]["abort"] >= 1, health  # some left while their request ran
    assert max(health_times) < 1.0, max(health_times)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-len", "5000"], "argument --max-len: at most the model's max_position_embeddings (4096)"),
        (["--draft", "17"], "argument --draft: at most 16"),
        (["--tree", "17"], "argument --tree: at most 16"),
        (
            ["--pages", "4", "--page-size", "200"],
            "argument --page-size: page_size: must be a multiple of 128",
        ),
        (["--slots", "0"], "argument --slots: must be >= 1, got 0"),
        (["--admission-wait", "-1"], "argument --admission-wait: must be >= 0, got -1"),
        (["--draft", "2", "--tree", "3"], "argument --tree: not allowed with argument --draft"),
        (
            ["--backend", "offline", "--tree", "2"],
            "argument --tree: tree speculation runs on the online C128 state only (--backend online)",
        ),
        (["--backend", "gpu"], "argument --backend: invalid choice: 'gpu'"),
    ],
)
def test_serve_flags_are_checked(flags, message, capsys):
    """A bad flag of ``serve`` is argparse's error naming it, before the server starts."""
    with pytest.raises(SystemExit):
        build(*flags)
    assert message in capsys.readouterr().err
