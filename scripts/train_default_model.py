"""Train the byte-level model in jax_oc128/assets/default_model.npz (``checkpoint.load()``'s default: the
engine's and the kernels' tests and bench/bench_decode.py run on it; users get the text model,
train_text_model.py): a small DeepSeek-V4-style decoder (sliding + C128 layers) and its MTP head, on the
docstrings of Python's standard library (text that exists on any machine with Python). The C128 compressor is
trained through the offline (pure jnp) backend, whose math the online state reproduces at inference.

Usage: python scripts/train_default_model.py [--steps 3000] [--out jax_oc128/assets/default_model.npz]
(a GPU makes it a few minutes).
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax_oc128 import checkpoint
from jax_oc128.controller import OFFLINE
from jax_oc128.nn import ModelConfig, SpeculativeModel


def docstrings(limit_bytes=4_000_000) -> list[str]:
    """Module, class and function docstrings of the standard library (ASCII, over 80 characters, stripped),
    in sorted file order, up to about ``limit_bytes`` of text."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    texts, size = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parts or "idlelib" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80 and doc.isascii():
                    texts.append(doc.strip())
                    size += len(texts[-1]) + 2
        if size > limit_bytes:
            break
    return texts


def corpus(limit_bytes=4_000_000) -> bytes:
    """:func:`docstrings`, each followed by a blank line, as ASCII bytes."""
    return "".join(doc + "\n\n" for doc in docstrings(limit_bytes)).encode("ascii")


def loss_fn(model, tokens, mtp_weight):
    """Next-token loss of the target plus the MTP head's loss on the token after next."""
    x = tokens[:, :-2]
    batch, length = x.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    logits, hidden, _ = model.target(x, positions, model.target.init_cache(batch))
    target_loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:-1]).mean()
    mtp_logits, _, _ = model.mtp(x[:, 1:], hidden[:, :-1], positions[:, 1:], model.mtp.init_cache(batch))
    mtp_loss = optax.softmax_cross_entropy_with_integer_labels(mtp_logits, tokens[:, 2:-1]).mean()
    return target_loss + mtp_weight * mtp_loss, (target_loss, mtp_loss)


def optimizer(steps: int, lr: float, final: float):
    """AdamW (weight decay 0.01, gradients clipped to norm 1) at ``lr`` after a linear warm-up of a tenth of
    ``steps`` (at most 100), decaying along a cosine to ``final * lr`` at ``steps``."""
    warmup = min(100, steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr * final)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-seconds", type=float, default=None, help="stop early after this long")
    parser.add_argument("--out", default=str(checkpoint.DEFAULT_MODEL))
    args = parser.parse_args()

    text = np.frombuffer(corpus(), np.uint8).astype(np.int32)
    print(f"corpus: {len(text) / 1e6:.2f} MB of stdlib docstrings; backend {jax.default_backend()}")
    config = ModelConfig.tiny()
    model = SpeculativeModel(config, backend=OFFLINE, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tx = optimizer(args.steps, args.lr, final=0.05)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, tokens):
        def loss(p):
            return loss_fn(nnx.merge(graphdef, p), tokens, 0.5)

        (value, parts), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, parts

    rng = np.random.default_rng(0)
    start = time.time()
    for step in range(args.steps):
        offsets = rng.integers(0, len(text) - args.length - 3, args.batch)
        tokens = jnp.asarray(np.stack([text[o : o + args.length + 2] for o in offsets]))
        params, opt_state, _, (target_loss, mtp_loss) = train_step(params, opt_state, tokens)
        out_of_time = args.max_seconds is not None and time.time() - start > args.max_seconds
        if step % 250 == 0 or step == args.steps - 1 or out_of_time:
            losses = f"target {float(target_loss):.3f}  mtp {float(mtp_loss):.3f}"
            print(f"step {step:5d}  {losses}  {time.time() - start:.0f}s")
        if out_of_time:
            break
    model = nnx.merge(graphdef, params)
    meta = {
        "trained_on": "Python standard library docstrings",
        "steps": args.steps,
        "target_loss": float(target_loss),
        "mtp_loss": float(mtp_loss),
    }
    checkpoint.save(model, args.out, **meta)
    print(f"wrote {args.out} ({pathlib.Path(args.out).stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
