"""The wire protocol (proto/verifier/v1/verifier.proto) as Python: protoc's generated message classes
(verifier/v1/, typed by verifier_pb2.pyi), re-exported here, and the client stub and servicer handler,
both built from the service's descriptor (one RPC's path, kind and message classes have one source: the
proto), so no generated service code is committed.

    from verifier import rpc
    stub = rpc.VerifierStub(grpc.insecure_channel(address))      # or a grpc.aio channel
    info = stub.GetModelInfo(rpc.GetModelInfoRequest())
    server.add_generic_rpc_handlers([rpc.servicer_handler(my_servicer)])  # sync or grpc.aio server

Importing this module needs only grpcio and protobuf (no torch): the drafter side uses it too.
"""

from __future__ import annotations

import grpc

from ..v1 import verifier_pb2
from ..v1.verifier_pb2 import (CloseSessionRequest, CloseSessionResponse, GenerateEvent, GenerateRequest, GetModelInfoRequest,
                               GetStatsRequest, Histogram, Logits, ModelInfo, OpenSessionRequest, OpenSessionResponse, Sampling,
                               Stats, Status, StepResult, VerifyRequest, VerifyResponse, VerifyStep)

__all__ = [
    "CloseSessionRequest", "CloseSessionResponse", "GenerateEvent", "GenerateRequest", "GetModelInfoRequest", "GetStatsRequest", "Histogram", "Logits",
    "ModelInfo", "OpenSessionRequest", "OpenSessionResponse", "Sampling", "Stats", "Status", "StepResult",
    "VerifyRequest", "VerifyResponse", "VerifyStep", "VerifierStub", "servicer_handler",
    "FINISH_NONE", "FINISH_EOS", "FINISH_LENGTH", "FILE", "SERVICE", "PACKAGE", "SERVICE_NAME", "PROTOCOL_VERSION",
    "RETRY_AFTER_KEY", "STOPPING_KEY",
]

FILE = verifier_pb2.DESCRIPTOR  # registered in the default pool as "verifier/v1/verifier.proto": reflection finds it
SERVICE = FILE.services_by_name["Verifier"]
PACKAGE = FILE.package  # "verifier.v1"
SERVICE_NAME = SERVICE.full_name  # "verifier.v1.Verifier"
PROTOCOL_VERSION = PACKAGE
RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata on RESOURCE_EXHAUSTED from OpenSession
# trailing metadata ("1") on an UNAVAILABLE the server itself ends a call with because it drains or
# stops: the server was reached and said so (gRPC's own UNAVAILABLE means it could not be reached)
STOPPING_KEY = "verifier-stopping"

FINISH_NONE = verifier_pb2.FINISH_REASON_UNSPECIFIED
FINISH_EOS = verifier_pb2.FINISH_REASON_EOS
FINISH_LENGTH = verifier_pb2.FINISH_REASON_LENGTH


# A method's (client_streaming, server_streaming) -> the stem of grpc's names for its kind:
# channel.<stem> makes the client's callable, grpc.<stem>_rpc_method_handler the server's handler.
_KINDS = {(False, False): "unary_unary", (False, True): "unary_stream",
          (True, False): "stream_unary", (True, True): "stream_stream"}


def _kind(method) -> str:
    return _KINDS[(method.client_streaming, method.server_streaming)]


def _message_class(descriptor) -> type:
    """The generated class of a message type the service names (every one is top-level in the proto)."""
    cls = getattr(verifier_pb2, descriptor.name)
    assert cls.DESCRIPTOR is descriptor, descriptor.full_name
    return cls


class VerifierStub:
    """The client of the Verifier service: one attribute per RPC, named as in the proto (`stub.Verify`), the
    multi-callable that `channel` (a grpc.Channel or a grpc.aio.Channel) makes for the method's kind at
    its path "/verifier.v1.Verifier/<Method>"."""

    def __init__(self, channel) -> None:
        for method in SERVICE.methods:
            make = getattr(channel, _kind(method))
            setattr(self, method.name, make(f"/{SERVICE.full_name}/{method.name}",
                                            request_serializer=_message_class(method.input_type).SerializeToString,
                                            response_deserializer=_message_class(method.output_type).FromString))


def servicer_handler(servicer) -> grpc.GenericRpcHandler:
    """The generic handler serving `servicer`, an object with one method per RPC (sync or async,
    signature `(request_or_iterator, context)`), for grpc.server or grpc.aio.server. A method the
    service does not have is answered UNIMPLEMENTED by grpc."""
    missing = [method.name for method in SERVICE.methods if not callable(getattr(servicer, method.name, None))]
    if missing:  # refused here, not on the first call that reaches one
        raise TypeError(f"{type(servicer).__name__} does not implement {', '.join(missing)}")
    handlers = {method.name: getattr(grpc, f"{_kind(method)}_rpc_method_handler")(
        getattr(servicer, method.name),
        request_deserializer=_message_class(method.input_type).FromString,
        response_serializer=_message_class(method.output_type).SerializeToString) for method in SERVICE.methods}
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)
