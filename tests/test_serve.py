"""``jax-oc128 serve`` live on 127.0.0.1 with the shipped model, through the official ``openai`` client and
plain HTTP, one server for the module (speculating with a chain of 2, paged caches): completions and chat,
streamed (one event per step's tokens) and not, equal to ``Engine.generate``'s greedy tokens; stop strings and
stop token ids with their usage; seeded sampling reproducible and equal to generate's; bad requests refused
with 400 naming the field and the engine untouched; a full server answers 503 and loses nothing; a load of
200 streamed requests from 32 clients, a fifth leaving mid-stream, leaks no slot or page and /health answers
throughout."""

from __future__ import annotations

import asyncio
import math
import random
import sys
import threading
import time

import httpx
import openai
import pytest
from serving import build, live, wait_idle

from jax_oc128.serve.app import SWITCH_INTERVAL

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


@pytest.fixture(scope="module")
def plain():
    """The server and the greedy tokens of :data:`PROMPTS` and of the same prompts as chat messages, from
    its own engine's ``generate`` before it serves, with its speculation (one compilation for both; the
    speculative greedy tokens are the plain ones: tests/test_decode.py)."""
    server = build(*FLAGS)
    tokenizer, engine = server.tokenizer, server.scheduler.engine
    chats = [tokenizer.encode(p, chat=True) for p in PROMPTS]
    tree = server.scheduler.tree
    expected = engine.generate([tokenizer.encode(p) for p in PROMPTS], NEW, tree=tree).tokens
    expected_chat = engine.generate(chats, NEW, tree=tree).tokens
    with live(server) as base:
        yield server, base, expected, expected_chat


def client(base: str, cls=openai.OpenAI):
    return cls(base_url=f"{base}/v1", api_key="none", timeout=120, max_retries=0)


def test_completions_and_chat_equal_generate(plain):
    """Completions and chat, streamed and not, give the text of generate's greedy tokens, with their usage;
    a stream sends a step's tokens as one event (at most one per dispatch of K steps, the prefill's first
    token one more), the last one with the finish reason."""
    server, base, expected, expected_chat = plain
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


def test_stop_strings_and_token_ids(plain):
    """A stop string cuts the text before it (finish_reason stop), streamed or not, the usage counting the
    tokens through the one that completes it; a stop token id ends the request at it, kept, as generate's
    stop_tokens."""
    server, base, expected, _ = plain
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
    engine, tree = server.scheduler.engine, server.scheduler.tree
    prompt = server.tokenizer.encode(PROMPTS[0])
    offline = engine.generate([prompt], NEW, stop_tokens=[token], tree=tree).tokens[0]
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
    server, base, _, _ = plain
    api = client(base)
    texts = [
        api.completions.create(
            model="shipped",
            prompt=PROMPTS[1],
            max_tokens=NEW,
            temperature=0.8,
            seed=7,
            top_p=0.9,
            extra_body={"top_k": 20},
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    prompt = server.tokenizer.encode(PROMPTS[1])
    stops = server.tokenizer.eos_token_ids  # the server's own stop tokens
    sampled = dict(temperature=0.8, seed=7, top_p=0.9, top_k=20, stop_tokens=stops)
    sampled["tree"] = server.scheduler.tree
    offline = server.scheduler.engine.generate([prompt], NEW, **sampled).tokens[0]
    assert texts[0] == texts[1] == server.tokenizer.decode(offline)


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
    _, base, _, _ = plain
    before = wait_idle(base)
    send = dict(content=body) if isinstance(body, str) else dict(json=body)
    response = httpx.post(f"{base}{path}", timeout=30, **send)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert param is None or error["message"].startswith(f"{param}:"), error
    assert message is None or error["message"].startswith(message), error
    assert httpx.get(f"{base}/health").json() == before


def test_a_full_server_answers_503_and_loses_nothing(plain):
    """With the device loop held, the server takes slots + max_queued requests and refuses the next with
    503; released, every request it took completes with generate's text."""
    server, base, expected, _ = plain
    gate, step = threading.Event(), server.scheduler.step
    server.scheduler.step = lambda: (gate.wait(120), step())[1]
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
        server.scheduler.step = step
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_busy"
    decode = server.tokenizer.decode
    assert [r.json()["choices"][0]["text"] for r in taken] == [
        decode(expected[i % 6]) for i in range(capacity)
    ]


def test_load_with_disconnects_leaks_nothing(plain):
    """200 streamed requests from 32 concurrent clients, a random fifth leaving after their first chunk:
    each completed one is generate's text, the others are aborted; afterwards no request is held and every
    page is free; /health answered within a second throughout, the GIL handed between the threads at the
    server's switch interval."""
    server, base, expected, _ = plain
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL)
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
    assert health["free_pages"] == PAGES and not server.scheduler.owner
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
        (["--draft", "2", "--tree", "3"], "argument --tree: not allowed with argument --draft"),
    ],
)
def test_serve_flags_are_checked(flags, message, capsys):
    """A bad flag of ``serve`` is argparse's error naming it, before the server starts."""
    with pytest.raises(SystemExit):
        build(*flags)
    assert message in capsys.readouterr().err
