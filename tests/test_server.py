"""A real ``strata serve`` (uvicorn on 127.0.0.1) driven by the official
``openai`` client and by raw HTTP for what the client will not send."""

from __future__ import annotations

import re
import threading
import time

import httpx
import openai
import pytest
from live_server import LiveServer

KEY = "sk-test-strata"
CONTEXT = 512


@pytest.fixture(scope="module")
def server(model_file):
    # --parallel 1: these tests are about one request at a time (the queue's
    # bound, parking the conversation that leaves); test_server_batching.py
    # serves several together.
    s = LiveServer("--model", str(model_file), "--context-length", str(CONTEXT), "--max-queue", "2", "--parallel", "1",
                   "--max-body-mib", "1", "--conversation-cache-mib", "64", "--min-free-mib", "0",
                   api_key=KEY)
    try:
        s.wait_for_health(200)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name three rivers in Europe."}]


def test_models_lists_the_file(client, model_file):
    ids = [m.id for m in client.models.list().data]
    assert ids == [model_file.name.removesuffix(".gguf")]


def test_chat_streamed_and_whole_agree(client, model_id):
    whole = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=12, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens >= 1
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # The repeat prefilled only what the live sequence did not hold.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_completions_with_a_seed_give_the_same_text_twice(client, model_id):
    def sample(**extra):
        return client.completions.create(model=model_id, prompt="Once upon a time,", max_tokens=10,
                                         temperature=0.9, seed=1234, **extra)

    first, second = sample().choices[0].text, sample().choices[0].text
    assert first == second and first
    streamed = "".join(c.choices[0].text for c in sample(stream=True) if c.choices)
    assert streamed == first
    other = client.completions.create(model=model_id, prompt="Once upon a time,", max_tokens=10,
                                      temperature=0.9, seed=99).choices[0].text
    assert other != first  # the seed matters (10 tokens at T=0.9 would collide only by a fluke)


ANSWER = {"type": "object", "additionalProperties": False, "required": ["rivers", "count"],
          "properties": {"rivers": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
                         "count": {"type": "integer", "minimum": 0, "maximum": 3}}}


def test_structured_outputs_follow_the_schema_whole_and_streamed(client, model_id):
    """``response_format`` json_schema (strict) and json_object through the
    official client: the answer parses and validates; streamed, it is the
    same text."""
    import json

    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "rivers", "schema": ANSWER, "strict": True}}
    whole = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=80, temperature=0,
                                           response_format=fmt)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), ANSWER)
    assert whole.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=80, temperature=0,
                                            response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    loose = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=80, temperature=0,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(loose.choices[0].message.content), dict)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 20}}}}}


