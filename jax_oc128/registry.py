"""Models by their checkpoints' architecture name, drafters by name: a module adds its class with a decorator
(:func:`register_model`, :func:`register_drafter`) and a loader finds it (:func:`model_class`,
:func:`drafter_class`).

A registered model class implements :class:`~jax_oc128.protocols.Model` and is built in two steps: its config
(the architecture) from a checkpoint's ``config.json`` (a dict) by ``cls.config_from_hf(config, **options)``,
then the model by ``cls(config, runtime, *, rngs, **options)`` (``runtime`` a
:class:`~jax_oc128.nn.RuntimeConfig`; :func:`~jax_oc128.load_pretrained` passes ``backend``).
``"DeepseekV4ForCausalLM"`` is :class:`~jax_oc128.nn.SpeculativeModel` (registered when :mod:`jax_oc128.nn`
is imported, as ``import jax_oc128`` does). A registered drafter implements
:class:`~jax_oc128.protocols.Drafter`; how it is built is its model family's (DeepSeek-V4's heads:
``cls(config, target, *, rngs)``, :mod:`jax_oc128.nn.draft`).
"""

from __future__ import annotations

from collections.abc import Callable


class Registry:
    """Classes by name, of one ``kind`` (named in errors)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._classes: dict[str, type] = {}

    def register(self, name: str) -> Callable[[type], type]:
        """A class decorator registering its class as ``name`` (a non-empty str not registered to another
        class; registering the same class again changes nothing)."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"name: the {self.kind}'s name, a non-empty str, got {name!r}")

        def register(cls: type) -> type:
            if not isinstance(cls, type):
                raise TypeError(f"register: a class to register as {name!r}, got {cls!r}")
            known = self._classes.setdefault(name, cls)
            if known is not cls:
                raise ValueError(f"name: {self.kind} {name!r} is registered already, to {known.__qualname__}")
            return cls

        return register

    def lookup(self, name: str) -> type:
        """The class registered as ``name``; ValueError naming it and the registered ones if none is."""
        if name not in self._classes:
            raise ValueError(f"{self.kind}: unknown {name!r}; registered: {', '.join(sorted(self._classes))}")
        return self._classes[name]

    def names(self) -> tuple[str, ...]:
        """The registered names, sorted."""
        return tuple(sorted(self._classes))


#: model classes by their checkpoints' architecture (``config.json``'s ``"architectures"``)
MODELS = Registry("architecture")
#: drafter classes by name
DRAFTERS = Registry("drafter")

register_model = MODELS.register
model_class = MODELS.lookup
register_drafter = DRAFTERS.register
drafter_class = DRAFTERS.lookup
