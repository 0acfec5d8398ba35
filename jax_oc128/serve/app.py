"""The FastAPI application: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` (both streamed as
server-sent events or not), ``/v1/models`` and ``/health`` over an
:class:`~jax_oc128.serve.engine_process.EngineProcess`.

Each request is checked here, on the HTTP side (by the scheduler's checks with the engine process's
limits, OpenAI's names in the errors, the engine untouched), then sent to the engine process; its tokens
come back in one message per step for all requests, and all a request got since its last event go out as
one event. Stop strings are matched on the decoded text here (``generate_command.StopStrings``: the text
held back while it could still begin one); a client that disconnects aborts its request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from jax_oc128.checks import NamedError
from jax_oc128.engine import MAX_STOP_TOKENS
from jax_oc128.engine.requests import SamplingParams
from jax_oc128.generate_command import StopStrings
from jax_oc128.serve.engine_process import EngineFailed, EngineProcess, Handle, QueueFull
from jax_oc128.serve.protocol import ChatRequest, CompletionRequest, RequestError, parse

#: the scheduler's argument names (``checks.NamedError.argument``) as the OpenAI API names them; the prompt's
#: is the request's field (``prompt`` or ``messages``)
_FIELDS = {
    "max_new_tokens": "max_tokens",
    "stop_tokens": "stop_token_ids",
    "temperature": "temperature",
    "seed": "seed",
}
#: OpenAI's default temperature
DEFAULT_TEMPERATURE = 1.0
#: how often a non-streamed request checks that its client is still there, in seconds
DISCONNECT_POLL = 0.25


class Server:
    """What the endpoints share: the :class:`EngineProcess` (running), the tokenizer and the served model's
    name; the longest request is the model's ``max_len`` tokens (prompt + max_tokens + N)."""

    def __init__(self, engine: EngineProcess, tokenizer, model_name: str):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name

    def request(self, body, prompt, prompt_field: str, max_tokens) -> tuple[list[int], SamplingParams]:
        """A parsed request's prompt ids and parameters, checked by the scheduler's checks
        (:meth:`RequestLimits.check` of the engine process's limits: a RequestError naming the field;
        ``max_tokens`` None: the rest of ``max_len``)."""
        limits = self.engine.limits
        if body.model != self.model_name:
            raise RequestError(f"model: this server serves {self.model_name!r}, got {body.model!r}", "model")
        if max_tokens is None:
            max_tokens = max(1, limits.max_len - len(prompt) - limits.width)
        eos = () if body.ignore_eos else self.tokenizer.eos_token_ids
        stop_ids = list(dict.fromkeys([*(body.stop_token_ids or []), *eos]))
        if len(stop_ids) > MAX_STOP_TOKENS:
            raise RequestError(
                f"stop_token_ids: at most {MAX_STOP_TOKENS} with the EOS tokens, got {len(stop_ids)}",
                "stop_token_ids",
            )
        temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
        top_k = None if body.top_k == -1 else body.top_k
        params = SamplingParams(max_tokens, temperature, tuple(stop_ids), body.seed, body.top_p, top_k)
        try:
            ids, _ = limits.check(prompt, params, prompt_field)
        except NamedError as error:
            field = _FIELDS.get(error.argument, error.argument)
            raise RequestError(f"{field}{str(error)[len(error.argument) :]}", field) from None
        return ids.tolist(), params


def stop_strings(body) -> list[str]:
    """The request's ``stop`` as a list of non-empty strings."""
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not stop for stop in stops):
        raise RequestError("stop: the strings must not be empty", "stop")
    return stops


class Run:
    """One request on the HTTP side: submitted to the engine process, its text as it arrives
    (:meth:`pieces`)."""

    def __init__(self, server: Server, prompt: list[int], params: SamplingParams, stops: list[str]):
        self.server, self.stops = server, stops
        self._tokens: list[int] = []  # received, not yet taken by pieces
        self._finished: str | None = None
        self._arrived = asyncio.Event()
        self.handle = Handle(prompt, params, self._receive)
        self.prompt_tokens, self.completion_tokens = len(prompt), 0
        self.done = False
        try:
            server.engine.submit(self.handle)
        except QueueFull as error:
            raise RequestError(str(error), None, 503, "server_busy") from None
        except EngineFailed as error:
            raise RequestError(str(error), None, 503, "server_failed") from None

    def _receive(self, tokens: list[int], finished: str | None) -> None:
        """The engine process's news (on the event loop): kept until :meth:`pieces` takes it."""
        self._tokens += tokens
        self._finished = finished
        self._arrived.set()

    async def pieces(self):
        """Yield ``(text, finish_reason)``: the text of all the tokens arrived since the last piece (those of
        one step or more), ``finish_reason`` None until the last piece (``"stop"`` or ``"length"``); the
        text is cut before the first stop string, exactly, and ``completion_tokens`` counts the tokens up to
        the one that completes it."""
        text, cut = self.server.tokenizer.decode_stream(), StopStrings(self.stops)
        tokens: list[int] = []  # all of them and their text, for a stop string's count
        decoded, emitted = [], 0
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            new, self._tokens, finished = self._tokens, [], self._finished
            tokens += new
            decoded.append(text.push(new) + (text.finish() if finished else ""))
            piece = cut.finish(decoded[-1]) if finished else cut.push(decoded[-1])
            emitted += len(piece)
            if cut.stopped:
                self.done = True
                if not finished:
                    self.server.engine.abort(self.handle)
                whole = "".join(decoded)  # a stop string begins at emitted: where the first one ends
                end = emitted + min(len(stop) for stop in self.stops if whole.startswith(stop, emitted))
                self.completion_tokens = self._through(tokens, end)
                yield piece, "stop"
                return
            self.completion_tokens = len(tokens)
            if finished:
                self.done = True
                yield piece, finished
                return
            if piece:
                yield piece, None

    def _through(self, tokens: list[int], length: int) -> int:
        """How many of ``tokens`` decode to the first ``length`` characters (a stop string's end)."""
        text, decoded = self.server.tokenizer.decode_stream(), 0
        for count, token in enumerate(tokens, 1):
            decoded += len(text.push([token]))
            if decoded >= length:
                return count
        return len(tokens)

    def abort(self) -> None:
        if not self.done:
            self.done = True
            self.server.engine.abort(self.handle)

    def usage(self) -> dict:
        total = self.prompt_tokens + self.completion_tokens
        return dict(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=total,
            prompt_tokens_details=dict(cached_tokens=self.handle.cached),
        )


