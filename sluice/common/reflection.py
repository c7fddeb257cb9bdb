"""Server reflection under both names clients use: `grpc.reflection.v1alpha` (what
grpcio-reflection serves) and `grpc.reflection.v1` (what newer clients ask first: grpcurl,
Postman, grpc-js-reflection-client's "v1").

    enable_reflection(names, server)
        v1alpha: grpcio-reflection's own aio servicer
        v1:      the same servicer object under the v1 service name; the two protos differ
                 only in their package, so the v1alpha message classes read and write v1 bytes
        the v1 file descriptor joins the default pool, so a client can reflect on v1 itself

NOTE: grpcio-reflection 1.85 ships only v1alpha (a v1 call answered UNIMPLEMENTED). When a
release ships v1, `V1_FILE` is already in the pool and nothing is registered twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer

V1ALPHA_SERVICE = reflection.SERVICE_NAME
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"


def _add_v1_descriptor() -> None:
    """The v1alpha file renamed into the v1 package, added to the default pool once."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old = reflection_pb2.DESCRIPTOR.package
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    _rename_types(proto.message_type, f".{old}.", f".{V1_PACKAGE}.")
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(f".{old}.", f".{V1_PACKAGE}.")
            method.output_type = method.output_type.replace(f".{old}.", f".{V1_PACKAGE}.")
    pool.AddSerializedFile(proto.SerializeToString())


def _rename_types(messages: Sequence[descriptor_pb2.DescriptorProto], old: str, new: str) -> None:
    for message in messages:
        for f in message.field:
            if f.type_name:  # assigning even "" would mark a scalar field as typed
                f.type_name = f.type_name.replace(old, new)
        _rename_types(message.nested_type, old, new)


def enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Reflection for `service_names` plus both reflection services themselves."""
    _add_v1_descriptor()
    names = (*service_names, V1ALPHA_SERVICE, V1_SERVICE)
    servicer = ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(V1ALPHA_SERVICE, {"ServerReflectionInfo": handler}),
            grpc.method_handlers_generic_handler(V1_SERVICE, {"ServerReflectionInfo": handler}),
        )
    )
