"""Requests whose bytes are not a valid message: INVALID_ARGUMENT, not grpc.aio's UNKNOWN.

grpc.aio turns an exception raised by a request deserializer into UNKNOWN ("Unexpected
DecodeError"), which a client cannot tell from a server bug. This interceptor wraps our service's
deserializers so that a DecodeError becomes a `Malformed` marker, and the method answers it with
INVALID_ARGUMENT naming the message type before the servicer sees it. The bidirectional streams
(VerifyStream, VerifyRounds) are the exception: wrapping their request and response iterators
costs two async-generator hops per message on the server's hot path, so their requests pass
through with the Malformed markers in them and the servicer refuses the first one (`refuse`, the
same answer)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from .. import rpc

GUARDED_PREFIX = f"/{rpc.SERVICE_NAME}/"


@dataclass(frozen=True)
class Malformed:
    error: str


class MalformedRequestGuard(grpc.aio.ServerInterceptor):
    def __init__(self):
        # method -> (the handler it wraps, the guarded handler): built once per method, not per
        # call (the service's handlers do not change while it serves)
        self._guarded: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(GUARDED_PREFIX) or handler.request_deserializer is None:
            return handler
        wrapped, guarded = self._guarded.get(method, (None, None))
        if wrapped is not handler:
            guarded = _guarded(handler, method)
            self._guarded[method] = (handler, guarded)
        return guarded


async def refuse(context, method: str, bad: Malformed) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request to {method} is not a valid message: {bad.error}")


def _guarded(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    decode = handler.request_deserializer

    def deserialize(data: bytes):
        try:
            return decode(data)
        except DecodeError as exc:
            return Malformed(str(exc))

    async def checked(request_iterator, context):
        async for request in request_iterator:
            if isinstance(request, Malformed):
                await refuse(context, method, request)
            yield request

    streaming_in, streaming_out = handler.request_streaming, handler.response_streaming
    behavior = {(False, False): handler.unary_unary, (False, True): handler.unary_stream,
                (True, False): handler.stream_unary, (True, True): handler.stream_stream}[(streaming_in, streaming_out)]

    if not streaming_in and not streaming_out:
        async def run(request, context):
            if isinstance(request, Malformed):
                await refuse(context, method, request)
            return await behavior(request, context)
        make = grpc.unary_unary_rpc_method_handler
    elif not streaming_in:
        async def run(request, context):
            if isinstance(request, Malformed):
                await refuse(context, method, request)
            async for response in behavior(request, context):
                yield response
        make = grpc.unary_stream_rpc_method_handler
    elif not streaming_out:
        async def run(request_iterator, context):
            return await behavior(checked(request_iterator, context), context)
        make = grpc.stream_unary_rpc_method_handler
    else:  # the servicer refuses Malformed requests itself (see the module docstring)
        run, make = behavior, grpc.stream_stream_rpc_method_handler
    return make(run, request_deserializer=deserialize, response_serializer=handler.response_serializer)
