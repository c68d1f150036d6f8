"""Bearer-token metadata on every call of a channel (a kvq-server with
--tokens_file): unary, streaming, retried, all through one interceptor."""

import collections

import grpc


class _Details(collections.namedtuple(
        "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                     "compression")), grpc.ClientCallDetails):
    pass


class BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds "authorization: Bearer <token>" to every call."""

    def __init__(self, token):
        if not token:
            raise ValueError("token must not be empty")
        self._header = ("authorization", "Bearer " + token)

    def _details(self, d):
        metadata = list(d.metadata or []) + [self._header]
        return _Details(d.method, d.timeout, metadata, d.credentials,
                        getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


def with_token(channel, token):
    """`channel` sending `token` on every call (the channel itself if no token)."""
    return grpc.intercept_channel(channel, BearerToken(token)) if token else channel
