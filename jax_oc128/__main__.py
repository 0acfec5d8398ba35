"""Command line: ``python -m jax_oc128 info``."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys


def info() -> str:
    """Versions, the backend and which native targets are registered on which platform."""
    import jax

    from jax_oc128 import _native

    lines = [f"jax_oc128 {importlib.metadata.version('jax_oc128')}  (python {sys.version.split()[0]})"]
    for package in ("jax", "jaxlib", "flax", "numpy"):
        try:
            lines.append(f"  {package:8s} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            lines.append(f"  {package:8s} not installed")
    lines.append(f"backend: {jax.default_backend()}  devices: {', '.join(str(d) for d in jax.devices())}")
    lines.append("native targets:")
    for platform in ("cpu", "cuda"):
        targets = _native.TARGETS.get(platform)
        lines.append(
            f"  {platform:5s} {', '.join(targets) if targets else '(none: the jnp reference is used)'}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_oc128", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, backend and registered native targets")
    args = parser.parse_args(argv)
    if args.command == "info":
        print(info())
    return 0


if __name__ == "__main__":
    sys.exit(main())
