"""Property: whatever JSON a client sends to either completion route, a real
``strata serve`` answers 2xx or a 4xx with an OpenAI-style error, in bounded
time, and goes on answering plain requests."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_server import LiveServer

CONTEXT = 64


@pytest.fixture(scope="module")
def server(model_file):
    s = LiveServer("--model", str(model_file), "--context-length", str(CONTEXT), "--conversation-cache-mib", "16",
                   "--min-free-mib", "0", "--max-body-mib", "1")
    try:
        s.wait_for_health(200)
        yield s
    finally:
        s.stop()


# Odd text: lone surrogates, controls, private use, astral characters, the template's own markers.
ODD_TEXT = st.sampled_from(["\ud800", "\udfff", "\ud83d", "\x00", "\u2028", "\U000F0001", "\U0001F999",
                            "<start_of_turn>", "<end_of_turn>\n", "<bos>", "\ufeff"])
ODD_MIX = st.lists(st.one_of(st.text(max_size=12), ODD_TEXT), max_size=4).map("".join)
TEXT = st.one_of(st.text(max_size=12), st.text(max_size=12), ODD_MIX)
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-(10**40), 10**40), st.floats(allow_nan=True), TEXT)
ANY_JSON = st.recursive(SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)


MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                 "content": TEXT})
COMMON = {
    "model": st.sampled_from(["gemma-3-270m-q4_k_m", "gpt-4"]),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 50),
    "seed": st.one_of(st.integers(0, 2**32), st.integers(-(2**70), 2**70)),
    "stop": st.lists(TEXT, max_size=20),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.sampled_from([1, 1, 0, 2]),
    "cache_salt": TEXT,
    "logprobs": st.sampled_from([None, False, True]),
    "logit_bias": st.one_of(st.dictionaries(st.one_of(st.integers(-3, 300_000).map(str), TEXT),
                                            st.one_of(st.floats(-150, 150), st.booleans(), TEXT), max_size=3),
                            ANY_JSON),
}
# JSON schemas, some well formed, some not (unknown types, keywords the decoder cannot enforce, any JSON).
SCHEMA = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "boolean", "null", "strin", "object"])},
                          optional={"maxLength": st.integers(-1, 4), "enum": st.lists(TEXT, max_size=3),
                                    "uniqueItems": st.booleans(), "pattern": TEXT}),
    lambda inner: st.fixed_dictionaries({"type": st.just("object"),
                                         "properties": st.dictionaries(TEXT, inner, max_size=3)},
                                        optional={"required": st.lists(TEXT, max_size=2),
                                                  "additionalProperties": st.booleans()}),
    max_leaves=6)
RESPONSE_FORMAT = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "xml"])}),
    st.fixed_dictionaries({"type": st.just("json_schema"),
                           "json_schema": st.fixed_dictionaries({"name": TEXT},
                                                                optional={"schema": st.one_of(SCHEMA, ANY_JSON),
                                                                          "strict": st.booleans()})}),
    ANY_JSON)
VALID = {
    "/v1/chat/completions": st.fixed_dictionaries({"messages": st.lists(MESSAGE, min_size=1, max_size=3),
                                                   "max_tokens": st.integers(1, 3)},
                                                  optional={**COMMON, "max_completion_tokens": st.integers(1, 3),
                                                            "response_format": RESPONSE_FORMAT}),
    "/v1/completions": st.fixed_dictionaries(
        {"prompt": st.one_of(TEXT, TEXT, st.lists(st.integers(-5, 300_000), max_size=5)),
         "max_tokens": st.integers(1, 3)}, optional=COMMON),
}
FIELDS = sorted({"messages", "prompt", "max_tokens", "metadata", "unknown_field", *COMMON})


BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": TEXT, "name": st.sampled_from(["f", "g", ""]),
                           "input": st.dictionaries(TEXT, SCALAR, max_size=2)}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": TEXT,
                           "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                      "text": TEXT}), max_size=2))},
                          optional={"is_error": st.booleans()}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "image", "document"]), "thinking": TEXT}),
)
ANTHROPIC_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                           "content": st.one_of(TEXT, st.lists(BLOCK, max_size=3))})
ANTHROPIC = st.fixed_dictionaries(
    {"model": st.sampled_from(["gemma-3-270m-q4_k_m", "claude-9"]), "max_tokens": st.integers(0, 3),
     "messages": st.lists(ANTHROPIC_MESSAGE, min_size=1, max_size=3)},
    optional={"system": st.one_of(TEXT, ANY_JSON), "stream": st.booleans(), "temperature": st.floats(0, 1),
              "top_k": st.integers(-1, 50), "stop_sequences": st.lists(TEXT, max_size=3),
              "tools": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "a b"]),
                                                       "input_schema": st.one_of(SCHEMA, ANY_JSON)},
                                                      optional={"type": st.sampled_from(["custom", "bash_2025"])}),
                                max_size=2),
              "tool_choice": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool",
                                                                                       "none", "x"])},
                                                             optional={"name": st.sampled_from(["f", "g"]),
                                                                       "disable_parallel_tool_use": st.booleans()}),
                                       ANY_JSON),
              "thinking": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"])}),
                                    ANY_JSON),
              "output_config": st.one_of(st.fixed_dictionaries({"format": st.fixed_dictionaries(
                  {"type": st.just("json_schema"), "schema": SCHEMA})}), ANY_JSON)})


@st.composite
def anthropic_bodies(draw) -> tuple[str, object]:
    path = draw(st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]))
    body = draw(ANTHROPIC)
    if path.endswith("count_tokens"):
        body = {k: v for k, v in body.items() if k in ("model", "messages", "system", "tools", "tool_choice",
                                                       "thinking")}
    if draw(st.booleans()):
        body[draw(st.sampled_from(sorted(body) + ["extra"]))] = draw(ANY_JSON)
    return path, body


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=anthropic_bodies())
def test_any_messages_body_gets_2xx_or_an_anthropic_4xx(server, request):
    """The Anthropic front door, fuzzed the same way: errors in Anthropic's shape, streams of its events."""
    path, body = request
    r = server.http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"},
                         timeout=60)
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        answer = r.json()
        assert answer["type"] == "error" and answer["error"]["message"], answer
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in r.text.split("\n\n") if e]
        assert events[0].startswith("event: message_start") and events[-1].startswith("event: message_stop")


ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "developer", "tool"]),
                           "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                "text": TEXT}), max_size=2))},
                          optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": TEXT, "name": st.sampled_from(["f", "g"]),
                           "arguments": st.one_of(TEXT, st.just('{"a": 1}'))}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": TEXT, "output": st.one_of(TEXT,
                                                                                                        ANY_JSON)}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "web_search_call"]),
                           "summary": st.lists(st.fixed_dictionaries({"type": st.just("summary_text"),
                                                                      "text": TEXT}), max_size=2)}),
)
RESPONSES = st.fixed_dictionaries(
    {"model": st.sampled_from(["gemma-3-270m-q4_k_m", "gpt-9"]), "input": st.one_of(TEXT, st.lists(ITEM, max_size=3)),
     "max_output_tokens": st.integers(0, 3)},
    optional={"instructions": st.one_of(TEXT, ANY_JSON), "stream": st.booleans(), "temperature": st.floats(0, 2),
              "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]),
                                                       "name": st.sampled_from(["f", "g", "a b"]),
                                                       "parameters": st.one_of(SCHEMA, ANY_JSON)}), max_size=2),
              "tool_choice": st.one_of(st.sampled_from(["auto", "required", "none", "x"]),
                                       st.fixed_dictionaries({"type": st.just("function"),
                                                              "name": st.sampled_from(["f", "h"])}), ANY_JSON),
              "text": st.one_of(st.fixed_dictionaries({"format": st.one_of(
                  st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
                  st.fixed_dictionaries({"type": st.just("json_schema"), "name": TEXT, "schema": SCHEMA}))}),
                  ANY_JSON),
              "previous_response_id": TEXT, "store": st.booleans()})


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=RESPONSES, extra=st.one_of(st.none(), st.tuples(st.sampled_from(["input", "tools", "text", "zzz"]),
                                                             ANY_JSON)))
