"""Encoding and decoding with the checks every receiver needs.

`decode` raises `DecodeError` whose `reason` is one of the dead-letter reasons, so a service
can route any bad message to its dead-letter subject without inspecting the exception text.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar, get_args, overload

import msgspec

from proto.messages import SCHEMA_VERSION, DeadLetterReason

T = TypeVar("T")

MAX_MESSAGE_BYTES = 1024 * 1024
"""NATS' default max_payload; the server would refuse a larger publish anyway."""

SUPPORTED_MAJOR = int(SCHEMA_VERSION.split(".")[0])

_encoder = msgspec.json.Encoder()


class DecodeError(ValueError):
    def __init__(self, reason: DeadLetterReason, message: str):
        super().__init__(message)
        self.reason = reason


class _Envelope(msgspec.Struct):
    schema_version: str = ""


_envelope = msgspec.json.Decoder(_Envelope)
_decoders: dict[Any, msgspec.json.Decoder] = {}


def encode(message: msgspec.Struct) -> bytes:
    data = _encoder.encode(message)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(
            f"{type(message).__name__}: encoded size {len(data)} bytes exceeds "
            f"{MAX_MESSAGE_BYTES}; large tensors go through the object store, not the bus"
        )
    return data


def check_schema_version(version: str) -> None:
    major, _, _ = version.partition(".")
    if not major.isdigit():
        raise DecodeError(
            "schema-version",
            f"schema_version: {version!r} is not of the form MAJOR.MINOR; the sender must "
            f"set it, e.g. {SCHEMA_VERSION!r}",
        )
    if int(major) != SUPPORTED_MAJOR:
        raise DecodeError(
            "schema-version",
            f"schema_version: major version {major} is not supported (this build speaks "
            f"{SUPPORTED_MAJOR}.x); upgrade the receiver or the sender so they agree",
        )


def max_bytes_of(type_: Any) -> int:
    """The size cap of a message type (`Message.max_bytes`; a union's largest member's)."""
    cap = _caps.get(type_)
    if cap is None:
        members = get_args(type_) or (type_,)
        caps = [getattr(t, "max_bytes", MAX_MESSAGE_BYTES) for t in members]
        cap = _caps[type_] = min(max(caps), MAX_MESSAGE_BYTES)
    return cap


_caps: dict[Any, int] = {}
VERSION_FIRST = re.compile(rb'\{(?:"[^"\\]*":"[^"\\]*",)?"schema_version":"')
"""how every message `encode` makes begins: `Message`'s first field is its version, after the
tag of a union's member (`{"kind":"grant",...`); bytes that match surely carry a version"""


# A tagged union (e.g. `RolloutReport`) is not a `type[T]` to mypy: it decodes to Any.
@overload
def decode(data: bytes, type_: type[T], *, max_bytes: int | None = None) -> T: ...
@overload
def decode(data: bytes, type_: Any, *, max_bytes: int | None = None) -> Any: ...
def decode(data: bytes, type_: type[T] | Any, *, max_bytes: int | None = None) -> T:
    """Decode `data` as `type_` (a Struct or a tagged Union of Structs), refusing anything
    larger than the type's cap before parsing it."""
    max_bytes = max_bytes_of(type_) if max_bytes is None else max_bytes
    if len(data) > max_bytes:
        raise DecodeError("too-large", f"message of {len(data)} bytes exceeds {max_bytes}")
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders[type_] = msgspec.json.Decoder(type_)
    if VERSION_FIRST.match(data):
        # The version is one of the top-level object's first two keys, so it is there: one pass over the
        # bytes, the version checked after. Anything wrong is read again below, where the
        # envelope comes first, for the same error as ever.
        try:
            message = decoder.decode(data)
            check_schema_version(message.schema_version)
            return message
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError, DecodeError, AttributeError):
            pass
    try:
        envelope = _envelope.decode(data)
    except msgspec.ValidationError as exc:
        raise DecodeError("validation", str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise DecodeError("decode", f"not valid JSON: {exc}") from exc
    except RecursionError:  # nesting deeper than the decoder's stack: not a message
        raise DecodeError("decode", "nested too deeply to decode") from None
    if not envelope.schema_version:
        raise DecodeError(
            "schema-version",
            f"schema_version: missing; every lorabus message carries one (this build speaks "
            f"{SUPPORTED_MAJOR}.x): encode with proto.codec.encode or add "
            f'"schema_version": "{SCHEMA_VERSION}"',
        )
    check_schema_version(envelope.schema_version)
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise DecodeError("validation", str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise DecodeError("decode", str(exc)) from exc
    except RecursionError:
        raise DecodeError("decode", "nested too deeply to decode") from None
