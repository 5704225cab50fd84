"""Optional bearer-token auth: a server interceptor that answers UNAUTHENTICATED unless the call
carries metadata "authorization: Bearer <token>" with one of the server's tokens (each names a
principal: verifier/server/principals.py). Health checks are exempt, so a load balancer can probe
without a secret. A refused call's request bytes are never parsed."""

from __future__ import annotations

import grpc

from .principals import Principals

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


class BearerTokenAuth(grpc.aio.ServerInterceptor):
    def __init__(self, principals: Principals):
        self._principals = principals

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(EXEMPT_PREFIXES):
            return await continuation(handler_call_details)
        given = [value for key, value in (handler_call_details.invocation_metadata or ()) if key == "authorization"]
        if len(given) == 1 and self._principals.of_authorization(_as_bytes(given[0])) is not None:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: let grpc answer UNIMPLEMENTED
            return None
        message = "authorization metadata is missing" if not given else "authorization metadata does not carry a token this server knows"
        return _refusal(handler, message)


def _as_bytes(value) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _ignored(_: bytes) -> None:
    """The refusal's request deserializer: an unauthenticated request's bytes are never parsed."""
    return None


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with UNAUTHENTICATED, its
    request bytes left unparsed (a large unauthenticated message costs no parse and no copy)."""

    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{message} (send 'authorization: Bearer <token>')")

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=_ignored, response_serializer=handler.response_serializer)
