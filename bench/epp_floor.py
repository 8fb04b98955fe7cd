"""The least an ext_proc endpoint picker in Python can cost: the floor under `hetgate epp`.

`python -m bench.epp_floor --endpoint HOST:PORT --grpc-port N --metrics-port M` serves Envoy's ext_proc
stream with grpc.aio as `hetgate epp` does and answers the same messages (gateway/epp/protocol.py), in
buffered or full-duplex mode: the whole body is answered with one fixed endpoint in the destination header
and `envoy.lb` metadata (full-duplex: the body is streamed back, as `hetgate epp` does), response headers
continue. No parsing, routing, accounting or metrics. It is to the
`envoy+epp` row of `hetgate bench overhead` what `bench/floor_proxy.py` is to the `hetgate` row: what is
left of the EPP's CPU per request once hetgate's own work is taken away, i.e. the cost of gRPC in Python.
`/health` on the metrics port answers 200 so the benchmark's harness can wait for it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator

import grpc
from aiohttp import web
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from gateway.epp import protocol

_FULL_DUPLEX = ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED


class FloorProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    async def Process(  # the gRPC method's name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        full_duplex = False
        parts: list[bytes] = []
        async for message in request_iterator:
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                full_duplex = message.protocol_config.request_body_mode == _FULL_DUPLEX
                if not full_duplex:
                    yield protocol.continue_headers()
            elif kind == "request_body":
                parts.append(message.request_body.body)
                if not message.request_body.end_of_stream:
                    continue  # full-duplex: Envoy holds the request until it is answered whole
                mutation = protocol.destination_mutation(self.endpoint, None)
                if not full_duplex:
                    yield protocol.routed_body(mutation, self.endpoint, None)
                    continue
                yield protocol.routed_headers(mutation, self.endpoint)
                for response in protocol.streamed_body(b"".join(parts)):
                    yield response
            elif kind == "request_trailers":
                yield protocol.request_trailers()
            elif kind == "response_headers":
                yield protocol.response_headers(None, strip_served=False)
            elif kind == "response_body":
                yield protocol.pass_response_body()


async def serve(endpoint: str, host: str, grpc_port: int, metrics_port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(FloorProcessor(endpoint), server)
    server.add_insecure_port(f"{host}:{grpc_port}")
    app = web.Application()
    app.router.add_get("/health", lambda _request: _ok())
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, metrics_port).start()
    await server.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1)
    await runner.cleanup()


async def _ok() -> web.Response:
    return web.Response(status=200)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.epp_floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", required=True, help="HOST:PORT every request is sent to")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True, help="serves /health only")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.endpoint, args.host, args.grpc_port, args.metrics_port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
