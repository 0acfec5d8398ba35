"""Command line: ``jax-oc128`` (or ``python -m jax_oc128``) ``demo | generate | serve | info``."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import math
import os
import pathlib
import sys
import time

from jax_oc128.checks import add_backend_argument, check_backend, int_argument
from jax_oc128.engine import STEPS_PER_DISPATCH
from jax_oc128.nn.kv_cache import KV_CACHE_DTYPES
from jax_oc128.rules import MAX_DRAFT
from jax_oc128.serve import cli as serve_cli


def info() -> str:
    """Versions, the backend, where the native modules are installed and which native targets are registered
    on which platform."""
    import jax

    from jax_oc128 import _native, ops

    lines = [f"jax_oc128 {importlib.metadata.version('jax_oc128')}  (python {sys.version.split()[0]})"]
    for package in ("jax", "jaxlib", "flax", "numpy"):
        try:
            lines.append(f"  {package:8s} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            lines.append(f"  {package:8s} not installed")
    lines.append(f"backend: {jax.default_backend()}  devices: {', '.join(str(d) for d in jax.devices())}")
    modules = _native.MODULES.values()
    folder = os.path.dirname(_native.MODULES["cpu"].__file__)
    lines.append(f"native modules: {', '.join(m.__name__ for m in modules)} in {folder}")
    lines.append("native targets:")
    for platform in ("cpu", "cuda"):
        targets = ops.native_targets(platform)
        lines.append(
            f"  {platform:5s} {', '.join(targets) if targets else '(none: the jnp reference is used)'}"
        )
    return "\n".join(lines)


DEMO_PROMPTS = (
    "Return a new list containing all items from the iterable in ascending order.\n\nA custom key function "
    "can be supplied to customize the sort order, and the reverse flag can be set to request the result in ",
    "Open file and return a corresponding file object. If the file cannot be opened, ",
    "This module provides access to some variables used or maintained by the interpreter and to functions "
    "that interact strongly with the interpreter. It is always available.\n\nThe list of command line ",
    "Create a new thread ",
)


def _progress_display():
    """A rich progress display on stderr, one bar per task, redrawn only when a task is updated (no refresh
    thread: one would take the interpreter from the engine's dispatch loop, which the demo times); on a
    terminal the bars move, elsewhere (a pipe, a file) they are printed once when it stops, and
    :func:`_phase` writes a line as each phase starts and ends."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description:20s}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        auto_refresh=False,
    )


def _phase(progress, text: str) -> None:
    """A line of ``text`` on ``progress``'s console where it is not a terminal (a log, a pipe: the bars are
    printed only at the end there, and a cold run compiles for minutes); nothing on a terminal."""
    if not progress.console.is_terminal:
        progress.console.print(text, highlight=False, soft_wrap=True)


