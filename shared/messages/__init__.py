"""Every message that crosses the bus, in one module (`radixflow.shared.messages`, split into files
by who talks: service, requests, radix, programs), encoded one way (msgpack via msgspec).

Structs are tagged with their class name, so a reply can be decoded as `Reply | ErrorReply` and a
stream item as `StreamChunk | StreamError`. Field names are the wire contract: JSON Schemas of all
of them are generated into schemas/ (`radixflow schemas`) and a test fails when they drift.
"""
from __future__ import annotations

from . import programs, radix, requests, service
from .base import JSON, Msg, decode, decode_json, encode, encode_json
from .programs import *  # noqa: F401,F403
from .radix import *  # noqa: F401,F403
from .requests import *  # noqa: F401,F403
from .service import *  # noqa: F401,F403

ALL: tuple[type[Msg], ...] = tuple(
    v for m in (service, requests, radix, programs) for v in vars(m).values()
    if isinstance(v, type) and issubclass(v, Msg) and v is not Msg and v.__module__ == m.__name__
)

__all__ = ["ALL", "JSON", "Msg", "decode", "decode_json", "encode", "encode_json"] + [c.__name__ for c in ALL]
