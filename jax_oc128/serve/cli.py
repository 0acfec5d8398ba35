"""``jax-oc128 serve [PATH]``: its flags (:func:`add_arguments`) and the command (:func:`serve`). Nothing
heavy is imported until the command runs."""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import socket
import threading
import time

from jax_oc128.checks import add_backend_argument, check_backend, int_argument
from jax_oc128.rules import MAX_DRAFT

#: decoding steps per dispatch when serving: a new request waits up to a dispatch for its slot, so fewer than
#: the engine's batch default (64)
SERVE_STEPS_PER_DISPATCH = 16
#: the admission wait's default in milliseconds (:class:`~jax_oc128.serve.engine_process.EngineProcess`)
ADMISSION_WAIT_MS = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``serve`` subcommand's flags on ``parser``."""
    parser.add_argument(
        "path",
        nargs="?",
        default=None,
        help="a Hugging Face checkpoint directory (default: the shipped text model)",
    )
    speculation = parser.add_mutually_exclusive_group()
    speculation.add_argument("--draft", type=int_argument(2), metavar="N", help="speculate with a chain of N")
    speculation.add_argument("--tree", type=int_argument(2), metavar="N", help="the default draft tree of N")
    add_backend_argument(parser)
    parser.add_argument("--slots", type=int_argument(1), default=8, help="requests decoded together")
    parser.add_argument(
        "--pages", type=int_argument(1), default=None, help="paged caches of this many pages (default: dense)"
    )
    parser.add_argument("--page-size", type=int_argument(128), default=256, help="tokens per page")
    parser.add_argument(
        "--prefix-cache",
        type=int_argument(0),
        default=0,
        metavar="N",
        help="prefix caching with --pages, keeping N snapshots of a prefix's state (default 0: off)",
    )
    parser.add_argument(
        "--max-len",
        type=int_argument(2),
        default=None,
        help="the longest request, prompt + max_tokens + N (default: 4096)",
    )
    parser.add_argument(
        "--max-queued", type=int_argument(0), default=256, help="requests waiting beyond the slots (then 503)"
    )
    parser.add_argument(
        "--steps-per-dispatch",
        type=int_argument(1),
        default=SERVE_STEPS_PER_DISPATCH,
        help="K: decoding steps per on-device loop",
    )
    parser.add_argument(
        "--admission-wait",
        type=int_argument(0),
        default=ADMISSION_WAIT_MS,
        metavar="MS",
        help="an idle server takes arrivals for up to MS ms before its first step (0: none)",
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="of a checkpoint")
    parser.add_argument(
        "--served-model-name", default=None, help="default: the directory's name or 'shipped'"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int_argument(0), default=8000)


#: the engine's argument names (``checks.NamedError.argument``) as the command's flags; the speculation's
#: is ``--draft`` or ``--tree``, any other is the checkpoint's (``path``)
_FLAGS = {
    "slots": "--slots",
    "pages": "--pages",
    "page_size": "--page-size",
    "max_len": "--max-len",
    "prefix_cache": "--prefix-cache",
}


