"""The base of every bus message and its one encoding (msgpack via msgspec)."""
from __future__ import annotations

from typing import Any

import msgspec


class Msg(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """Base of every bus message."""


_encoder = msgspec.msgpack.Encoder()


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


_decoders: dict[Any, msgspec.msgpack.Decoder] = {}


def decode(data: bytes, typ: Any) -> Any:
    """Decode `data` as `typ` (a Msg class or a Union of them); decoders are cached per type."""
    dec = _decoders.get(typ)
    if dec is None:
        dec = _decoders[typ] = msgspec.msgpack.Decoder(typ)
    return dec.decode(data)


# The public NATS API also speaks JSON (a request with header Content-Type: application/json is
# answered, and streamed to, in JSON); the tag field is "type" with the class name, as in msgpack.
JSON = "application/json"
_json_encoder = msgspec.json.Encoder()


def encode_json(msg: Msg) -> bytes:
    return _json_encoder.encode(msg)


def decode_json(data: bytes, typ: Any) -> Any:
    return msgspec.json.decode(data, type=typ)
