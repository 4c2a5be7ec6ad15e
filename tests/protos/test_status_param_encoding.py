"""The blamed parameter travels as printable ASCII metadata, whatever name the caller used."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from protos.status import abort, param_of


@pytest.mark.parametrize("param", ["size", "chunk.hidden_states", "stylé", "\x00odd\nname", "\ud800"[:0] + "ключ", "a b/c%"])
def test_param_round_trips_through_a_real_call(param):
    def handler(request, context):
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, "bad", param)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("t.T", {"M": grpc.unary_unary_rpc_method_handler(handler)}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary("/t.T/M")(b"", timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert param_of(info.value) == param
    finally:
        server.stop(0)