def test_an_agent_loop_calls_a_tool_reads_its_result_and_reuses_the_cached_prefix(client, model_id):
    """With the official client: a required call (valid arguments, finish_reason
    tool_calls), streamed fragments that reassemble to the same call, then
    the tool's result sent back and answered from the cached prefix."""
    import json

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    options = {"model": model_id, "tools": [WEATHER_TOOL], "max_tokens": 60, "temperature": 0,
               "parallel_tool_calls": False}
    whole = client.chat.completions.create(messages=messages, tool_choice="required", **options)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    chunks = list(client.chat.completions.create(messages=messages, tool_choice="required", stream=True, **options))
    names, arguments, finish = {}, {}, None
    for chunk in chunks:
        for delta_call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            names[delta_call.index] = names.get(delta_call.index, "") + (delta_call.function.name or "")
            arguments[delta_call.index] = arguments.get(delta_call.index, "") + (delta_call.function.arguments or "")
        finish = chunk.choices[0].finish_reason if chunk.choices and chunk.choices[0].finish_reason else finish
    assert finish == "tool_calls" and names == {0: "get_weather"} and arguments == {0: call.function.arguments}
    history = messages + [choice.message.model_dump(),  # as an agent sends it back: every field, nulls included
                          {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 18, "sky": "cloudy"}'}]
    answer = client.chat.completions.create(messages=history, **options)
    assert answer.choices[0].finish_reason in ("stop", "tool_calls", "length")
    assert answer.usage.prompt_tokens_details.cached_tokens > whole.usage.prompt_tokens // 2


def test_tokenize_counts_what_a_chat_reads_and_detokenize_reverses_it(server, client, model_id):
    """/tokenize of a chat (tools included) counts the prompt tokens its
    completion's usage reports; a prompt's ids detokenize back to its text;
    /v1/models/{id} answers for the served id and 404s another."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = server.post("/tokenize", {"messages": messages, "tools": [WEATHER_TOOL], "tool_choice": "required"})
    assert r.status_code == 200, r.text
    counted = r.json()
    chat = client.chat.completions.create(model=model_id, messages=messages, tools=[WEATHER_TOOL],
                                          tool_choice="required", max_tokens=2, temperature=0)
    assert counted["count"] == len(counted["tokens"]) == chat.usage.prompt_tokens
    assert counted["max_model_len"] == CONTEXT
    ids = server.post("/tokenize", {"prompt": "Hello, world", "add_special_tokens": False}).json()["tokens"]
    assert server.post("/detokenize", {"tokens": ids}).json() == {"prompt": "Hello, world"}
    assert server.post("/detokenize", {"tokens": [10**9]}).status_code == 400
    assert server.post("/tokenize", {"prompt": "x", "messages": messages}).status_code == 400
    assert client.models.retrieve(model_id).id == model_id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


def test_anthropic_messages_answer_call_tools_stream_and_count_with_the_official_client(server, model_id):
    """``/v1/messages`` through the ``anthropic`` client: text, a forced tool
    call whole and streamed (the streamed input equals the whole one), the
    tool's result answered from the cached prefix, ``count_tokens`` equal to
    the input the usage reports, and errors in Anthropic's shape."""
    import anthropic

    client = anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0, timeout=120)
    greedy = {"temperature": 0}  # sampling settings travel in the body: this client no longer names them
    hello = client.messages.create(model=model_id, max_tokens=8, system="Answer briefly.",
                                   messages=[{"role": "user", "content": "Name a river in Europe."}],
                                   extra_body=greedy)
    assert hello.content[0].type == "text" and hello.content[0].text
    assert hello.stop_reason in ("end_turn", "max_tokens") and hello.usage.output_tokens >= 1
    tool = {"name": "get_weather", "description": "The weather now in a city.",
            "input_schema": WEATHER_TOOL["function"]["parameters"]}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    options = {"model": model_id, "max_tokens": 60, "extra_body": greedy, "tools": [tool],
               "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    whole = client.messages.create(messages=messages, **options)
    (use,) = [b for b in whole.content if b.type == "tool_use"]
    assert whole.stop_reason == "tool_use" and use.name == "get_weather" and isinstance(use.input["city"], str)
    with client.messages.stream(messages=messages, **options) as stream:
        streamed = stream.get_final_message()
    (streamed_use,) = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed.stop_reason == "tool_use" and streamed_use.input == use.input
    counted = client.messages.count_tokens(model=model_id, messages=messages, tools=[tool],
                                           tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    history = messages + [{"role": "assistant", "content": whole.content},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                        "content": '{"celsius": 18}'}]}]
    answer = client.messages.create(messages=history, **{**options, "tool_choice": {"type": "auto"}})
    assert answer.usage.cache_read_input_tokens > whole.usage.input_tokens // 2
    structured = client.messages.create(model=model_id, max_tokens=80, messages=MESSAGES[1:], extra_body=greedy,
                                        output_config={"format": {"type": "json_schema", "schema": ANSWER}})
    import json

    import jsonschema

    jsonschema.validate(json.loads(structured.content[0].text), ANSWER)
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model=model_id, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])


