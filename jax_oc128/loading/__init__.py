"""Loading a Hugging Face-format DeepSeek-V4 checkpoint (:func:`jax_oc128.load_pretrained`), by concern:
the config (:mod:`~jax_oc128.loading.hf_config`), the safetensors files (:mod:`~jax_oc128.loading.shards`),
the tensors' names (:mod:`~jax_oc128.loading.names`), the quantized formats
(:mod:`~jax_oc128.loading.formats`), the one check of the tensors against the config's model
(:mod:`~jax_oc128.loading.checker`) and their placement on the devices (:mod:`~jax_oc128.loading.placement`).
"""
