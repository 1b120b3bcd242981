"""Request bytes the protobuf parser refuses become `INVALID_ARGUMENT` naming the field, not `UNKNOWN`; fields the
server does not know are refused, not dropped.

1. `add_servicer` registers the `jaxinfer.v1.JaxInfer` methods with `tolerant_parser`s: a request that does not
   parse (a string field holding invalid UTF-8, such as an encoded lone surrogate; truncated bytes) or that holds
   a field this server's messages lack (a misspelt or newer client's) reaches the handler as a `MalformedRequest`
   instead of failing inside grpc or losing the field (a map of scalars, such as `sampling.logit_bias`, holds no
   message to look into).
2. `malformed_field` walks the raw bytes against the message's descriptor to name the string field that is not
   UTF-8 (`chat.messages[1].content`, `sampling.stop[0]`), so the handler's error names it; `unknown_field`
   names the message that holds a field it does not have.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import grpc
from google.protobuf import descriptor, message, unknown_fields

from jaxinfer.serving.v1 import jaxinfer_pb2 as pb

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


@dataclasses.dataclass(frozen=True)
class MalformedRequest:
    """A request whose bytes did not parse; `error` says why, naming the field where one is to blame."""

    error: str


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def malformed_field(data: bytes, desc: descriptor.Descriptor, prefix: str = "") -> str | None:
    """The path of the first string field in `data` (a serialized `desc` message) whose bytes are not UTF-8, e.g.
    `chat.messages[1].content`; None when every string is UTF-8 or the bytes do not parse as far as one."""
    counts: dict[int, int] = {}
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == _VARINT:
                _, pos = _varint(data, pos)
            elif wire_type in (_I64, _I32):
                pos += 8 if wire_type == _I64 else 4
            elif wire_type == _LEN:
                size, pos = _varint(data, pos)
                payload, pos = data[pos:pos + size], pos + size
                field = desc.fields_by_number.get(number)
                if field is None:
                    continue
                index = counts.get(number, 0)
                counts[number] = index + 1
                name = prefix + field.name + (f"[{index}]" if field.is_repeated else "")
                if field.type == field.TYPE_STRING:
                    try:
                        payload.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif field.type == field.TYPE_MESSAGE:
                    inner = malformed_field(payload, field.message_type, name + ".")
                    if inner is not None:
                        return inner
            else:
                return None
    except ValueError:
        return None
    return None


def unknown_field(msg: message.Message, path: str = "") -> str | None:
    """The error for the first field in `msg` (or a message inside it) that its type does not have, naming where
    (`chat.messages[1]`, `sampling`, or `request` at the top) and the type's fields; None when there is none."""
    unknown = unknown_fields.UnknownFieldSet(msg)
    if len(unknown):
        desc = msg.DESCRIPTOR
        return (f"{path or 'request'} has a field {desc.full_name} does not have (field number "
                f"{unknown[0].field_number}: the client's .proto may be newer than the server's, or not "
                f"jaxinfer.v1's); its fields are {', '.join(f.name for f in desc.fields)}")
    for field, value in msg.ListFields():
        if field.type != field.TYPE_MESSAGE:
            continue
        name = path + ("." if path else "") + field.name
        if field.message_type.GetOptions().map_entry:  # a map: its values, when they are messages
            if field.message_type.fields_by_name["value"].type != field.TYPE_MESSAGE:
                continue
            inners = ((f"{name}[{key!r}]", inner) for key, inner in value.items())
        else:
            inners = ((f"{name}[{i}]", inner) for i, inner in enumerate(value)) if field.is_repeated else \
                ((name, value),)
        for where, inner in inners:
            error = unknown_field(inner, where)
            if error is not None:
                return error
    return None


def tolerant_parser(cls: type[message.Message]) -> Callable[[bytes], message.Message | MalformedRequest]:
    """`cls.FromString`, except that bytes which do not parse, or hold a field that is not `cls`'s (or not its
    messages'), give a `MalformedRequest`."""

    def parse(data: bytes) -> message.Message | MalformedRequest:
        try:
            parsed = cls.FromString(data)
            error = unknown_field(parsed)
            return parsed if error is None else MalformedRequest(error)
        except message.DecodeError:
            field = malformed_field(data, cls.DESCRIPTOR)
            if field is not None:
                return MalformedRequest(f"{field} is not valid UTF-8 text (string fields must be UTF-8; a lone "
                                        "surrogate cannot be encoded)")
            return MalformedRequest(f"the request is not a valid {cls.DESCRIPTOR.full_name} message")

    return parse


def add_servicer(servicer: object, server: grpc.aio.Server) -> None:
    """Registers `servicer`'s `jaxinfer.v1.JaxInfer` methods on `server` with `tolerant_parser` request parsers
    (as the generated `add_JaxInferServicer_to_server` does with strict ones)."""
    service = pb.DESCRIPTOR.services_by_name["JaxInfer"]
    handlers = {}
    for method in service.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(getattr(servicer, method.name), request_deserializer=tolerant_parser(request_cls),
                                     response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
