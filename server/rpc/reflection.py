"""gRPC server reflection under both protocol names: ``grpc.reflection.v1`` (what current clients
such as grpcurl ask for first) and ``grpc.reflection.v1alpha`` (older clients).

grpcio-reflection (1.85) implements only v1alpha. The v1 protocol has the same messages, field for
field, under another package, so the bytes on the wire are the same: the v1 service here is the
same servicer behind a second method path. Its file descriptor is made from v1alpha's with the
package renamed, so a client can describe the v1 service as well as list it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1_SERVICE = "grpc.reflection.v1.ServerReflection"
V1ALPHA_SERVICE = reflection.SERVICE_NAME
_V1_FILE = "grpc/reflection/v1/reflection.proto"
_ALPHA_PACKAGE = "." + reflection_pb2.DESCRIPTOR.package  # ".grpc.reflection.v1alpha"


def _renamed(type_name: str) -> str:
    if type_name.startswith(_ALPHA_PACKAGE + "."):
        return ".grpc.reflection.v1" + type_name[len(_ALPHA_PACKAGE) :]
    return type_name


def _fix_types(messages: Iterable[descriptor_pb2.DescriptorProto]) -> None:
    for m in messages:
        for field in m.field:
            if field.type_name:
                field.type_name = _renamed(field.type_name)
        _fix_types(m.nested_type)


def add_v1_descriptor(pool: Any = None) -> None:
    """Add ``grpc/reflection/v1/reflection.proto`` to ``pool`` (default: the default pool), once."""
    pool = descriptor_pool.Default() if pool is None else pool
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name, fdp.package = _V1_FILE, "grpc.reflection.v1"
    fdp.ClearField("options")  # v1alpha's java/go package names
    _fix_types(fdp.message_type)
    for service in fdp.service:
        for method in service.method:
            method.input_type, method.output_type = _renamed(method.input_type), _renamed(method.output_type)
    pool.AddSerializedFile(fdp.SerializeToString())


def enable_server_reflection(service_names: Iterable[str], server: grpc.Server) -> tuple[str, ...]:
    """Serve reflection for ``service_names`` and both reflection services on ``server``; returns
    the names listed to clients."""
    add_v1_descriptor()
    names = (*service_names, V1_SERVICE, V1ALPHA_SERVICE)
    servicer = reflection.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.method_handlers_generic_handler(
        V1_SERVICE,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((v1,))
    return names
