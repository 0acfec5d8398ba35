"""``jax-oc128 serve``: an OpenAI-compatible HTTP server (FastAPI, uvicorn, sse-starlette) over the
engine's :class:`~jax_oc128.engine.requests.RequestScheduler` (docs/serving.md).

Modules: :mod:`~jax_oc128.serve.protocol` (the request bodies, the errors),
:mod:`~jax_oc128.serve.engine_process` (the scheduler's device loop in a process of its own, and its
pipes), :mod:`~jax_oc128.serve.app` (the endpoints), :mod:`~jax_oc128.serve.cli` (the command's flags)."""
