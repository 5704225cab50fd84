"""The wire protocol (proto/verifier/v1/verifier.proto) as Python: protoc's generated message classes
and client stub (verifier/v1/, typed by verifier_pb2.pyi), re-exported here with the servicer glue.

    from verifier import rpc
    stub = rpc.VerifierStub(grpc.insecure_channel(address))      # or a grpc.aio channel
    info = stub.GetModelInfo(rpc.GetModelInfoRequest())
    server.add_generic_rpc_handlers([rpc.servicer_handler(my_servicer)])  # sync or grpc.aio server

Importing this module needs only grpcio and protobuf (no torch): the drafter side uses it too.
"""

from __future__ import annotations

import grpc

from ..v1 import verifier_pb2, verifier_pb2_grpc
from ..v1.verifier_pb2 import (CloseSessionRequest, CloseSessionResponse, GetModelInfoRequest, GetStatsRequest,
                               Histogram, Logits, ModelInfo, OpenSessionRequest, OpenSessionResponse, Sampling,
                               Stats, Status, StepResult, VerifyRequest, VerifyResponse, VerifyStep)
from ..v1.verifier_pb2_grpc import VerifierStub

__all__ = [
    "CloseSessionRequest", "CloseSessionResponse", "GetModelInfoRequest", "GetStatsRequest", "Histogram", "Logits",
    "ModelInfo", "OpenSessionRequest", "OpenSessionResponse", "Sampling", "Stats", "Status", "StepResult",
    "VerifyRequest", "VerifyResponse", "VerifyStep", "VerifierStub", "servicer_handler",
    "FINISH_NONE", "FINISH_EOS", "FINISH_LENGTH", "FILE", "SERVICE", "PACKAGE", "SERVICE_NAME", "PROTOCOL_VERSION",
    "RETRY_AFTER_KEY",
]

FILE = verifier_pb2.DESCRIPTOR  # registered in the default pool as "verifier/v1/verifier.proto": reflection finds it
SERVICE = FILE.services_by_name["Verifier"]
PACKAGE = FILE.package  # "verifier.v1"
SERVICE_NAME = SERVICE.full_name  # "verifier.v1.Verifier"
PROTOCOL_VERSION = PACKAGE
RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata on RESOURCE_EXHAUSTED from OpenSession

FINISH_NONE = verifier_pb2.FINISH_REASON_UNSPECIFIED
FINISH_EOS = verifier_pb2.FINISH_REASON_EOS
FINISH_LENGTH = verifier_pb2.FINISH_REASON_LENGTH


class _HandlerCollector:
    """Stands in for a server so that the generated add_VerifierServicer_to_server hands us its handler."""

    def __init__(self) -> None:
        self.handlers: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.handlers.extend(handlers)


def servicer_handler(servicer) -> grpc.GenericRpcHandler:
    """The generic handler serving `servicer`, an object with one method per RPC (sync or async,
    signature `(request_or_iterator, context)`), for grpc.server or grpc.aio.server."""
    missing = [method.name for method in SERVICE.methods if not callable(getattr(servicer, method.name, None))]
    if missing:  # the generated code would fail on the first with a bare AttributeError
        raise TypeError(f"{type(servicer).__name__} does not implement {', '.join(missing)}")
    collector = _HandlerCollector()
    verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, collector)
    (handler,) = collector.handlers
    return handler
