"""Speculative decoding with the shipped model: plain greedy vs MTP speculation with N = 3, online C128 state.

Run: python examples/speculative_decoding.py
"""

from __future__ import annotations

from jax_oc128 import checkpoint
from jax_oc128.controller import ONLINE
from jax_oc128.decode import Engine


def main(new_tokens=80):
    model, _ = checkpoint.load(backend=ONLINE)
    engine = Engine(model, slots=2)
    prompts = [list(b"Return the number of items in the container. "), list(b"Raise ValueError if ")]
    plain = engine.generate(prompts, new_tokens)
    speculative = engine.generate(prompts, new_tokens, num_tokens=3)
    for prompt, tokens in zip(prompts, speculative.tokens, strict=True):
        print(repr(bytes(prompt).decode() + bytes(tokens).decode("ascii", "replace")))
    print(f"identical to plain greedy: {speculative.tokens == plain.tokens}")
    print(f"steps: plain {plain.steps}, speculative {speculative.steps}", end="; ")
    print(f"mean accepted length {speculative.mean_accepted:.2f}")


if __name__ == "__main__":
    main()
