"""Text in and out: a checkpoint's tokenizer, :func:`load_tokenizer`.

A Hugging Face checkpoint directory ships its tokenizer as ``tokenizer.json``, read by the ``tokenizers``
package (the BPE, its pre-tokenizer, decoder and special tokens: nothing of it is written here), and beside it
optionally:

- ``tokenizer_config.json``: ``bos_token`` and ``eos_token`` (a token's text, or an object with its
  ``content``), ``add_bos_token`` (whether a raw prompt starts with the BOS token; default false: only what
  ``tokenizer.json``'s post-processor adds), and a Jinja
  ``chat_template`` (a string, or a list of ``{name, template}`` of which the one named ``default`` is used);
- ``chat_template.jinja``: the chat template as its own file (what transformers writes since 4.50; it takes
  precedence over ``tokenizer_config.json``'s);
- ``generation_config.json``: ``eos_token_id`` (an int or a list), the tokens that end a generation; without
  it, ``tokenizer_config.json``'s ``eos_token``.

A chat template is rendered as transformers renders it, with bounded work (:mod:`jax_oc128.chat_template`).
DeepSeek-V4 as first released ships its chat encoding as Python (``encoding/``):
that is code of the checkpoint and is never run here; such a checkpoint takes raw prompts (its release later
added ``chat_template.jinja``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import tokenizers
from tokenizers.decoders import DecodeStream

from jax_oc128 import files
from jax_oc128.chat_template import compile_template
from jax_oc128.checks import check_token_ids

#: the text model shipped in the package (DeepSeek's released layout with its tokenizer;
#: ``scripts/train_text_model.py``): the default checkpoint of ``jax-oc128 generate`` and ``serve``
SHIPPED_MODEL = pathlib.Path(__file__).parent / "assets" / "text_model"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
GENERATION_CONFIG = "generation_config.json"
#: the largest tokenizer.json read, in bytes (DeepSeek-V4's is 7.5 MiB)
MAX_TOKENIZER_BYTES = 256 << 20
#: the largest tokenizer_config.json, generation_config.json or chat_template.jinja read, in bytes
MAX_TEXT_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """A checkpoint's tokenizer (:func:`load_tokenizer`).

    Attributes:
      tokenizer: the ``tokenizers.Tokenizer`` of ``tokenizer.json``.
      bos_token_id: the BOS token's id, or None (none named).
      eos_token_ids: the ids that end a generation (possibly none).
      add_bos_token: whether :meth:`encode` starts a raw prompt with the BOS token.
      chat_template: the Jinja chat template's source, or None (raw prompts only).
      directory: the checkpoint directory it was read from.
    """

    tokenizer: tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos_token: bool
    chat_template: str | None
    directory: pathlib.Path
    _template: object = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def vocab_size(self) -> int:
        """The ids it can give, special tokens included: ``[0, vocab_size)``."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, chat: bool = False) -> list[int]:
        """The token ids of the prompt ``text`` (a str).

        ``chat`` False: the raw text, with the special tokens ``tokenizer.json``'s post-processor adds, and
        the BOS token first when ``add_bos_token`` (and it is not there already). ``chat`` True: ``text`` as
        one user message in the chat template, with the assistant's turn opened (``add_generation_prompt``),
        tokenized as rendered (the template writes its own BOS). A ValueError naming ``chat`` when the
        checkpoint has no chat template."""
        check_text("text", text)
        if chat:
            rendered = self.apply_chat_template([{"role": "user", "content": text}])
            return self._encode(rendered, add_special_tokens=False)
        ids = self._encode(text, add_special_tokens=True)
        if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def _encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as error:  # the package raises Exception for what its model cannot encode
            raise ValueError(f"text: {self.directory / TOKENIZER} cannot encode it ({error})") from None

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """The chat template rendered over ``messages`` (``[{"role": ..., "content": ...}, ...]``) with
        ``bos_token`` and ``eos_token`` (the tokens' texts) and ``add_generation_prompt``."""
        if self._template is None:
            raise ValueError(
                f"chat: {self.directory} has no chat template ({CHAT_TEMPLATE}, or chat_template in "
                f"{TOKENIZER_CONFIG}); pass the prompt as raw text"
            )

        def token(i):
            return None if i is None else self.tokenizer.id_to_token(i)

        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=token(self.bos_token_id),
            eos_token=token(self.eos_token_ids[0] if self.eos_token_ids else None),
        )

    def decode(self, ids) -> str:
        """The text of the token ids ``ids``, special tokens left out."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def decode_stream(self) -> TextStream:
        """An incremental decoder of one generation's tokens (:class:`TextStream`)."""
        return TextStream(self)


class TextStream:
    """Text as tokens arrive: :meth:`push` gives the text the tokens so far complete (a character of several
    UTF-8 bytes split over tokens comes out once all its bytes are in; ``tokenizers``' ``DecodeStream``),
    :meth:`finish` the rest; the pieces joined are :meth:`TextTokenizer.decode` of all the tokens."""

    def __init__(self, tokenizer: TextTokenizer):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []
        self._text: list[str] = []

    def push(self, ids) -> str:
        """Add the token ids ``ids`` (a list of ints); the new text they complete (possibly empty)."""
        pieces = []
        for i in ids:
            piece = self._stream.step(self._tokenizer.tokenizer, i)
            if piece:
                pieces.append(piece)
        self._ids.extend(ids)
        self._text.extend(pieces)
        return "".join(pieces)

    def finish(self) -> str:
        """The text not yet given: the whole decode less what :meth:`push` gave (what an incomplete
        character at the end decodes to, U+FFFD)."""
        full, given = self._tokenizer.decode(self._ids), "".join(self._text)
        if not full.startswith(given):  # the decoder is not one tokens can be streamed through
            raise ValueError(f"the decoder of {self._tokenizer.directory / TOKENIZER} does not stream")
        self._text.append(full[len(given) :])
        return self._text[-1]


