"""``jax-oc128 generate`` (:func:`run`): text from a Hugging Face checkpoint and its tokenizer (default: the
shipped text model, :data:`~jax_oc128.text.SHIPPED_MODEL`), for one
prompt (``--prompt``, streamed to stdout) or several (``--prompts-file``, JSONL in and out), plainly or with
speculation, on one device or a mesh (``--mesh``), cut at ``--stop`` strings on the host."""

from __future__ import annotations

import json
import pathlib
import sys
import time

from jax_oc128.checks import check_backend

#: the largest --prompts-file read, in bytes
MAX_PROMPTS_BYTES = 64 << 20
#: slots by default at most (several prompts: the rest wait for a free slot)
MAX_DEFAULT_SLOTS = 8


class _GenerateDisplay:
    """What ``generate`` shows on stderr where it is a terminal (nothing elsewhere): a spinner while the
    checkpoint loads and the first token is computed; then, where stdout is not that terminal, a bar of the
    tokens generated (the text is the display where it is). Transient: gone when it stops."""

    def __init__(self, total: int):
        from rich.console import Console

        self.console = Console(stderr=True)
        self.on = self.console.is_terminal
        self.bar = self.on and not sys.stdout.isatty()
        self.total = total
        self.status = self.console.status("") if self.on else None
        self.progress = None

    def phase(self, text: str) -> None:
        if self.status is not None:
            self.status.update(text)
            self.status.start()

    def tokens(self, done: int) -> None:
        """``done`` tokens generated: the spinner ends (before the first text is written), the bar moves."""
        if self.status is not None:
            self.status.stop()
            self.status = None
        if self.bar and self.progress is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.progress = Progress(
                TextColumn("generating"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("tokens"),
                console=self.console,
                auto_refresh=False,  # no refresh thread: the engine's dispatch loop keeps the interpreter
                transient=True,
                redirect_stdout=False,  # the text goes to stdout, not above the bar
                redirect_stderr=False,
            )
            self.progress.start()
            self.task = self.progress.add_task("", total=self.total)
        if self.progress is not None:
            self.progress.update(self.task, completed=done, refresh=True)

    def stop(self) -> None:
        for display in (self.status, self.progress):
            if display is not None:
                display.stop()


def check_request(
    parser, path, tokenizer, prompts, new: int, n: int, *, max_len=None, kv_cache_dtype="auto", flags=None
) -> int:
    """The caches' length for ``prompts`` (token ids of ``tokenizer``), ``new`` tokens each and a verify's
    ``n`` on the checkpoint directory ``path``: ``max_len``, else the longest prompt, ``new`` and ``n`` in
    whole 128-token blocks (as the prefill pads; one length for many prompts, fewer compilations), at most
    the model's positions (``max_position_embeddings``). Refused by ``parser`` from the config alone, before
    the checkpoint loads, naming the flag (``flags``: those of ``"path"``, ``"new"`` and ``"prompt"``,
    default ``generate``'s; ``max_len`` is ``--max-len``): a config that does not read, a token of the
    prompts or an EOS id of ``tokenizer`` outside the model's vocabulary, ``max_len`` past the positions, a
    request that does not fit, ``kv_cache_dtype`` where the config does not take it."""
    from jax_oc128.loading.hf_config import read_config
    from jax_oc128.nn import RuntimeConfig
    from jax_oc128.pretrained import CONFIG

    flags = {"path": "path", "new": "--max-new-tokens", "prompt": "--prompt"} | (flags or {})
    try:
        config, runtime = read_config(pathlib.Path(path) / CONFIG)[:2]
    except (OSError, ValueError, NotImplementedError) as error:
        parser.error(f"argument {flags['path']}: {error}")
    vocab = config.vocab_size
    for name, ids in ((flags["prompt"], [max(p) for p in prompts]), (flags["path"], tokenizer.eos_token_ids)):
        if ids and max(ids) >= vocab:
            parser.error(
                f"argument {name}: token {max(ids)} of the tokenizer is not in the model's vocabulary "
                f"[0, {vocab})"
            )
    positions = runtime.max_len  # max_position_embeddings
    if max_len is not None and max_len > positions:
        parser.error(f"argument --max-len: at most the model's max_position_embeddings ({positions})")
    limit, what = (max_len, "--max-len") if max_len else (positions, "max_position_embeddings")
    prompt = max(map(len, prompts))
    need = prompt + new + n
    if need > limit:
        parser.error(
            f"argument {flags['new']}: the (longest) prompt's {prompt} tokens + {new} new tokens + N ({n}) "
            f"are {need} positions, more than the {limit} of {what}"
        )
    length = min(max_len or -(-need // 128) * 128, positions)
    if kv_cache_dtype != "auto":  # the config reads with the defaults: its fault is the flag's
        try:
            config.check_runtime(RuntimeConfig(length, n, kv_cache_dtype))
        except (TypeError, ValueError) as error:
            parser.error(f"argument --kv-cache-dtype: {error}")
    return length


class StopStrings:
    """Text cut before the first of ``stops`` (strings), exactly, as it arrives: :meth:`push` gives what can
    be written (all but the last ``len(longest stop) - 1`` characters, which a stop string may begin),
    :meth:`finish` the rest; the pieces joined are the text up to the first stop string, which they never
    contain. ``stopped``: whether one was found."""

    def __init__(self, stops):
        self.stops = tuple(stops)
        self.keep = max(map(len, self.stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        self.pending += text
        found = [i for i in (self.pending.find(stop) for stop in self.stops) if i >= 0]
        if found:
            self.stopped = True
            out, self.pending = self.pending[: min(found)], ""
            return out
        cut = max(0, len(self.pending) - self.keep)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def finish(self, text: str = "") -> str:
        out = self.push(text)
        out, self.pending = out + self.pending, ""
        return out


def _read_prompts(parser, args) -> list[dict]:
    """The requests: ``--prompt`` as one, or the lines of ``--prompts-file`` (``-``: stdin), each a JSON
    string or an object with a string ``"prompt"`` (and any ``"id"``, echoed back); blank lines skipped."""
    from jax_oc128.text import check_text

    if args.prompts_file is None:
        return [{"prompt": args.prompt}]
    name = "stdin" if args.prompts_file == "-" else args.prompts_file

    def refuse(message):
        parser.error(f"argument --prompts-file: {name}: {message}")

    try:
        if args.prompts_file == "-":
            raw = sys.stdin.buffer.read(MAX_PROMPTS_BYTES + 1)
        else:
            with open(args.prompts_file, "rb") as file:
                raw = file.read(MAX_PROMPTS_BYTES + 1)
    except OSError as error:
        refuse(error.strerror or str(error))
    if len(raw) > MAX_PROMPTS_BYTES:
        refuse(f"more than {MAX_PROMPTS_BYTES} bytes")
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError as error:
        refuse(f"not UTF-8 ({error.reason} at byte {error.start})")
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            request = json.loads(line)
        except (ValueError, RecursionError) as error:
            refuse(f"line {number}: not JSON ({error})")
        request = {"prompt": request} if isinstance(request, str) else request
        if (
            not isinstance(request, dict)
            or not isinstance(request.get("prompt"), str)
            or not request["prompt"]
        ):
            refuse(f'line {number}: must be a non-empty JSON string or an object with a "prompt" string')
        try:
            check_text("prompt", request["prompt"])
        except ValueError as error:
            refuse(f"line {number}: {error}")
        requests.append({key: request[key] for key in ("id", "prompt") if key in request})
    if not requests:
        refuse("no prompt")
    return requests


def _mesh(parser, text):
    """``--mesh data=D,model=M`` as a mesh (:func:`jax_oc128.nn.sharding.make_mesh`), or None."""
    from jax_oc128.nn import sharding

    if text is None:
        return None
    sizes = {}
    for part in text.split(","):
        axis, _, size = part.partition("=")
        if axis not in ("data", "model") or axis in sizes or not size.isdigit() or int(size) < 1:
            parser.error(
                f"argument --mesh: must be data=D,model=M (ints >= 1, either may be left out), got {text!r}"
            )
        sizes[axis] = int(size)
    try:
        return sharding.make_mesh(sizes.get("data", 1), sizes.get("model", 1))
    except ValueError as error:
        parser.error(f"argument --mesh: {error}")


def run(parser, args) -> int:
    """``generate``: every flag checked (argparse's error, status 2) before the model runs: what the
    tokenizer tells before the checkpoint loads, what the model tells (its MTP layer, its vocabulary)
    once loaded."""
    from jax_oc128.text import SHIPPED_MODEL

    check_backend(parser, args.backend, args.tree is not None)
    if args.path is None:
        args.path = str(SHIPPED_MODEL)
    tokenizer = checked_tokenizer(parser, args.path, "path")
    requests = _read_prompts(parser, args)
    flag = "--prompt" if args.prompts_file is None else "--prompts-file"
    texts, numbered = [request["prompt"] for request in requests], args.prompts_file is not None
    prompts = encode_prompts(parser, tokenizer, texts, flag, chat=args.chat, numbered=numbered)
    n = args.draft or args.tree or 1
    max_len = check_request(
        parser,
        args.path,
        tokenizer,
        prompts,
        args.max_new_tokens,
        n,
        max_len=args.max_len,
        kv_cache_dtype=args.kv_cache_dtype,
        flags={"prompt": flag},
    )
    mesh = _mesh(parser, args.mesh)
    data = 1 if mesh is None else mesh.shape["data"]
    slots = args.slots or min(len(prompts), MAX_DEFAULT_SLOTS)
    slots = -(-slots // data) * data
    display = _GenerateDisplay(args.max_new_tokens * len(prompts))
    try:
        model = _load(parser, args, max_len, n, mesh, display)
        display.phase(f"compiling, then the prefill of {sum(map(len, prompts))} prompt tokens")
        engine = _engine(args, model, slots, mesh)
        if args.prompts_file is None:
            return _stream(args, tokenizer, engine, prompts[0], display)
        return _many(args, tokenizer, engine, requests, prompts, display)
    finally:
        display.stop()


def checked_tokenizer(parser, path, flag: str):
    """The tokenizer of the checkpoint directory ``path`` (:func:`~jax_oc128.text.load_tokenizer`), refused
    by ``parser`` naming ``flag`` where it does not load or has more EOS ids than a generation stops at."""
    from jax_oc128.engine import MAX_STOP_TOKENS
    from jax_oc128.text import load_tokenizer

    try:
        tokenizer = load_tokenizer(path)
    except ValueError as error:
        parser.error(f"argument {flag}: {error}")
    if len(tokenizer.eos_token_ids) > MAX_STOP_TOKENS:
        ids = tokenizer.eos_token_ids
        parser.error(f"argument {flag}: at most {MAX_STOP_TOKENS} EOS tokens, the tokenizer has {len(ids)}")
    return tokenizer


def encode_prompts(parser, tokenizer, texts, flag: str, *, chat=False, numbered=False) -> list[list[int]]:
    """The token ids of each prompt of ``texts`` (:meth:`~jax_oc128.text.TextTokenizer.encode`), refused by
    ``parser`` naming ``flag`` (``--chat`` for the chat template's fault; ``numbered``: each prompt's
    number in the message) for text the tokenizer cannot encode or that is no tokens."""
    prompts = []
    for i, text in enumerate(texts):
        where = f"prompt {i + 1}: " if numbered else ""
        try:
            prompts.append(tokenizer.encode(text, chat=chat))
        except ValueError as error:  # the chat template's, or the tokenizer's
            parser.error(f"argument {'--chat' if str(error).startswith('chat:') else flag}: {where}{error}")
        if not prompts[-1]:
            parser.error(f"argument {flag}: {where}{text!r} is no tokens")
    return prompts


def load_checked(refuse, path, n: int, flags: dict, **options):
    """``load_pretrained(path, max_draft=n, **options)``; ``refuse(message)`` (which does not return) names
    the flag of ``flags`` (``"path"``, ``"draft"``) for a checkpoint that does not load and for one without
    an MTP layer where ``n`` > 1."""
    from jax_oc128.pretrained import load_pretrained

    try:
        model = load_pretrained(path, max_draft=n, **options)
    except (OSError, ValueError, NotImplementedError) as error:
        refuse(f"argument {flags['path']}: {error}")
    if n > 1 and model.mtp is None:
        refuse(f"argument {flags['draft']}: {path} has no MTP layer (plain only)")
    return model


def _load(parser, args, max_len, n, mesh, display):
    """The checkpoint's model, checked against the flags (:func:`load_checked`)."""
    from jax_oc128.controller import BACKENDS

    def refuse(message):
        display.stop()  # before argparse prints
        parser.error(message)

    display.phase(f"loading {args.path}")
    flags = {"path": "path", "draft": "--draft" if args.draft else "--tree"}
    options = dict(dtype=args.dtype, max_len=max_len, kv_cache_dtype=args.kv_cache_dtype, mesh=mesh)
    options["backend"] = BACKENDS[args.backend]
    return load_checked(refuse, args.path, n, flags, **options)


def _engine(args, model, slots, mesh):
    from jax_oc128.engine import Engine

    return Engine(
        model,
        slots=slots,
        steps_per_dispatch=min(args.steps_per_dispatch, args.max_new_tokens),
        prefill_chunk=args.prefill_chunk,
        mesh=mesh,
    )


def _options(args, tokenizer) -> dict:
    """``Engine.generate``'s options from the flags."""
    from jax_oc128.tree import Tree

    return dict(
        num_tokens=args.draft,
        tree=None if args.tree is None else Tree.default(args.tree),
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop_tokens=tokenizer.eos_token_ids,
        seed=args.seed,
    )


def _stream(args, tokenizer, engine, prompt: list[int], display) -> int:
    """One prompt: its text written to stdout as the tokens arrive (cut before a ``--stop`` string), a
    newline at the end, and one line of report on stderr."""
    text, cut = tokenizer.decode_stream(), StopStrings(args.stop)
    arrivals = []  # (seconds since the start, tokens generated so far)
    start = time.perf_counter()

    def stream(request, tokens):
        arrivals.append((time.perf_counter() - start, (arrivals[-1][1] if arrivals else 0) + len(tokens)))
        display.tokens(arrivals[-1][1])
        sys.stdout.write(cut.push(text.push(tokens)))
        sys.stdout.flush()

    result = engine.generate([prompt], args.max_new_tokens, stream=stream, **_options(args, tokenizer))
    display.stop()
    print(cut.finish(text.finish()), flush=True)
    (first, first_count), (last, count) = arrivals[0], arrivals[-1]
    line = f"{count} tokens in {result.seconds:.2f} s: the first after {first:.2f} s (compilation included)"
    if count > first_count:
        line += f", then {(count - first_count) / (last - first):.1f} tokens/s"
    print(f"{line}; mean accepted length {result.mean_accepted:.2f}", file=sys.stderr, flush=True)
    return 0


def _many(args, tokenizer, engine, requests, prompts, display) -> int:
    """Several prompts: one JSON object per request on stdout, in their order, once all are done: its
    ``index`` (from 0) and ``id`` (if given), ``text`` (cut before a ``--stop`` string), ``prompt_tokens``,
    ``tokens`` (generated), ``finish_reason`` (``"stop"``: EOS or a stop string; ``"length"``:
    ``--max-new-tokens``), ``first_token_seconds`` and ``seconds`` (since the call began, compilation
    included), ``tokens_per_step`` (its mean accepted length); a report line on stderr."""
    first, last = {}, {}
    start = time.perf_counter()
    done = [0]

    def stream(request, tokens):
        now = time.perf_counter() - start
        first.setdefault(request, now)
        last[request] = now
        done[0] += len(tokens)
        display.tokens(done[0])

    result = engine.generate(prompts, args.max_new_tokens, stream=stream, **_options(args, tokenizer))
    display.stop()
    eos = set(tokenizer.eos_token_ids)
    for i, (request, tokens) in enumerate(zip(requests, result.tokens, strict=True)):
        cut = StopStrings(args.stop)
        text = cut.finish(tokenizer.decode(tokens))
        stopped = cut.stopped or (tokens and tokens[-1] in eos)
        line = {"index": i, **({"id": request["id"]} if "id" in request else {})}
        line |= {
            "text": text,
            "prompt_tokens": len(prompts[i]),
            "tokens": len(tokens),
            "finish_reason": "stop" if stopped else "length",
            "first_token_seconds": round(first.get(i, 0.0), 4),
            "seconds": round(last.get(i, 0.0), 4),
            "tokens_per_step": round(len(tokens) / max(1, result.request_steps[i]), 4),
        }
        print(json.dumps(line, ensure_ascii=False), flush=True)
    count = sum(map(len, result.tokens))
    print(
        f"{len(prompts)} prompts, {count} tokens in {result.seconds:.2f} s (compilation included, "
        f"{count / result.seconds:.1f} tokens/s); mean accepted length {result.mean_accepted:.2f}",
        file=sys.stderr,
        flush=True,
    )
    return 0
