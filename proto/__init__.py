"""The lorabus wire contract: messages, subjects and codec."""

from proto import subjects
from proto.codec import DecodeError, decode, encode
from proto.messages import *  # noqa: F403
from proto.messages import SCHEMA_VERSION, adapter_name

__all__ = ["DecodeError", "SCHEMA_VERSION", "adapter_name", "decode", "encode", "subjects"]