def test_the_responses_api_answers_calls_tools_and_streams_with_the_official_client(client, model_id):
    """``/v1/responses`` (stateless) through the ``openai`` client: text, a
    required function call whole and streamed (the streamed arguments equal
    the whole ones), its output sent back as input items answered from the
    cached prefix, and ``previous_response_id`` refused naming why."""
    import json

    hello = client.responses.create(model=model_id, input="Name a river in Europe.", instructions="Answer briefly.",
                                    max_output_tokens=8, temperature=0)
    assert hello.output_text and hello.status in ("completed", "incomplete") and hello.usage.output_tokens >= 1
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    items = [{"role": "user", "content": "What is the weather in Paris?"}]
    options = {"model": model_id, "tools": [tool], "tool_choice": "required", "parallel_tool_calls": False,
               "max_output_tokens": 60, "temperature": 0}
    whole = client.responses.create(input=items, **options)
    (call,) = [item for item in whole.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    events = list(client.responses.create(input=items, stream=True, **options))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == call.arguments
    assert [i.type for i in events[-1].response.output] == [i.type for i in whole.output]
    history = items + [item.model_dump(exclude_none=True) for item in whole.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 18}'}]
    answer = client.responses.create(input=history, **{**options, "tool_choice": "auto"})
    assert answer.usage.input_tokens_details.cached_tokens > whole.usage.input_tokens // 2
    with pytest.raises(openai.BadRequestError, match="stores no responses"):
        client.responses.create(model=model_id, input="x", previous_response_id=whole.id)


def test_logprobs_whole_and_streamed_on_both_endpoints(client, model_id):
    whole = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=2)
    entries = whole.choices[0].logprobs.content
    assert len(entries) == whole.usage.completion_tokens and all(e.logprob <= 0 for e in entries)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in entries)  # greedy
    assert "".join(e.token for e in entries).startswith(whole.choices[0].message.content[:1])
    chunks = list(client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    # The repeat starts from the cached prefix, not the prompt's bfloat16 prefill: close, not bit-equal.
    assert all(abs(a.logprob - b.logprob) < 0.1 for a, b in zip(streamed, entries))
    legacy = client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=4,
                                       temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == legacy.usage.completion_tokens
    assert all(len(top) == 2 for top in lp.top_logprobs)


def test_n_choices_whole_and_streamed(client, model_id):
    """``n`` choices: one per index, each as its seed alone would give it
    (choice i draws with seed + i), usage counting the prompt once; streamed,
    the chunks of all choices interleave and reassemble to the same texts."""
    options = {"model": model_id, "messages": MESSAGES, "max_tokens": 8, "temperature": 1.0, "seed": 3}
    whole = client.chat.completions.create(n=3, **options)
    texts = [c.message.content for c in sorted(whole.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(whole.choices, key=lambda c: c.index)] == [0, 1, 2]
    alone = [client.chat.completions.create(**{**options, "seed": 3 + i}).choices[0].message.content
             for i in range(3)]
    assert texts == alone
    one = client.chat.completions.create(**options)
    assert whole.usage.prompt_tokens == one.usage.prompt_tokens
    assert whole.usage.completion_tokens == sum(
        client.chat.completions.create(**{**options, "seed": 3 + i}).usage.completion_tokens for i in range(3))
    chunks = list(client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True},
                                                 **options))
    streamed = {}
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(3)] == texts
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stream_is_server_sent_events_ending_in_done(server):
    r = server.post("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4,
                                        "temperature": 0, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert '"usage"' in events[-2] and '"finish_reason": "length"' in events[-2]


def test_api_key_is_required_everywhere_but_health(server):
    bare = httpx.Client(base_url=server.base, timeout=30)
    for path in ("/v1/models", "/metrics", "/props"):
        r = bare.get(path)
        assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"]
        r = bare.get(path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = bare.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401
    assert bare.get("/health").json() == {"status": "ok"}


def test_props_name_the_engine_process(server):
    props = server.http.get("/props").json()
    assert props["context_length"] == CONTEXT and props["engine_pid"] > 0
    assert props["engine_uptime_s"] >= 0 and props["restarts"] == 0


LONG = "word " * 700

BAD = [
    ("malformed JSON", "/v1/chat/completions", b'{"messages": [', 400, "not valid JSON"),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "caf\xe9"}', 400, "not valid UTF-8"),
    ("not an object", "/v1/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("missing messages", "/v1/chat/completions", {"max_tokens": 3}, 400, "no 'messages'"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "non-empty list"),
    ("messages of the wrong type", "/v1/chat/completions", {"messages": "hi"}, 400, "non-empty list"),
    ("content of the wrong type", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "content must be a string"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "role must be one of"),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "no 'prompt'"),
    ("negative max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "at least 1"),
    ("absurd max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400,
     f"the context holds {CONTEXT} tokens"),
    ("max_tokens as text", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "whole number"),
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -0.5}, 400,
     "temperature must be at least 0"),
    ("top_p of 0", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p must be in (0, 1]"),
    ("top_p above 1", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p must be in (0, 1]"),
    ("n of 0", "/v1/completions", {"prompt": "x", "n": 0}, 400, "'n' must be a whole number in 1..16"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400, "needs 'logprobs': true"),
    ("too many logprobs", "/v1/completions", {"prompt": "x", "logprobs": 9}, 400, "0..5"),
    ("a tool with a bad name", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                        "tools": [{"type": "function", "function": {"name": "f g"}}]},
     400, "letters, digits"),
    ("a tool message without its call's id", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "5"}]}, 400, "tool_call_id"),
    ("tool_choice naming no tool", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "not among the request's tools"),
    ("arguments that are not JSON", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, 400,
     "must be a JSON object"),
    ("a response_format of an unknown type", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, 400,
     "response_format.type must be 'text', 'json_object' or 'json_schema'"),
    ("a json_schema response_format without its schema", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema",
                                                                         "json_schema": {"name": "a"}}}, 400,
     "json_schema.schema must be a JSON schema object"),
    ("a schema keyword the decoder cannot enforce", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "response_format": {
         "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "array", "uniqueItems": True}}}},
     400, "uniqueItems"),
    ("a logit_bias for a token past the vocabulary", "/v1/completions",
     {"prompt": "x", "logit_bias": {"999999": 5}}, 400, "the vocabulary has"),
    ("a logit_bias out of range", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 500}}, 400, "[-100, 100]"),
    ("an unknown field", "/v1/completions", {"prompt": "x", "temprature": 0.1}, 400, "unknown field(s) 'temprature'"),
    ("an unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-17"}, 404, "is not served here"),
    ("a prompt longer than the context", "/v1/completions", {"prompt": LONG, "max_tokens": 2}, 400,
     f"but the context holds {CONTEXT}"),
    ("a body over the limit", "/v1/completions", {"prompt": "x" * (2 << 20)}, 413, "limit"),
]