def demo(args, model, tokenizer, prompts) -> str:
    """Generate plainly and with speculation (each stops at EOS); report the text, exactness, acceptance,
    speed and memory. ``prompts``: the token ids of ``args.prompt`` (or :data:`DEMO_PROMPTS`)."""
    import jax

    from jax_oc128.controller import OFFLINE, ONLINE
    from jax_oc128.engine import Engine
    from jax_oc128.state import bytes_per_slot
    from jax_oc128.tree import Tree

    slots = min(args.batch, len(prompts))
    engine = Engine(model, slots=slots, steps_per_dispatch=min(args.steps_per_dispatch, args.tokens))
    modes = [("plain", {})] + [(f"speculative N={n}", dict(num_tokens=n)) for n in args.draft]
    modes += [(f"tree N={n}", dict(tree=Tree.default(n))) for n in args.tree]
    results = {}
    with _progress_display() as progress:
        for name, speculation in modes:
            run = functools.partial(
                engine.generate,
                prompts,
                args.tokens,
                temperature=args.temperature,
                seed=args.seed,
                **speculation,
            )
            # each mode runs twice and the second run is timed: the first compiles the prefill (one per
            # padded prompt width) and the decode loop, and on a GPU records their CUDA graphs for the
            # engine's buffers (after another mode ran, a mode's first dispatches record them again)
            start = time.perf_counter()
            _phase(progress, f"demo, {name}: compiling and a first run")
            run()
            _phase(
                progress, f"demo, {name}: first run in {time.perf_counter() - start:.1f} s, timing the second"
            )
            task = progress.add_task(name, total=len(prompts) * args.tokens)
            results[name] = run(
                progress=lambda done, task=task: progress.update(task, completed=done, refresh=True)
            )
            count = sum(map(len, results[name].tokens))  # fewer where EOS stopped a request
            progress.update(task, total=count, completed=count, refresh=True)
            _phase(progress, f"demo, {name}: {count} tokens in {results[name].seconds:.2f} s")
    config = model.config
    c128 = config.compressed_layers
    lines = [
        f"jax_oc128 demo on {jax.default_backend()}: model {tokenizer.directory.name} "
        f"({len(config.layer_types)} layers, {c128} C128), "
        f"{args.backend} C128 state, {len(prompts)} prompts x {args.tokens} new tokens, {slots} slots, "
        f"temperature {args.temperature}",
        "",
    ]
    plain = results["plain"]
    for i, (text, prompt) in enumerate(zip(args.prompt or DEMO_PROMPTS, prompts, strict=True)):
        lines += [
            f"--- prompt {i + 1} ({len(prompt)} tokens) ---",
            text + " >>> " + tokenizer.decode(plain.tokens[i]),
        ]
    lines += [
        "",
        f"{'mode':20s} {'tokens/s':>9s} {'steps':>6s} {'dispatches':>10s} {'mean accepted':>14s}  "
        "same tokens as plain",
    ]
    for name, result in results.items():
        rate = sum(map(len, result.tokens)) / result.seconds
        same = "-" if result is plain else ("yes" if result.tokens == plain.tokens else "no")
        if args.temperature > 0 and result is not plain:
            same = "(sampled)"
        lines.append(
            f"{name:20s} {rate:9.1f} {result.steps:6d} {result.dispatches:10d} "
            f"{result.mean_accepted:14.2f}  {same}"
        )
    layout = (c128, config.head_dim, model.max_draft)
    online, offline = (bytes_per_slot(backend.state_type, *layout) for backend in (ONLINE, OFFLINE))
    lines.append(
        f"C128 compressed state per request ({c128} layers, head_dim {config.head_dim}, "
        f"{model.max_draft} draft banks): online {online / 1024:.1f} KiB, "
        f"offline {offline / 1024:.1f} KiB ({offline / online:.1f}x)"
    )
    return "\n".join(lines)


def _prefill_chunk(text: str) -> int | str:
    """An argparse type: ``auto`` or an int >= 1."""
    if text == "auto":
        return text
    try:
        return int_argument(1)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be auto or an int >= 1, got {text!r}") from None


def _temperature(text: str) -> float:
    """An argparse type: a finite float >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _top_p(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def _nonempty(text: str) -> str:
    """An argparse type: non-empty valid Unicode text (an argument of bytes that are not UTF-8 is not)."""
    from jax_oc128.text import check_text

    if not text:
        raise argparse.ArgumentTypeError("must be non-empty text")
    try:
        return check_text("text", text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("text: ")) from None


def main(argv=None) -> int:
    """Run the command of ``argv`` (default: the process's arguments); the exit status. Output into a pipe
    whose reader has gone (``jax-oc128 info | true``, ``demo | head -1``) ends the command quietly, status 0:
    the reader wanted no more."""
    try:
        return _command(argv)
    except BrokenPipeError:
        # the streams' buffered rest would fail again when the interpreter flushes them at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(AttributeError, OSError, ValueError):  # a stream without a descriptor
                os.dup2(devnull, stream.fileno())
        os.close(devnull)
        return 0


def compile_cache_dir() -> pathlib.Path:
    """The command line's persistent compilation cache: ``$XDG_CACHE_HOME/jax_oc128/xla``, by default
    ``~/.cache/jax_oc128/xla``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "jax_oc128" / "xla"


def _use_compile_cache(enabled: bool) -> None:
    """JAX's persistent compilation cache in :func:`compile_cache_dir`, every executable in it (JAX's
    default keeps only those that took a second to compile), so that a second run of the same shapes loads
    them instead of compiling; JAX's own settings are kept (``JAX_COMPILATION_CACHE_DIR``: that directory,
    as JAX's options say; ``JAX_ENABLE_COMPILATION_CACHE=false``: none). ``enabled`` False
    (``--no-compile-cache``): no persistent cache."""
    import jax

    if not enabled:
        jax.config.update("jax_enable_compilation_cache", False)
    elif jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(compile_cache_dir()))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


