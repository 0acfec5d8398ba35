"""Speculative decoding with the shipped model: plain greedy vs MTP speculation with a chain of N = 3 and with
a draft tree of 8 nodes, online C128 state.

Run: python examples/speculative_decoding.py
"""

from __future__ import annotations

from jax_oc128 import checkpoint
from jax_oc128.controller import ONLINE
from jax_oc128.engine import Engine
from jax_oc128.tree import Tree


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
    tree = engine.generate(
        prompts, new_tokens, tree=Tree.default(8)
    )  # its nodes' parents: Tree.default(8).parents
    print(f"tree of 8 nodes: identical to plain greedy: {tree.tokens == plain.tokens}", end="; ")
    print(f"steps {tree.steps}, mean accepted length {tree.mean_accepted:.2f}")


if __name__ == "__main__":
    main()