@pytest.mark.parametrize("path, body, status, message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error_and_the_engine_keeps_serving(server, path, body, status, message):
    r = server.post(path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "code"}
    assert message in error["message"], error["message"]
    assert server.health() == (200, {"status": "ok"})


def test_a_prompt_over_the_context_names_both_lengths_and_is_never_truncated(server):
    r = server.post("/v1/completions", {"prompt": LONG, "max_tokens": 2})
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    match = re.search(r"the prompt has (\d+) tokens but the context holds (\d+)", error["message"])
    assert match and int(match[1]) > 700 and int(match[2]) == CONTEXT, error["message"]
    ok = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_full_queue_answers_503_with_retry_after(server):
    """One request runs and --max-queue 2 may wait: of four at once, one is refused."""
    results: list[httpx.Response] = []

    def ask(i):
        results.append(server.post("/v1/completions", {"prompt": f"Story {i}:", "max_tokens": 30,
                                                       "temperature": 0}))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    statuses = sorted(r.status_code for r in results)
    assert statuses == [200, 200, 200, 503], [r.text for r in results]
    refused = next(r for r in results if r.status_code == 503)
    assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "queue_full"


def test_a_client_that_disconnects_cancels_its_generation(server):
    before = server.metrics()
    with server.http.stream("POST", "/v1/completions", json={"prompt": "A long story:", "max_tokens": 400,
                                                             "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
    deadline = time.monotonic() + 60
    while server.metrics()["strata_requests_cancelled_total"] < before["strata_requests_cancelled_total"] + 1:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.2)
    # The engine stopped early: far fewer than 400 tokens were generated.
    after = server.metrics()
    assert after["strata_generated_tokens_total"] - before["strata_generated_tokens_total"] < 100
    ok = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200


def test_metrics_count_requests_tokens_and_the_conversation_cache(server, client, model_id):
    client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=3, temperature=0)
    client.completions.create(model=model_id, prompt="Rivers of Europe include", max_tokens=3, temperature=0)
    m = server.metrics()
    assert m['strata_requests_total{route="/v1/chat/completions",status="200"}'] >= 1
    assert m['strata_requests_total{route="/v1/completions",status="400"}'] >= 1
    assert m['strata_requests_total{route="/metrics",status="401"}'] >= 1
    assert m["strata_generated_tokens_total"] >= 6 and m["strata_prompt_tokens_total"] > 0
    assert m["strata_time_to_first_token_seconds_count"] >= 2
    assert m["strata_time_per_output_token_seconds_count"] >= 1
    assert m["strata_engine_up"] == 1 and m["strata_engine_restarts_total"] == 0
    assert m["strata_queue_depth"] == 0
    assert m["strata_conversation_cache_parked_total"] >= 1
    assert m["strata_conversation_cache_pool_bytes_total"] == 64 << 20
