"""The engines that test_engine_on_mesh.py, test_two_processes.py and its worker share: the engine tests'
small model (:func:`models.make_model`, online), its 5 prompts for ``SLOTS`` slots, ``NEW_TOKENS`` new tokens,
speculative steps of ``N``; each built (and its tokens generated) once per process."""

from __future__ import annotations

import functools

from models import make_model, prompts

from jax_oc128 import load_pretrained
from jax_oc128.controller import ONLINE
from jax_oc128.engine import Engine
from jax_oc128.nn import sharding

# 5 prompts for 4 slots: a slot is reused; blocks of 128 close in prefill and in decoding
SLOTS, NEW_TOKENS, N = 4, 40, 4
#: ``load_pretrained``'s arguments for a checkpoint of :mod:`checkpoints`
LOADED = dict(dtype="float32", max_len=512, max_draft=4)


@functools.cache
def model():
    return make_model(ONLINE)


@functools.cache
def engine(shape=None):
    """The engine of :func:`model` on a mesh of ``shape`` (data, model), or on one device (None)."""
    mesh = None if shape is None else sharding.make_mesh(*shape)
    return Engine(model(), SLOTS, prompt_bucket=256, mesh=mesh)  # one prompt bucket: one prefill compiled


@functools.cache
def one_device(num_tokens):
    """The prompts' greedy tokens on one device, speculative steps of ``num_tokens`` (None: plain steps)."""
    return engine().generate(prompts(), NEW_TOKENS, num_tokens=num_tokens).tokens


def loaded_one_device(directory: str, num_tokens):
    """The greedy tokens of the checkpoint at ``directory`` loaded onto one device, for the engine tests'
    prompts (below its vocabulary), speculative steps of ``num_tokens``."""
    model = load_pretrained(directory, **LOADED)
    requests = prompts(vocab=model.config.vocab_size)
    engine = Engine(model, SLOTS, prompt_bucket=256)
    return engine.generate(requests, NEW_TOKENS, num_tokens=num_tokens).tokens