def check_text(name: str, text) -> str:
    """``text`` a str that is valid Unicode (no lone surrogate: what ``os.fsdecode`` makes of bytes that are
    not UTF-8), else TypeError / ValueError naming ``name``."""
    if not isinstance(text, str):
        raise TypeError(f"{name}: must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{name}: not valid Unicode text ({text[error.start : error.start + 1]!r} at {error.start}: "
            "bytes that are not UTF-8?)"
        ) from None
    return text


def load_tokenizer(path) -> TextTokenizer:
    """The tokenizer of the checkpoint directory ``path``: its ``tokenizer.json`` through the ``tokenizers``
    package, the BOS and EOS tokens and the chat template of its ``tokenizer_config.json``,
    ``chat_template.jinja`` and ``generation_config.json`` when present (module docstring).

    Raises ValueError naming the file (and the field) for a missing or unreadable ``tokenizer.json``, for
    a file that is not what it should be, a token named that the tokenizer does not have, or a chat
    template that does not parse."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path: must be a str or os.PathLike (a directory), got {type(path).__name__}")
    directory = pathlib.Path(path)
    file = directory / TOKENIZER
    try:
        spec = files.read_json(file, MAX_TOKENIZER_BYTES)
    except FileNotFoundError:
        raise ValueError(f"path: {directory} has no {TOKENIZER} (the checkpoint's tokenizer)") from None
    try:
        tokenizer = tokenizers.Tokenizer.from_str(json.dumps(spec))
    except Exception as error:  # the package raises Exception for any malformed tokenizer
        raise ValueError(f"{file}: not a tokenizer the tokenizers package reads ({error})") from None
    if tokenizer.get_vocab_size(with_added_tokens=True) == 0:
        raise ValueError(f"{file}: has no tokens (an empty vocabulary encodes nothing)")
    config = _optional_json(directory / TOKENIZER_CONFIG)
    if not isinstance(config, dict):
        raise ValueError(f"{directory / TOKENIZER_CONFIG}: must be a JSON object")
    bos = _token_id(tokenizer, config, directory / TOKENIZER_CONFIG, "bos_token")
    eos = _token_id(tokenizer, config, directory / TOKENIZER_CONFIG, "eos_token")
    add_bos = config.get("add_bos_token", False)
    if not isinstance(add_bos, bool):
        raise ValueError(f"{directory / TOKENIZER_CONFIG}: add_bos_token: must be a bool, got {add_bos!r}")
    generation = _optional_json(directory / GENERATION_CONFIG)
    if not isinstance(generation, dict):
        raise ValueError(f"{directory / GENERATION_CONFIG}: must be a JSON object")
    if generation.get("eos_token_id") is not None:
        eos_ids = _ids(tokenizer, generation["eos_token_id"], directory / GENERATION_CONFIG, "eos_token_id")
    else:
        eos_ids = () if eos is None else (eos,)
    source, template = _chat_template(directory, config)
    return TextTokenizer(
        tokenizer,
        bos,
        eos_ids,
        add_bos,
        source,
        directory,
        None if source is None else compile_template(source, template),
    )


def _optional_json(file: pathlib.Path):
    """The JSON value of ``file``, or ``{}`` where there is no such file."""
    try:
        return files.read_json(file, MAX_TEXT_BYTES)
    except FileNotFoundError:
        return {}


def _token_id(tokenizer, config: dict, file: pathlib.Path, field: str) -> int | None:
    """The id of the token ``config[field]`` names (its text, or ``{"content": text}``), None if unset."""
    token = config.get(field)
    if isinstance(token, dict):
        token = token.get("content")
    if token is None:
        return None
    if not isinstance(token, str):
        raise ValueError(f"{file}: {field}: must be a token's text, got {token!r}")
    i = tokenizer.token_to_id(token)
    if i is None:
        raise ValueError(f"{file}: {field}: {token!r} is not a token of {TOKENIZER}")
    return i


def _ids(tokenizer, value, file: pathlib.Path, field: str) -> tuple[int, ...]:
    """``value`` (an int or a list of ints) as token ids of ``tokenizer``."""
    return check_token_ids(value, tokenizer.get_vocab_size(with_added_tokens=True), f"{file}: {field}")


def _chat_template(directory: pathlib.Path, config: dict) -> tuple[str | None, pathlib.Path | None]:
    """The chat template's source and the file it is in (``(None, None)``: none shipped)."""
    file = directory / CHAT_TEMPLATE
    try:
        return files.read_text(file, MAX_TEXT_BYTES), file
    except FileNotFoundError:
        pass
    template, file = config.get("chat_template"), directory / TOKENIZER_CONFIG
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{file}: chat_template: must be a string or named templates, got {template!r}")
    return template, (None if template is None else file)