def build(parser: argparse.ArgumentParser, args, factory=None, *extra, tokenizer=None):
    """The server of ``args`` (:class:`~jax_oc128.serve.app.Server`), its engine process started and built
    by ``factory(args, *extra)`` (a module-level function returning the scheduler and the factory's extra;
    None: :func:`load_engine`); argparse's error for a bad flag, whichever process finds it. ``tokenizer``:
    None (the checkpoint's, ``args.path``, whose ``max_position_embeddings`` bounds ``--max-len``), or the
    served model's (a :class:`~jax_oc128.text.TextTokenizer`, for a model the factory builds without a
    checkpoint: the model's runtime then bounds ``--max-len``)."""
    from jax_oc128.loading.hf_config import CONFIG, read_config
    from jax_oc128.serve.app import Server
    from jax_oc128.serve.engine_process import EngineFailed, EngineProcess, EngineSpec
    from jax_oc128.text import SHIPPED_MODEL, load_tokenizer

    check_backend(parser, args.backend, args.tree is not None)
    n = args.draft or args.tree or 1
    speculation = f"--{'draft' if args.draft else 'tree'}"
    if n > MAX_DRAFT:
        parser.error(f"argument {speculation}: at most {MAX_DRAFT}")
    flags = _FLAGS | {"num_tokens": speculation, "tree": speculation}
    path = SHIPPED_MODEL if args.path is None else args.path
    if tokenizer is None:
        try:
            tokenizer = load_tokenizer(path)
            positions = read_config(pathlib.Path(path) / CONFIG).runtime.max_len  # max_position_embeddings
        except (OSError, ValueError) as error:
            parser.error(f"argument path: {error}")
        if args.max_len is not None and args.max_len > positions:
            parser.error(f"argument --max-len: at most the model's max_position_embeddings ({positions})")
    try:
        spec = EngineSpec(factory or load_engine, (args, *extra))
        process = EngineProcess(spec, args.max_queued, args.admission_wait / 1000)
    except EngineFailed as error:
        if not error.usage:
            raise
        parser.error(f"argument {flags.get(error.argument, 'path')}: {error.message}")
    name = "shipped" if args.path is None else args.path.rstrip("/").split("/")[-1]
    return Server(process, tokenizer, args.served_model_name or name)


def scheduler(args, model=None):
    """In the engine process: the :class:`~jax_oc128.engine.requests.RequestScheduler` of ``args`` over
    ``model`` (None: the checkpoint's, loaded), its engine built; a bad argument raises the engine's error
    naming it."""
    from jax_oc128.controller import BACKENDS
    from jax_oc128.engine import Engine
    from jax_oc128.engine.requests import RequestScheduler
    from jax_oc128.pretrained import load_pretrained
    from jax_oc128.text import SHIPPED_MODEL

    path = SHIPPED_MODEL if args.path is None else args.path
    n = args.draft or args.tree or 1
    if model is None:
        model = load_pretrained(
            path, dtype=args.dtype, backend=BACKENDS[args.backend], max_len=args.max_len or 4096, max_draft=n
        )
    options = dict(steps_per_dispatch=args.steps_per_dispatch, pages=args.pages, page_size=args.page_size)
    engine = Engine(model, args.slots, **options)
    tree = None if args.tree is None else _default_tree(args.tree)
    return RequestScheduler(
        engine, num_tokens=args.draft, tree=tree, prefix_cache=args.prefix_cache, align=True
    )


def load_engine(args):
    """The engine process's factory of ``jax-oc128 serve``: :func:`scheduler` and no extra."""
    return scheduler(args), None


def _default_tree(n: int):
    from jax_oc128.tree import Tree

    return Tree.default(n)


@contextlib.contextmanager
def running(server, host: str = "127.0.0.1", port: int = 0, timeout: float = 120):
    """Serve ``server`` (a :class:`~jax_oc128.serve.app.Server`) under uvicorn in a thread while the block
    runs (port 0: a free one); yields the base URL; its engine process is stopped after. For tests and
    benchmarks."""
    import uvicorn

    from jax_oc128.serve.app import create_app

    sock = socket.socket()
    sock.bind((host, port))
    # log_config None: the logging of the process as it is (none bound to the streams of the moment)
    uv = uvicorn.Server(uvicorn.Config(create_app(server), log_config=None, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    try:
        while not uv.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(timeout)
        sock.close()
        if thread.is_alive():
            raise RuntimeError("the server did not stop")


def serve(parser: argparse.ArgumentParser, args) -> int:
    """Run the server of ``args`` until interrupted."""
    import uvicorn

    from jax_oc128.serve.app import create_app

    server = build(parser, args)
    uvicorn.run(create_app(server), host=args.host, port=args.port, log_level="info")
    return 0