def create_app(server: Server) -> FastAPI:
    """The application over ``server``; its engine process's news is read on the application's event loop
    while it runs (its lifespan), and the engine process is stopped when it ends."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.engine.attach(asyncio.get_running_loop())
        try:
            yield
        finally:
            server.engine.close()

    app = FastAPI(title="jax_oc128", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(RequestError)
    async def request_error(request, error: RequestError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.get("/health")
    async def health():
        engine = server.engine
        body = dict(
            status="ok" if engine.alive else "failed",
            outstanding=engine.outstanding,
            finished=dict(engine.finished),
            free_pages=engine.stats["free_pages"],
            running=engine.stats["running"],
            waiting=engine.stats["waiting"],
        )
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/v1/models")
    async def models():
        model = dict(id=server.model_name, object="model", created=0, owned_by="jax_oc128")
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse(CompletionRequest, await _json(request))
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise RequestError("prompt: one prompt per request", "prompt")
            prompt = prompt[0]
        ids = server.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        ids, params = server.request(body, ids, "prompt", body.max_tokens)
        return await _respond(request, server, body, Run(server, ids, params, stop_strings(body)), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = parse(ChatRequest, await _json(request))
        messages = [dict(role=m.role, content=m.text()) for m in body.messages]
        try:
            text = server.tokenizer.apply_chat_template(messages)
        except ValueError as error:
            raise RequestError(f"messages: {error}", "messages") from None
        ids = server.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        ids, params = server.request(body, ids, "messages", max_tokens)
        return await _respond(request, server, body, Run(server, ids, params, stop_strings(body)), chat=True)

    return app


async def _json(request: Request):
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the request body is not JSON ({error})", None) from None


def _chunk(kind: str, run_id: str, model: str, text, finish, chat: bool, first=False) -> dict:
    if chat:
        delta = {} if text is None else {"content": text}
        if first:
            delta = {"role": "assistant", "content": ""}
        choice = dict(index=0, delta=delta, logprobs=None, finish_reason=finish)
    else:
        choice = dict(index=0, text=text or "", logprobs=None, finish_reason=finish)
    return dict(id=run_id, object=kind, created=int(time.time()), model=model, choices=[choice])


async def _respond(request: Request, server: Server, body, run: Run, chat: bool):
    """The response to ``body`` of ``run``: streamed (server-sent events, ending ``[DONE]``) or whole."""
    run_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    model = server.model_name
    if body.stream:
        kind = "chat.completion.chunk" if chat else "text_completion"
        usage = body.stream_options is not None and body.stream_options.include_usage

        async def events():
            try:
                if chat:
                    yield json.dumps(_chunk(kind, run_id, model, None, None, chat, first=True))
                async for text, finish in run.pieces():  # one event: the text, the end with the last
                    yield json.dumps(_chunk(kind, run_id, model, text or None, finish, chat))
                if usage:
                    last = _chunk(kind, run_id, model, None, None, chat) | {
                        "choices": [],
                        "usage": run.usage(),
                    }
                    yield json.dumps(last)
                yield "[DONE]"
            finally:  # the client gone: the generator is closed early
                run.abort()

        return EventSourceResponse(events(), ping=15)

    async def collect():
        pieces, reason = [], None
        async for text, finish in run.pieces():
            pieces.append(text)
            reason = finish
        return "".join(pieces), reason

    task = asyncio.ensure_future(collect())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                return JSONResponse({}, status_code=499)  # nobody reads it
    finally:
        run.abort()
    text, reason = task.result()
    if chat:
        choice = dict(
            index=0, message=dict(role="assistant", content=text), logprobs=None, finish_reason=reason
        )
    else:
        choice = dict(index=0, text=text, logprobs=None, finish_reason=reason)
    kind = "chat.completion" if chat else "text_completion"
    return dict(
        id=run_id, object=kind, created=int(time.time()), model=model, choices=[choice], usage=run.usage()
    )
