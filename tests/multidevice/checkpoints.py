"""The checkpoints that test_sharded_load.py, test_two_processes.py and its worker share: a random model of a
small DeepSeek-V4 config written as a float checkpoint or in DeepSeek's released format, and the bytes each
device of a mesh must hold of a loaded model."""

from __future__ import annotations

import functools
import json
import math
import pathlib

import jax
import numpy as np
from flax import nnx
from hf_fixtures import fixture
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

from jax_oc128 import pretrained, released
from jax_oc128.nn import CSA, HCA, SLIDING, ModelConfig, RuntimeConfig, SpeculativeModel, sharding
from jax_oc128.nn.functional import variable_at
from jax_oc128.nn.moe import HASH_MOE, MOE


@functools.cache
def config() -> dict:
    """The small-window fixture's config in 3 layers (sliding with hash routing, CSA, HCA) and an MTP
    layer: 4 heads, 4 experts of 32 (FP4 groups), a q_lora_rank of 136 (partial FP8 blocks) and o-groups of
    256 (o_b_proj's 512 columns: whole FP8 blocks per device, its scales split along with them)."""
    base = fixture("small_window")[0]
    return base | {
        "num_hidden_layers": 3,
        "layer_types": [SLIDING, CSA, HCA],
        "mlp_layer_types": [HASH_MOE, MOE, MOE],
        "moe_intermediate_size": 32,
        "q_lora_rank": 136,
        "o_lora_rank": 256,
        "num_nextn_predict_layers": 1,
    }


@functools.cache
def random_model() -> SpeculativeModel:
    return SpeculativeModel(
        ModelConfig.from_hf(config()), RuntimeConfig(max_len=512, max_draft=4), rngs=nnx.Rngs(5)
    )


@functools.cache
def checkpoint(kind: str, root: str) -> str:
    """The checkpoint ``kind`` of a random model of :func:`config` written under ``root``: "float" (one
    file, transformers' names) or "released" (DeepSeek's format, 2 shards)."""
    model = random_model()
    directory = f"{root}/{kind}"
    if kind == "released":
        released.write_released(
            directory, released.released_config(config()), released.released_tensors(model)
        )
        return directory
    tensors = {
        name: np.asarray(variable_at(model, path)[...])
        for name, path in pretrained.parameter_paths(model).items()
    }
    pathlib.Path(directory).mkdir()
    (pathlib.Path(directory) / pretrained.CONFIG).write_text(json.dumps(config()))
    save_file(tensors, f"{directory}/{pretrained.SINGLE}")
    return directory


def shares(model, mesh) -> tuple[int, int]:
    """(the bytes each device must hold: every parameter's bytes over its split, the bytes of all
    parameters)."""
    state = nnx.state(model)
    specs = jax.tree.leaves(sharding.param_specs(state, mesh), is_leaf=lambda x: isinstance(x, P))
    leaves = jax.tree.leaves(state)
    assert len(specs) == len(leaves)
    share = sum(
        leaf.nbytes // math.prod(mesh.shape[axis] for axis in spec if axis is not None)
        for leaf, spec in zip(leaves, specs, strict=True)
    )
    return share, sum(leaf.nbytes for leaf in leaves)
