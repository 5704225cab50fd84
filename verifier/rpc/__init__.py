"""The wire protocol (proto/verifier/v1/verifier.proto) as Python: message classes, a client stub and
the servicer glue, built at import from the committed descriptor set (see build.py for why).

    from verifier import rpc
    stub = rpc.VerifierStub(grpc.insecure_channel(address))      # or a grpc.aio channel
    info = stub.GetModelInfo(rpc.GetModelInfoRequest())
    server.add_generic_rpc_handlers([rpc.servicer_handler(my_servicer)])  # sync or grpc.aio server

Importing this module needs only grpcio and protobuf (no torch): the drafter side uses it too.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from .descriptor_set import DESCRIPTOR_SET

PACKAGE = "verifier.v1"
SERVICE_NAME = f"{PACKAGE}.Verifier"
PROTOCOL_VERSION = PACKAGE
RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata on RESOURCE_EXHAUSTED from OpenSession


def _load_files() -> None:
    pool = descriptor_pool.Default()  # the default pool: server reflection finds our files there
    for file in descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTOR_SET).file:
        try:
            pool.FindFileByName(file.name)
        except KeyError:
            pool.Add(file)


def _message_class(descriptor):
    if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22
        return message_factory.GetMessageClass(descriptor)
    return message_factory.MessageFactory(descriptor_pool.Default()).GetPrototype(descriptor)


_load_files()
FILE = descriptor_pool.Default().FindFileByName("verifier/v1/verifier.proto")
SERVICE = FILE.services_by_name["Verifier"]

GetModelInfoRequest = _message_class(FILE.message_types_by_name["GetModelInfoRequest"])
ModelInfo = _message_class(FILE.message_types_by_name["ModelInfo"])
OpenSessionRequest = _message_class(FILE.message_types_by_name["OpenSessionRequest"])
OpenSessionResponse = _message_class(FILE.message_types_by_name["OpenSessionResponse"])
VerifyStep = _message_class(FILE.message_types_by_name["VerifyStep"])
StepResult = _message_class(FILE.message_types_by_name["StepResult"])
VerifyRequest = _message_class(FILE.message_types_by_name["VerifyRequest"])
VerifyResponse = _message_class(FILE.message_types_by_name["VerifyResponse"])
CloseSessionRequest = _message_class(FILE.message_types_by_name["CloseSessionRequest"])
CloseSessionResponse = _message_class(FILE.message_types_by_name["CloseSessionResponse"])
GetStatsRequest = _message_class(FILE.message_types_by_name["GetStatsRequest"])
Stats = _message_class(FILE.message_types_by_name["Stats"])
Histogram = _message_class(FILE.message_types_by_name["Histogram"])
Status = _message_class(FILE.message_types_by_name["Status"])
Logits = _message_class(FILE.message_types_by_name["Logits"])
Sampling = _message_class(FILE.message_types_by_name["Sampling"])

FINISH_NONE = FILE.enum_types_by_name["FinishReason"].values_by_name["FINISH_REASON_UNSPECIFIED"].number
FINISH_EOS = FILE.enum_types_by_name["FinishReason"].values_by_name["FINISH_REASON_EOS"].number
FINISH_LENGTH = FILE.enum_types_by_name["FinishReason"].values_by_name["FINISH_REASON_LENGTH"].number


def _method_kind(method) -> tuple[bool, bool]:
    """(client streaming, server streaming) of a service method."""
    proto = descriptor_pb2.MethodDescriptorProto()
    method.CopyToProto(proto)
    return proto.client_streaming, proto.server_streaming


def _path(method) -> str:
    return f"/{SERVICE_NAME}/{method.name}"


class VerifierStub:
    """Client stub over a grpc.Channel or grpc.aio.Channel: one attribute per RPC, as protoc's stubs have."""

    def __init__(self, channel):
        for method in SERVICE.methods:
            request, response = _message_class(method.input_type), _message_class(method.output_type)
            client_stream, server_stream = _method_kind(method)
            factory = {
                (False, False): channel.unary_unary,
                (False, True): channel.unary_stream,
                (True, False): channel.stream_unary,
                (True, True): channel.stream_stream,
            }[(client_stream, server_stream)]
            setattr(self, method.name, factory(_path(method), request_serializer=request.SerializeToString,
                                               response_deserializer=response.FromString))


def servicer_handler(servicer) -> grpc.GenericRpcHandler:
    """The generic handler serving `servicer`, an object with one method per RPC (sync or async,
    signature `(request_or_iterator, context)`), for grpc.server or grpc.aio.server."""
    handlers = {}
    for method in SERVICE.methods:
        implementation = getattr(servicer, method.name, None)
        if implementation is None:
            raise TypeError(f"{type(servicer).__name__} does not implement {method.name}")
        request, response = _message_class(method.input_type), _message_class(method.output_type)
        client_stream, server_stream = _method_kind(method)
        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(client_stream, server_stream)]
        handlers[method.name] = make(implementation, request_deserializer=request.FromString,
                                     response_serializer=response.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