class _HelpFormatter(argparse.HelpFormatter):
    """Each option's default at the end of its help, where it has one (not None or False) that the help
    does not already state."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default == argparse.SUPPRESS
        if not unset and "default" not in text and action.option_strings:
            shown = " ".join(map(str, default)) if isinstance(default, list) else default
            text += f" (default: {shown})"
        return text


def _program() -> str:
    """The command's name as invoked: ``jax-oc128`` (the installed script) or ``python -m jax_oc128``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m jax_oc128" if name in ("", "__main__.py", "-c") else name


def _command(argv) -> int:
    version = importlib.metadata.version("jax_oc128")
    parser = argparse.ArgumentParser(
        prog=_program(),
        description="DeepSeek-V4 with online C128 KV compression under speculative decoding, in JAX.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, backend and registered native targets")
    compiling = argparse.ArgumentParser(add_help=False)
    compiling.add_argument(
        "--no-compile-cache",
        action="store_true",
        help=f"compile everything again (default: executables cached in {compile_cache_dir()}, "
        "$JAX_COMPILATION_CACHE_DIR where set)",
    )
    run = commands.add_parser(
        "demo",
        help="generate with and without speculation and report",
        parents=[compiling],
        formatter_class=_HelpFormatter,
    )
    run.add_argument(
        "--prompt",
        type=_nonempty,
        action="append",
        metavar="TEXT",
        help="a prompt (repeat for several; default: four built in)",
    )
    run.add_argument(
        "--tokens", type=int_argument(1), default=160, help="new tokens per prompt at most (EOS stops)"
    )
    run.add_argument(
        "--draft",
        type=int_argument(2, MAX_DRAFT),
        nargs="+",
        default=[2, 4],
        help="N of the speculative runs (each >= 2)",
    )
    run.add_argument(
        "--tree",
        type=int_argument(2, MAX_DRAFT),
        nargs="*",
        default=None,
        help="N of the tree speculative runs, each the default draft tree of N nodes (default: 8 with the "
        "online state; none with the offline one, which verifies chains only)",
    )
    run.add_argument("--temperature", type=_temperature, default=0.0, help="0: greedy")
    add_backend_argument(run)
    run.add_argument(
        "--batch", type=int_argument(1), default=4, help="slots (at most one per prompt is used)"
    )
    run.add_argument(
        "--steps-per-dispatch",
        type=int_argument(1),
        default=STEPS_PER_DISPATCH,
        help="K: decoding steps per on-device loop (1: the host reads every step; at most --tokens used)",
    )
    run.add_argument("--seed", type=int_argument(0, 2**32 - 1), default=0, help="of the sampling")
    run.add_argument(
        "--model",
        metavar="PATH",
        help="a Hugging Face checkpoint directory with its tokenizer, as generate's PATH (default: the "
        "shipped text model)",
    )
    text = commands.add_parser(
        "generate",
        help="stream text from a prompt with a DeepSeek-V4 checkpoint and its tokenizer",
        parents=[compiling],
        formatter_class=_HelpFormatter,
    )
    text.add_argument(
        "path",
        nargs="?",
        default=None,
        help="a Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json; default: the "
        "shipped text model)",
    )
    source = text.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", type=_nonempty, metavar="TEXT", help="the prompt's text, streamed back")
    source.add_argument(
        "--prompts-file",
        metavar="FILE",
        help='several prompts, one per line: a JSON string or an object with a "prompt" string (and an '
        '"id"); -: stdin. Out: one JSON object per prompt (text, tokens, times, acceptance)',
    )
    text.add_argument(
        "--stop",
        type=_nonempty,
        action="append",
        default=[],
        metavar="TEXT",
        help="end the text before this string, exactly (repeat for several; cut after decoding)",
    )
    text.add_argument(
        "--chat", action="store_true", help="the prompt as a user message in the checkpoint's chat template"
    )
    speculation = text.add_mutually_exclusive_group()
    speculation.add_argument(
        "--draft",
        type=int_argument(2, MAX_DRAFT),
        default=None,
        metavar="N",
        help="speculate with a chain of N (the MTP layer)",
    )
    speculation.add_argument(
        "--tree",
        type=int_argument(2, MAX_DRAFT),
        default=None,
        metavar="N",
        help="speculate with the default draft tree of N",
    )
    add_backend_argument(text)
    text.add_argument(
        "--max-new-tokens",
        type=int_argument(1),
        default=256,
        metavar="M",
        help="at most this many (EOS stops)",
    )
    text.add_argument(
        "--max-len",
        type=int_argument(1),
        default=None,
        metavar="L",
        help="the caches' length, at most the model's max_position_embeddings (default: the prompt, "
        "--max-new-tokens and N, in whole blocks of 128)",
    )
    text.add_argument("--temperature", type=_temperature, default=0.0, help="0: greedy")
    text.add_argument(
        "--top-p",
        type=_top_p,
        default=None,
        metavar="P",
        help="sample from the most probable tokens of mass P (nucleus; default: off); exact with --draft "
        "and --tree",
    )
    text.add_argument(
        "--top-k",
        type=int_argument(0),
        default=None,
        metavar="K",
        help="sample from the K most probable tokens (0 or default: off); exact with --draft and --tree",
    )
    text.add_argument("--seed", type=int_argument(0, 2**32 - 1), default=0, help="of the sampling")
    text.add_argument(
        "--mesh",
        metavar="data=D,model=M",
        help="run on D x M devices: the requests split over D, the weights over M (default: one device)",
    )
    text.add_argument(
        "--slots",
        type=int_argument(1),
        metavar="S",
        help="requests decoded together (default: the prompts, at most 8; rounded up to a multiple of D)",
    )
    text.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="default: bfloat16 on a GPU, else float32",
    )
    text.add_argument(
        "--kv-cache-dtype",
        choices=list(KV_CACHE_DTYPES),
        default="auto",
        help="the caches' storage (auto: the model's dtype; fp8: DeepSeek's FP8 entries and indexer keys; "
        "fp8_fp4: FP8 entries, FP4 indexer keys)",
    )
    text.add_argument(
        "--prefill-chunk",
        type=_prefill_chunk,
        default="auto",
        metavar="C",
        help="prefill the prompt C tokens at a time (auto: the engine's choice, at most 2048 on a GPU, one "
        "forward on a CPU, where a long prompt's activations grow with its length)",
    )
    text.add_argument(
        "--steps-per-dispatch",
        type=int_argument(1),
        default=STEPS_PER_DISPATCH,
        help="K: decoding steps per on-device loop (the text arrives K steps at a time)",
    )
    server = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (docs/serving.md)",
        parents=[compiling],
        formatter_class=_HelpFormatter,
    )
    serve_cli.add_arguments(server)
    args = parser.parse_args(argv)
    if args.command == "info":
        print(info(), flush=True)
        return 0
    _use_compile_cache(not getattr(args, "no_compile_cache", False))  # a command without the flag: on
    if args.command == "serve":
        return serve_cli.serve(server, args)
    if args.command == "generate":
        from jax_oc128 import generate_command

        return generate_command.run(text, args)
    if len(set(args.draft)) < len(args.draft):
        run.error(f"argument --draft: each N at most once, got {args.draft}")
    if args.tree is None:
        args.tree = [8] if args.backend == "online" else []
    check_backend(run, args.backend, bool(args.tree))
    if len(set(args.tree)) < len(args.tree):
        run.error(f"argument --tree: each N at most once, got {args.tree}")
    print(demo(args, *_demo_model(run, args)), flush=True)
    return 0


def _demo_model(parser, args):
    """The demo's model, its tokenizer and the prompts' token ids, every flag checked against them."""
    from jax_oc128 import generate_command
    from jax_oc128.controller import BACKENDS
    from jax_oc128.text import SHIPPED_MODEL

    path = args.model or SHIPPED_MODEL
    tokenizer = generate_command.checked_tokenizer(parser, path, "--model")
    prompts = generate_command.encode_prompts(parser, tokenizer, args.prompt or DEMO_PROMPTS, "--prompt")
    n = max(args.draft + args.tree)
    flags = {"path": "--model", "new": "--tokens", "draft": "--draft"}
    max_len = generate_command.check_request(parser, path, tokenizer, prompts, args.tokens, n, flags=flags)
    options = dict(backend=BACKENDS[args.backend], max_len=max_len)
    model = generate_command.load_checked(parser.error, path, n, flags, **options)
    return model, tokenizer, prompts


if __name__ == "__main__":
    sys.exit(main())
