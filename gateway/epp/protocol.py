"""The Endpoint Picker protocol's names and the ext_proc messages hetgate answers with.

From the Gateway API Inference Extension's EPP protocol (proposal 004):
- request, EPP -> proxy: header `x-gateway-destination-endpoint` = `ip:port[,ip:port...]` (best first, the
  rest are fallbacks the proxy tries in order) and the same value in dynamic metadata `envoy.lb`;
- request, proxy -> EPP: an optional subset the EPP must pick from, in filter metadata
  `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset` (a list of `ip:port`);
- response, proxy -> EPP: the endpoint that served, `envoy.lb` / `x-gateway-destination-endpoint-served`
  in the metadata context (hetgate also reads it as a response header, which plain Envoy can add with
  `%UPSTREAM_REMOTE_ADDRESS%`, and removes that header before the client sees it);
- no endpoint: an immediate 503; a shed request: an immediate 429 (hetgate's bodies are OpenAI errors).
Pure functions over protobuf messages; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

from gateway.errors import GatewayError

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
ROUTE_HEADER = "x-hetgate-route"

# Envoy recommends body chunks of at most 64 KiB in full-duplex streamed mode.
CHUNK = 64 * 1024
_OVERWRITE = HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD


def header_map(message: pb.HttpHeaders) -> dict[str, bytes]:
    """Lower-case header names to raw values (Envoy sends `raw_value`; older versions `value`)."""
    return {h.key: h.raw_value or h.value.encode() for h in message.headers.headers}


def _set(key: str, value: bytes) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value), append_action=_OVERWRITE)


def destination_mutation(endpoints: str, content_length: int | None) -> pb.HeaderMutation:
    """The picked endpoints, and the new content-length when the body was rewritten."""
    headers = [_set(DESTINATION, endpoints.encode())]
    if content_length is not None:
        headers.append(_set("content-length", str(content_length).encode()))
    return pb.HeaderMutation(set_headers=headers)


def destination_metadata(endpoints: str) -> Struct:
    metadata = Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: endpoints}})
    return metadata


def routed_headers(mutation: pb.HeaderMutation, endpoints: str) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation)),
        dynamic_metadata=destination_metadata(endpoints),
    )


def continue_headers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse())


def routed_body(mutation: pb.HeaderMutation, endpoints: str, body: bytes | None) -> pb.ProcessingResponse:
    """Buffered mode: the headers are still held while the body is processed, so the route goes here."""
    common = pb.CommonResponse(header_mutation=mutation)
    if body is not None:
        common.body_mutation.body = body
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=common), dynamic_metadata=destination_metadata(endpoints)
    )


def streamed_body(body: bytes) -> list[pb.ProcessingResponse]:
    """Full-duplex mode: the server sends the (possibly rewritten) body back itself, in chunks."""
    chunks = [body[i : i + CHUNK] for i in range(0, len(body), CHUNK)] or [b""]
    return [
        pb.ProcessingResponse(
            request_body=pb.BodyResponse(
                response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(
                        streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=last)
                    )
                )
            )
        )
        for chunk, last in _with_last(chunks)
    ]


def _with_last(items: list[bytes]) -> Iterable[tuple[bytes, bool]]:
    for i, item in enumerate(items):
        yield item, i == len(items) - 1


def request_trailers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())


def response_headers(route: str | None, strip_served: bool) -> pb.ProcessingResponse:
    mutation = pb.HeaderMutation(remove_headers=[SERVED] if strip_served else [])
    if route is not None:
        mutation.set_headers.append(_set(ROUTE_HEADER, route.encode()))
    return pb.ProcessingResponse(
        response_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation))
    )


def pass_response_body() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_body=pb.BodyResponse())


def pass_response_trailers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def immediate(error: GatewayError) -> pb.ProcessingResponse:
    """An OpenAI-shaped error answered by the proxy itself; no backend is touched."""
    headers = pb.HeaderMutation(set_headers=[_set("content-type", b"application/json")])
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=HttpStatus(code=error.status),  # the enum values are the codes
            headers=headers,
            body=error.body(),
            details=f"hetgate_epp_{error.status}",
        )
    )


def subset_of(request: pb.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the proxy allows for this request, or None when it sets no subset."""
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET not in namespace.fields:
        return None
    value = namespace.fields[SUBSET]
    if value.HasField("string_value"):  # tolerate a comma-separated string as well as a list
        return frozenset(e.strip() for e in value.string_value.split(",") if e.strip())
    return frozenset(v.string_value for v in value.list_value.values)


def served_of(request: pb.ProcessingRequest, headers: dict[str, bytes]) -> str | None:
    namespace = request.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if namespace is not None and SERVED in namespace.fields:
        return namespace.fields[SERVED].string_value
    raw = headers.get(SERVED)
    return raw.decode("latin-1") if raw else None
