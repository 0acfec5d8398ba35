"""Reading a checkpoint's small files (configs, indexes, tokenizers, templates) safely: a regular file only
(never a FIFO, a device or a socket, whose reads can block or never end), at most a stated number of bytes,
and a ValueError naming the file for anything else (FileNotFoundError where it does not exist, so that a
caller can treat an optional file as absent)."""

from __future__ import annotations

import json
import os
import pathlib
import stat


def regular_file(file: pathlib.Path, status: os.stat_result | None = None) -> os.stat_result:
    """The status of ``file`` (``status``: one already taken, e.g. of an open descriptor), which must be a
    regular file (symlinks followed): a ValueError naming it otherwise."""
    if status is None:
        try:
            status = os.stat(file)
        except FileNotFoundError:
            raise
        except OSError as error:
            raise ValueError(f"{file}: cannot be read ({error})") from None
    if not stat.S_ISREG(status.st_mode):
        raise ValueError(f"{file}: not a regular file (a FIFO, a device or a directory is not read)")
    return status


def read_bytes(file: pathlib.Path, limit: int) -> bytes:
    """The bytes of ``file``, a regular file of at most ``limit`` bytes (checked before the read and by the
    read itself: a file that grows is not read past ``limit + 1`` bytes)."""
    if regular_file(file).st_size > limit:
        raise ValueError(f"{file}: more than {limit} bytes (at most that is read)")
    try:  # non-blocking: a FIFO swapped in since the stat is not waited on (its fstat refuses it)
        descriptor = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as error:
        raise ValueError(f"{file}: cannot be read ({error})") from None
    with open(descriptor, "rb") as stream:
        regular_file(file, os.fstat(descriptor))
        data = stream.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{file}: more than {limit} bytes (at most that is read)")
    return data


def read_text(file: pathlib.Path, limit: int) -> str:
    """The UTF-8 text of ``file`` (:func:`read_bytes`)."""
    try:
        return read_bytes(file, limit).decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{file}: not UTF-8 text ({error})") from None


def read_json(file: pathlib.Path, limit: int):
    """The JSON value of ``file`` (:func:`read_bytes`)."""
    data = read_bytes(file, limit)
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError(f"{file}: not a readable JSON file (nested too deeply)") from None
    except ValueError as error:  # not JSON, not UTF-8, or an integer of more digits than Python converts
        raise ValueError(f"{file}: not a readable JSON file ({error})") from None
