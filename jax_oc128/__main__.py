"""Command line: ``python -m jax_oc128 demo | info``."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys

from jax_oc128.decode import STEPS_PER_DISPATCH


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


def _progress(total, label):
    """A text progress bar on stderr: ``update(done)``."""

    def update(done):
        filled = int(30 * min(done, total) / total)
        sys.stderr.write(
            f"\r{label:22s} [{'#' * filled}{'.' * (30 - filled)}] {min(done, total)}/{total} tokens"
        )
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return update


def _text(tokens) -> str:
    return bytes(t for t in tokens if 9 <= t < 127 or t == 10).decode("ascii")


def demo(args) -> str:
    """Generate plainly and with speculation; report the text, exactness, acceptance, speed and memory."""
    import jax

    from jax_oc128 import checkpoint
    from jax_oc128.controller import BACKENDS, OFFLINE, ONLINE
    from jax_oc128.decode import Engine
    from jax_oc128.state import bytes_per_slot

    model, meta = checkpoint.load(args.model or checkpoint.DEFAULT_MODEL, backend=BACKENDS[args.backend])
    prompts = [list(p.encode("ascii", "replace")) for p in (args.prompt or DEMO_PROMPTS)]
    engine = Engine(model, slots=args.batch, steps_per_dispatch=args.steps_per_dispatch)
    modes = [("plain", None)] + [(f"speculative N={n}", n) for n in args.draft]
    # compile first, so that the timings below are the steady state: the decode loop of each mode, and the
    # prefill of each prompt's padded width (a batch of admitted prompts takes the widest one's)
    for _, n in modes:
        for prompt in prompts:
            engine.generate([prompt], 2, num_tokens=n, temperature=args.temperature)
    results = {}
    for name, n in modes:
        bar = _progress(len(prompts) * args.tokens, name)
        results[name] = engine.generate(
            prompts, args.tokens, num_tokens=n, temperature=args.temperature, seed=args.seed, progress=bar
        )
    config = model.config
    c128 = config.compressed_layers
    lines = [
        f"jax_oc128 demo on {jax.default_backend()}: model {meta.get('trained_on', 'custom')} "
        f"({len(config.layer_types)} layers, {c128} C128), "
        f"{args.backend} C128 state, {len(prompts)} prompts x {args.tokens} new tokens, {args.batch} slots, "
        f"temperature {args.temperature}",
        "",
    ]
    plain = results["plain"]
    for i, prompt in enumerate(prompts):
        lines += [
            f"--- prompt {i + 1} ({len(prompt)} bytes) ---",
            _text(prompt) + " >>> " + _text(plain.tokens[i]),
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
    layout = (c128, config.head_dim, config.max_draft)
    online, offline = (bytes_per_slot(backend.state_type, *layout) for backend in (ONLINE, OFFLINE))
    lines.append(
        f"C128 compressed state per request ({c128} layers, head_dim {config.head_dim}, "
        f"{config.max_draft} draft banks): online {online / 1024:.1f} KiB, "
        f"offline {offline / 1024:.1f} KiB ({offline / online:.1f}x)"
    )
    return "\n".join(lines)


def _positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def _temperature(text: str) -> float:
    """An argparse type: a finite float >= 0."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_oc128", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, backend and registered native targets")
    run = commands.add_parser("demo", help="generate with and without speculation and report")
    run.add_argument(
        "--prompt", action="append", help="a prompt (repeat for several; default: four built in)"
    )
    run.add_argument("--tokens", type=_positive_int, default=160, help="new tokens per prompt")
    run.add_argument(
        "--draft", type=_positive_int, nargs="+", default=[2, 4], help="N of the speculative runs"
    )
    run.add_argument("--temperature", type=_temperature, default=0.0, help="0: greedy")
    run.add_argument(
        "--backend", choices=["online", "offline"], default="online", help="C128 compressor state"
    )
    run.add_argument("--batch", type=_positive_int, default=4, help="slots")
    run.add_argument(
        "--steps-per-dispatch",
        type=_positive_int,
        default=STEPS_PER_DISPATCH,
        help="K: decoding steps per on-device loop (1: the host reads every step)",
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--model", default=None, help="a checkpoint (default: the one shipped in the package)")
    args = parser.parse_args(argv)
    if args.command == "info":
        print(info())
    elif args.command == "demo":
        print(demo(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
