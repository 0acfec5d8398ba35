"""The OpenAI request bodies the server takes (pydantic, strict types: ``"5"`` is no int) and the error type
whose ``param`` names the field at fault. Fields of the OpenAI API the server does not honour are declared
so that a value other than their default is refused by name rather than ignored."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

#: OpenAI's optional fields the server does not implement, with the one value it takes for each
UNSUPPORTED_DEFAULTS = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "logprobs": None,
    "top_logprobs": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": None,
    "suffix": None,
    "tools": None,
    "response_format": None,
}


class RequestError(Exception):
    """A bad request: HTTP ``status`` with an OpenAI error body naming ``param``."""

    def __init__(self, message: str, param: str | None, status: int = 400, kind="invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields of both endpoints."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str
    temperature: float | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension: token ids that end the request
    ignore_eos: bool = False  # vLLM's extension: the EOS tokens do not end the request
    seed: int | None = Field(default=None, ge=0, le=2**32 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = 1
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's extension: -1, 0 or None: off
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict | None = None
    tools: list | None = None
    response_format: dict | None = None


class CompletionRequest(_Common):
    """``POST /v1/completions``: one prompt, a string or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    best_of: int | None = 1
    echo: bool | None = False
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Common):
    """``POST /v1/chat/completions``: messages through the tokenizer's chat template."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


def parse(kind: type[BaseModel], body) -> BaseModel:
    """``body`` (decoded JSON) as ``kind``; a :class:`RequestError` naming the first field at fault, or a
    field of :data:`UNSUPPORTED_DEFAULTS` given another value."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None)
    try:
        request = kind.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise RequestError(f"{where}: {first['msg']}", where) from None
    for field, default in UNSUPPORTED_DEFAULTS.items():
        value = getattr(request, field, default)
        if value is not None and value != default:
            raise RequestError(
                f"{field}: not supported by this server (only {default!r}), got {value!r}", field
            )
    return request
