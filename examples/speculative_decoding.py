"""Speculative decoding with the shipped text model: plain greedy vs MTP speculation with a chain of N = 3 and
with a draft tree of 8 nodes, online C128 state; each request stops at EOS.

Run: python examples/speculative_decoding.py
"""

from __future__ import annotations

from jax_oc128 import load_pretrained, load_tokenizer
from jax_oc128.engine import Engine
from jax_oc128.text import SHIPPED_MODEL
from jax_oc128.tree import Tree


def main(new_tokens=48):
    model = load_pretrained(SHIPPED_MODEL, max_len=256, max_draft=8)  # caches of 256 positions
    tokenizer = load_tokenizer(SHIPPED_MODEL)
    texts = ["Return the number of items in the container. ", "Raise ValueError if "]
    prompts = [tokenizer.encode(text) for text in texts]  # the BOS token, then the text's tokens
    engine = Engine(model, slots=2)
    plain = engine.generate(prompts, new_tokens)
    speculative = engine.generate(prompts, new_tokens, num_tokens=3)
    for text, tokens in zip(texts, speculative.tokens, strict=True):
        print(repr(text + tokenizer.decode(tokens)))
    print(f"identical to plain greedy: {speculative.tokens == plain.tokens}")
    print(f"steps: plain {plain.steps}, speculative {speculative.steps}", end="; ")
    print(f"mean accepted length {speculative.mean_accepted:.2f}")
    tree = engine.generate(prompts, new_tokens, tree=Tree.default(8))  # its parents: Tree.default(8).parents
    print(f"tree of 8 nodes: identical to plain greedy: {tree.tokens == plain.tokens}", end="; ")
    print(f"steps {tree.steps}, mean accepted length {tree.mean_accepted:.2f}")


if __name__ == "__main__":
    main()
