"""The EPP protocol's messages, built and read without Envoy (tests/epp drives a real one).

Needs the `epp` extra (scripts/test.sh installs it): a missing one fails here, it is not skipped."""

from __future__ import annotations

import math

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.struct_pb2 import Struct

from gateway.config import BackendConfig
from gateway.epp import protocol
from gateway.epp.picker import SampledStream, Shed
from gateway.errors import NoBackend
from gateway.registry import BackendState


def request_with(namespace: str, values: dict) -> pb.ProcessingRequest:
    message = pb.ProcessingRequest()
    entry = Struct()
    entry.update(values)
    message.metadata_context.filter_metadata[namespace].CopyFrom(entry)
    return message


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (["10.0.0.1:8000", "10.0.0.2:8000"], {"10.0.0.1:8000", "10.0.0.2:8000"}),
        ("10.0.0.1:8000, 10.0.0.2:8000", {"10.0.0.1:8000", "10.0.0.2:8000"}),
        ([], set()),
    ],
)
def test_subset_hint_is_read_from_filter_metadata(value, expected):
    message = request_with(protocol.SUBSET_NAMESPACE, {protocol.SUBSET: value})
    assert protocol.subset_of(message) == expected


def test_no_subset_hint_means_the_whole_pool():
    assert protocol.subset_of(pb.ProcessingRequest()) is None
    assert protocol.subset_of(request_with(protocol.SUBSET_NAMESPACE, {"other": "x"})) is None


def test_served_endpoint_from_metadata_or_header():
    message = request_with(protocol.LB_NAMESPACE, {protocol.SERVED: "10.0.0.2:8000"})
    assert protocol.served_of(message, {protocol.SERVED: b"10.0.0.9:1"}) == "10.0.0.2:8000"
    assert protocol.served_of(pb.ProcessingRequest(), {protocol.SERVED: b"10.0.0.9:1"}) == "10.0.0.9:1"
    assert protocol.served_of(pb.ProcessingRequest(), {}) is None


def test_destination_goes_in_header_and_envoy_lb_metadata_alike():
    endpoints = "10.0.0.1:8000,10.0.0.2:8000"
    response = protocol.routed_body(protocol.destination_mutation(endpoints, 42), endpoints, b"x" * 42)
    headers = {
        h.header.key: h.header.raw_value for h in response.request_body.response.header_mutation.set_headers
    }
    assert headers == {protocol.DESTINATION: endpoints.encode(), "content-length": b"42"}
    lb = response.dynamic_metadata.fields[protocol.LB_NAMESPACE].struct_value
    assert lb.fields[protocol.DESTINATION].string_value == endpoints
    assert response.request_body.response.body_mutation.body == b"x" * 42


def test_unchanged_body_is_not_mutated():
    response = protocol.routed_body(protocol.destination_mutation("a:1", None), "a:1", None)
    assert not response.request_body.response.HasField("body_mutation")
    keys = [h.header.key for h in response.request_body.response.header_mutation.set_headers]
    assert keys == [protocol.DESTINATION]


def test_full_duplex_body_goes_back_in_chunks_with_one_end_of_stream():
    body = bytes(range(256)) * 1000  # 256 KB
    responses = protocol.streamed_body(body)
    parts = [r.request_body.response.body_mutation.streamed_response for r in responses]
    assert len(parts) == 4
    assert b"".join(p.body for p in parts) == body
    assert [p.end_of_stream for p in parts] == [False, False, False, True]
    assert all(len(p.body) <= protocol.CHUNK for p in parts)


@pytest.mark.parametrize(("error", "status"), [(NoBackend("none"), 503), (Shed("full"), 429)])
def test_immediate_responses_are_openai_errors(error, status):
    reply = protocol.immediate(error).immediate_response
    assert reply.status.code == status
    body = orjson.loads(reply.body)["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["code"] == status
    assert [(h.header.key, h.header.raw_value) for h in reply.headers.set_headers] == [
        ("content-type", b"application/json")
    ]


def test_response_headers_strip_the_served_endpoint_and_add_the_route():
    reply = protocol.response_headers("mode=aggregated; backend=b0", strip_served=True)
    mutation = reply.response_headers.response.header_mutation
    assert list(mutation.remove_headers) == [protocol.SERVED]
    assert mutation.set_headers[0].header.raw_value == b"mode=aggregated; backend=b0"


# -- a sampled reply's timing (gateway/epp/picker.py SampledStream) -----------------------------------------
def sse_reply(tokens: int) -> bytes:
    events = [b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n' for _ in range(tokens)]
    return b"".join(events) + b"data: [DONE]\n\n"


def fresh_stream() -> SampledStream:
    config = BackendConfig.model_validate(
        {"id": "b0", "url": "http://127.0.0.1:1", "model": "m", "accelerator": "h100"}
    )
    return SampledStream(BackendState(config))


def sampled(chunks: list[bytes]) -> SampledStream:
    stream = fresh_stream()
    for at, chunk in enumerate(chunks, start=1):
        stream.add(chunk, float(at))
    stream.finish_s = float(len(chunks))
    return stream


@pytest.mark.parametrize("size", [1, 3, 5, 6, 7, 11, 12, 13, 1000])
def test_a_sampled_reply_counts_its_events_however_envoy_cut_it(size):
    """Cut every `size` bytes, so `data: ` and `data: [DONE]` straddle chunk boundaries at every offset:
    each event is counted once, and the end is seen."""
    body = sse_reply(7)
    stream = sampled([body[i : i + size] for i in range(0, len(body), size)])
    served = stream.served()
    assert stream.events == 8
    assert served.output_tokens == 7
    assert served.first_token_s == 1.0 and served.finish_s == stream.finish_s


def test_a_reply_cut_short_teaches_its_first_token_only():
    body = sse_reply(7)
    served = sampled([body[: len(body) - 8]]).served()  # [DONE] never came
    assert served.output_tokens == 0 and math.isnan(served.finish_s)
    assert served.first_token_s == 1.0


def test_an_empty_chunk_is_not_the_first_token():
    stream = fresh_stream()
    assert not stream.add(b"", 1.0)
    assert stream.add(sse_reply(1), 2.0)
    assert stream.first_token_s == 2.0
