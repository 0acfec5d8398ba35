"""``jax-oc128 serve`` live on 127.0.0.1 with the shipped model, through the official ``openai`` client and
plain HTTP: completions and chat, streamed and not, equal to ``Engine.generate``'s greedy tokens (plain and a
chain of 3); seeded sampling reproducible and equal to generate's; bad requests refused with 400 naming the
field and the engine untouched; a full server answers 503 and loses nothing; a load of 200 streamed requests
from 32 clients, a fifth leaving mid-stream, leaks no slot or page and /health answers throughout."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import httpx
import openai
import pytest
from serving import build, live, wait_idle

SLOTS, PAGES, MAX_QUEUED = 4, 12, 40
FLAGS = ("--slots", str(SLOTS), "--pages", str(PAGES), "--steps-per-dispatch", "8")
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


@pytest.fixture(scope="module")
def plain():
    """The plain server (paged caches) and the offline greedy tokens of :data:`PROMPTS` and of the same
    prompts as chat messages, from its own engine before it serves."""
    server = build(*FLAGS)
    tokenizer, engine = server.tokenizer, server.scheduler.engine
    chats = [tokenizer.encode(p, chat=True) for p in PROMPTS]
    expected = engine.generate([tokenizer.encode(p) for p in PROMPTS], NEW).tokens
    expected_chat = engine.generate(chats, NEW).tokens
    with live(server) as base:
        yield server, base, expected, expected_chat


def client(base: str, cls=openai.OpenAI):
    return cls(base_url=f"{base}/v1", api_key="none", timeout=120, max_retries=0)


def test_completions_and_chat_equal_generate(plain):
    """Completions and chat, streamed and not, give the text of generate's greedy tokens, with their usage."""
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
        chunks = api.completions.create(
            model="shipped", prompt=prompt, max_tokens=NEW, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in chunks) == decode(tokens)
        messages = [{"role": "user", "content": prompt}]
        done = api.chat.completions.create(model="shipped", messages=messages, max_tokens=NEW, temperature=0)
        assert done.choices[0].message.content == decode(chat_tokens)
        chunks = api.chat.completions.create(
            model="shipped", messages=messages, max_tokens=NEW, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == decode(chat_tokens)


def test_stop_strings_and_token_ids(plain):
    """A stop string cuts the text before it (finish_reason stop); a stop token id ends the request at it,
    kept, as generate's stop_tokens."""
    server, base, expected, _ = plain
    decode = server.tokenizer.decode
    api = client(base)
    text = decode(expected[0])
    stop = text[3:5]
    done = api.completions.create(
        model="shipped", prompt=PROMPTS[0], max_tokens=NEW, temperature=0, stop=stop
    )
    assert done.choices[0].text == text[: text.index(stop)] and done.choices[0].finish_reason == "stop"
    token = expected[0][4]
    prompt = server.tokenizer.encode(PROMPTS[0])
    offline = server.scheduler.engine.generate([prompt], NEW, stop_tokens=[token]).tokens[0]
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
    """A sampled request with a seed gives the same text twice, generate's at that seed (it runs alone)."""
    server, base, _, _ = plain
    api = client(base)
    texts = [
        api.completions.create(model="shipped", prompt=PROMPTS[1], max_tokens=NEW, temperature=0.8, seed=7)
        .choices[0]
        .text
        for _ in range(2)
    ]
    prompt = server.tokenizer.encode(PROMPTS[1])
    stops = server.tokenizer.eos_token_ids  # the server's own stop tokens
    offline = server.scheduler.engine.generate([prompt], NEW, temperature=0.8, seed=7, stop_tokens=stops)
    offline = offline.tokens[0]
    assert texts[0] == texts[1] == server.tokenizer.decode(offline)


BAD = [
    ("/v1/completions", '{"model": "shipped", "prompt": "x",', None),
    ("/v1/completions", {"model": "shipped", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": "shipped", "prompt": "x", "max_tokens": 1023}, "max_tokens"),
    ("/v1/completions", {"model": "shipped", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
    # a character of two bytes that no merge of the ASCII corpus joins: 1200 tokens
    ("/v1/completions", {"model": "shipped", "prompt": "\u00e9" * 600, "max_tokens": 8}, "prompt"),
    ("/v1/completions", {"model": "shipped", "prompt": [1, 2048]}, "prompt"),
    ("/v1/completions", {"model": "shipped", "prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"model": "shipped", "prompt": "x", "n": 2}, "n"),
    ("/v1/completions", {"model": "shipped", "prompt": "x", "top_p": 0.5}, "top_p"),
    ("/v1/completions", {"model": "shipped", "prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": "shipped", "prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids"),
    ("/v1/completions", {"model": "shipped", "prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"model": "other", "prompt": "x"}, "model"),
    ("/v1/completions", {"model": "shipped"}, "prompt"),
    ("/v1/chat/completions", {"model": "shipped", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "shipped", "messages": [{"role": "user"}], "seed": -1}, "seed"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD, ids=[f"{p}-{b}"[:60] for p, b, _ in BAD])
def test_bad_requests_are_400_naming_the_field(plain, path, body, param):
    """Each bad request: 400, an OpenAI error body naming the field, nothing queued or run."""
    _, base, _, _ = plain
    before = wait_idle(base)
    send = dict(content=body) if isinstance(body, str) else dict(json=body)
    response = httpx.post(f"{base}{path}", timeout=30, **send)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert param is None or error["message"].startswith(param), error
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
    page is free; /health answered within a second throughout."""
    server, base, expected, _ = plain
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


def test_speculative_server_gives_the_plain_greedy_text(plain):
    """A server speculating with a chain of 3 (dense caches) gives the plain engine's greedy text."""
    server, _, expected, _ = plain
    with live(build("--draft", "3", "--slots", "2", "--steps-per-dispatch", "8")) as base:
        api = client(base)
        for prompt, tokens in zip(PROMPTS[:3], expected[:3], strict=True):
            done = api.completions.create(model="shipped", prompt=prompt, max_tokens=NEW, temperature=0)
            assert done.choices[0].text == server.tokenizer.decode(tokens)


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
