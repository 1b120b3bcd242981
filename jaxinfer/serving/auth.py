"""The API key (`jaxinfer serve --api-key`), one check for both front ends.

HTTP: every `/v1` route needs the header `Authorization: Bearer <key>` (`jaxinfer.serving.openai.app`). gRPC: every
call of the jaxinfer service needs the metadata `authorization: Bearer <key>`, else it ends `UNAUTHENTICATED`
(`ApiKeyInterceptor`); the health and reflection services stay open, as `/health` does over HTTP, so that probes
and load balancers need no key. The scheme name is case-insensitive (RFC 9110 section 11.1); the key is compared in
constant time.
"""

from __future__ import annotations

import hmac

import grpc

UNAUTHENTICATED_DETAILS = "missing or wrong API key: send the metadata 'authorization: Bearer <key>'"


def bearer_matches(header: str | None, api_key: str) -> bool:
    """Whether an `Authorization` header value carries `api_key` as a bearer token ("Bearer", any case)."""
    if not header:
        return False
    scheme, _, token = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls of the methods under `service` (a full service name, e.g. "jaxinfer.v1.JaxInfer") whose
    metadata lacks `authorization: Bearer <api_key>`, with `UNAUTHENTICATED`; other services pass untouched."""

    def __init__(self, api_key: str, service: str) -> None:
        self._api_key, self._prefix = api_key, f"/{service}/"

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefix):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if bearer_matches(metadata.get("authorization"), self._api_key):
            return handler

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)

        async def deny_stream(request, context):
            await deny(request, context)
            yield  # never reached: abort raises; the yield makes this a streaming handler

        kinds = {"unary_unary": (grpc.unary_unary_rpc_method_handler, deny),
                 "unary_stream": (grpc.unary_stream_rpc_method_handler, deny_stream)}
        for kind, (make, fn) in kinds.items():
            if getattr(handler, kind) is not None:
                return make(fn, request_deserializer=handler.request_deserializer,
                            response_serializer=handler.response_serializer)
        raise ValueError(f"{handler_call_details.method}: only unary requests can be checked for an API key")