def test_any_responses_body_gets_2xx_or_an_openai_4xx(server, body, extra):
    if extra is not None:
        body[extra[0]] = extra[1]
    r = server.http.post("/v1/responses", content=json.dumps(body).encode(),
                         headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert r.json()["error"]["message"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in r.text.split("\n\n") if e]
        assert events[0].startswith("event: response.created")
        assert events[-1].startswith(("event: response.completed", "event: response.incomplete"))


@st.composite
def bodies(draw) -> tuple[str, object]:
    """A plausible body for a route, then (mostly) one field or message part made arbitrary."""
    path = draw(st.sampled_from(sorted(VALID)))
    body = draw(VALID[path])
    how = draw(st.sampled_from(["as is", "as is", "field", "message", "whole"]))
    if how == "field":
        body[draw(st.sampled_from(FIELDS))] = draw(ANY_JSON)
    elif how == "message" and body.get("messages"):
        body["messages"][0][draw(st.sampled_from(["role", "content", "name"]))] = draw(ANY_JSON)
    elif how == "whole":
        body = draw(ANY_JSON)
    return path, body


def _assert_answered(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "code"} and error["message"], error
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
        assert all('"error"' not in e for e in events)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=bodies())
def test_any_body_gets_2xx_or_an_openai_4xx(server, request):
    path, body = request
    raw = json.dumps(body).encode()  # ensure_ascii: lone surrogates travel as \\ud800 escapes, as a client sends them
    r = server.http.post(path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    _assert_answered(r)


def test_the_server_still_serves_after_the_fuzzing(server):
    r = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert server.health() == (200, {"status": "ok"})
    assert "Traceback" not in server.log(), server.log()[-3000:]
    metrics = server.metrics()
    served = {k: v for k, v in metrics.items() if k.startswith("strata_requests_total") and "completions" in k}
    assert sum(served.values()) >= 150 and not any('status="5' in k for k in served), served
    print("answers by route and status:", served)
