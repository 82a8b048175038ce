"""Tool calls: histories rendered as transformers renders them, calls held to
the tools' schemas in every format, and replies read back.

Templates: Qwen3's (Hermes ``<tool_call>`` blocks, ``<think>``), Llama 3.2's
(JSON with ``"parameters"``), Mistral Nemo's (``[TOOL_CALLS]``), embedded in
tiny random-weight files; a plain ChatML template and both real models
(Gemma 3, SmolLM2) for the generic format. A random model calls nothing on
its own: every valid call is the grammar's doing."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import Shape, write_tiny_model

import strata_runtime
from strata_runtime.text import (
    ChatTemplate,
    ReplyStream,
    ToolCalling,
    ToolChoice,
    normalize_messages,
    normalize_tools,
)

TEMPLATES = Path(__file__).parent / "data" / "templates"
QWEN3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
LLAMA32 = (TEMPLATES / "meta-llama-Llama-3.2-3B-Instruct.jinja").read_text()
MISTRAL = (TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}}}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers & return the sum <exactly>.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                   "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                  "b": {"type": "integer", "minimum": -99, "maximum": 99}}}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _history(call_ids=("abcdefgh1", "abcdefgh2"), parallel=True, reasoning=False):
    """A conversation with tool calls, results and an answer (OpenAI's shapes, arguments as objects)."""
    calls = [{"id": call_ids[0], "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]
    results = [{"role": "tool", "tool_call_id": call_ids[0], "content": '{"temp": 18, "sky": "<b>cloudy</b>"}'}]
    if parallel:
        calls.append({"id": call_ids[1], "type": "function",
                      "function": {"name": "add", "arguments": {"a": 2, "b": 3}}})
        results.append({"role": "tool", "tool_call_id": call_ids[1], "content": "5"})
    answer = {"role": "assistant", "content": "It is 18 C & cloudy in Paris; 2 + 3 = 5."}
    if reasoning:
        answer["reasoning_content"] = "The tool said 18 and cloudy.\nSay it plainly."
    return [{"role": "system", "content": "You are terse. Use tools when they help."},
            {"role": "user", "content": "Weather in Paris, and what is 2 + 3?"},
            {"role": "assistant", "content": "", "tool_calls": calls}, *results, answer,
            {"role": "user", "content": "Thanks. And in Rome?"}]


def _transformers(template: str, messages, tools, **kwargs) -> str:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                 bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = template
    return hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)


def _ours(template: str, messages, tools, **kwargs) -> str:
    return ChatTemplate(template, "<s>", "</s>").render(normalize_messages(messages), tools=normalize_tools(tools),
                                                        **kwargs)


@pytest.mark.parametrize("name,template,history", [
    ("qwen3", QWEN3, _history()),
    ("qwen3 reasoning", QWEN3, _history(reasoning=True)),
    ("llama3.2", LLAMA32, _history(parallel=False)),
    ("mistral nemo", MISTRAL, _history()),
])
def test_histories_render_as_transformers_renders_them(name, template, history):
    """Tool calls, results, reasoning and the tools themselves (descriptions
    with ``&`` and ``<``, which Jinja's own ``tojson`` would escape)."""
    for tools, kwargs in ((TOOLS, {}), (TOOLS, {"enable_thinking": False}), (None, {})):
        if tools is None and name.startswith("llama"):
            continue  # the Llama template writes calls only alongside its tools
        assert _ours(template, history, tools, **kwargs) == _transformers(template, history, tools, **kwargs)


def test_arguments_sent_as_json_text_and_null_content_render_as_objects_and_empty_text():
    """What an OpenAI client sends (arguments as JSON text, ``content: null``)
    renders as transformers renders arguments as objects and content "" (it
    fails on Qwen3's template with the content missing)."""
    sent = _history(parallel=False)
    sent[2]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris", "unit": "c"}'
    sent[2]["content"] = None
    assert _ours(QWEN3, sent, TOOLS) == _transformers(QWEN3, _history(parallel=False), TOOLS)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    specs = {"hermes text": (QWEN3, ()), "hermes tokens": (QWEN3, ("<tool_call>", "</tool_call>", "<think>",
                                                                    "</think>")),
             "llama3": (LLAMA32, ()), "mistral": (MISTRAL, ()), "generic": (CHATML, ())}
    return {name: write_tiny_model(folder / f"{name.replace(' ', '_')}.gguf", "qwen2", Shape(hidden=64, layers=2),
                                   seed=4, chat_template=template, extra_tokens=extra, context=4096)
            for name, (template, extra) in specs.items()}


def _engine(path):
    return strata_runtime.load(path, dtype="float32", progress=False, context_length=4096, conversation_cache_mib=0,
                               parallel=2)


def _check_calls(completion, choice) -> None:
    reply = completion.reply
    assert completion.finish_reason == "tool_calls", (completion.text, reply)
    assert reply.tool_calls and reply.content is None, reply
    for call in reply.tool_calls:
        assert choice.get("name", call.name) == call.name
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("fmt", ["hermes text", "hermes tokens", "llama3", "mistral", "generic"])
def test_required_and_named_calls_are_schema_valid_in_every_seeded_run(tiny_files, fmt):
    engine = _engine(tiny_files[fmt])
    expected = fmt.split()[0]
    assert engine.tool_call_format == expected
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for seed in range(6):
        for choice in ("required", {"type": "function", "function": {"name": "add"}}):
            # One call: a random model would add parallel calls until max_tokens.
            c = engine.chat(messages, tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=1.0, top_k=0,
                            top_p=1.0, min_p=0.0, seed=seed, parallel_tool_calls=False)
            _check_calls(c, choice["function"] if isinstance(choice, dict) else {})
            if isinstance(choice, dict):
                assert len(c.reply.tool_calls) == 1


def test_special_token_triggers_are_tokens_and_text_triggers_are_text(tiny_files):
    """Where the vocabulary has ``<tool_call>`` as a token the call opens with
    that token; where it has none, with the text spelled out."""
    for fmt, as_token in (("hermes tokens", True), ("hermes text", False)):
        engine = _engine(tiny_files[fmt])
        c = engine.chat([{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="required", max_tokens=120,
                        temperature=0, parallel_tool_calls=False)
        opener = engine.tokenizer.ids.get("<tool_call>")
        assert (c.tokens[0] == opener) is as_token, engine.tokenizer.decode(c.tokens[:3], special=True)
        _check_calls(c, {})


def test_a_call_cut_off_by_max_tokens_is_length_and_no_call(tiny_files):
    engine = _engine(tiny_files["hermes text"])
    c = engine.chat([{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="required", max_tokens=6,
                    temperature=0)
    assert c.finish_reason == "length" and not c.reply.tool_calls and c.reply.content == c.text


def test_tool_choice_none_writes_text_and_parses_no_calls(tiny_files):
    engine = _engine(tiny_files["hermes text"])
    c = engine.chat([{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0)
    assert c.finish_reason in ("stop", "length") and not c.reply.tool_calls


@pytest.mark.parametrize("bad,message", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "letters, digits"),
    ({"tools": [WEATHER, WEATHER]}, "unique"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be one of"),
    ({"tool_choice": "required"}, "has no tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "not": {}}}}],
      "tool_choice": "required"}, "not"),
])
def test_bad_tools_are_refused_naming_the_fix(tiny_files, bad, message):
    engine = _engine(tiny_files["generic"])
    with pytest.raises(strata_runtime.StrataError, match=message):
        engine.chat([{"role": "user", "content": "x"}], max_tokens=2, **bad)


CASES = {
    "hermes": ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
               "Let me look."),
    "llama3": ('{"name": "add", "parameters": {"a": 2, "b": 3}}', None),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}, '
                '"id": "abcdefgh1"}]', None),
    "generic": ('{"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]}', None),
}


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_replies_read_back_into_content_and_calls(tiny_files, fmt):
    engine = _engine(tiny_files["generic"])
    text, content = CASES[fmt]
    reply = ToolCalling(fmt, normalize_tools(TOOLS), ToolChoice("auto"), True, engine.tokenizer).parse(text)
    assert reply.content == content and reply.tool_calls
    for call in reply.tool_calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert call.arguments in text or fmt == "mistral"  # the text as written, not re-serialized
    think = ToolCalling(fmt, normalize_tools(TOOLS), ToolChoice("auto"), True, engine.tokenizer).parse(
        "<think>\nfirst, the weather\n</think>\n\n" + text)
    assert think.reasoning == "first, the weather" and think.tool_calls == () or len(think.tool_calls) == \
        len(reply.tool_calls)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list('{}[]":, \nab0<>/') + ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", '"name"',
                                                            '"arguments"', '"add"', "<think>", "</think>"]),
                max_size=30).map("".join))
def test_any_reply_text_parses_without_raising(text):
    tokenizer = _PARSER_TOKENIZER[0]
    for fmt in ("hermes", "llama3", "mistral", "generic"):
        reply = ToolCalling(fmt, normalize_tools(TOOLS), ToolChoice("auto"), True, tokenizer).parse(text)
        for call in reply.tool_calls:
            assert call.name in SCHEMAS and isinstance(json.loads(call.arguments), dict)


def _assemble(deltas) -> tuple:
    """A streamed reply put back together: (content, reasoning, [(name, arguments)])."""
    content, reasoning, calls = "", "", {}
    for d in deltas:
        content += d.get("content", "")
        reasoning += d.get("reasoning_content", "")
        if "tool_call" in d:
            calls[d["tool_call"]["index"]] = [d["tool_call"]["name"], ""]
        if "tool_arguments" in d:
            calls[d["tool_arguments"]["index"]][1] += d["tool_arguments"]["text"]
    return content or None, reasoning or None, [tuple(v) for _, v in sorted(calls.items())]


STREAMED = [(fmt, prefix + text) for fmt, (text, _) in CASES.items()
            for prefix in ("", "<think>\nfirst, the weather\n</think>\n\n", "Some words first. \n")
            if not (prefix.startswith("Some") and fmt in ("llama3", "generic"))]
STREAMED += [("generic", '{"response": "Line one\\nand \\u00e9 \\"quoted\\" \\\\ end"}'),
             (None, "<think>\nhmm\n\n</think>\n\nHello there\n"), (None, "<thi plain text <think>")]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(STREAMED), st.lists(st.integers(1, 7), min_size=1, max_size=400))
def test_a_reply_read_as_it_streams_equals_the_whole_reading(case, cuts):
    """Any cutting of a reply into pieces gives deltas that put back together
    equal ``parse`` of the whole: content, reasoning, call names and the
    arguments' text; a call's name goes out once, before its arguments."""
    fmt, text = case
    calling = ToolCalling(fmt or "hermes", normalize_tools(TOOLS), ToolChoice("auto" if fmt else "none"), True,
                          _PARSER_TOKENIZER[0])
    whole = calling.parse(text)
    stream, deltas, i = ReplyStream(calling), [], 0
    for n in cuts:
        deltas += stream.feed(text[i:i + n])
        i += n
    deltas += stream.feed(text[i:]) + stream.finish()
    assert _assemble(deltas) == (whole.content, whole.reasoning, [(c.name, c.arguments) for c in whole.tool_calls])
    started = set()
    for d in deltas:
        if "tool_call" in d:
            assert d["tool_call"]["index"] not in started
            started.add(d["tool_call"]["index"])
        if "tool_arguments" in d:
            assert d["tool_arguments"]["index"] in started


_PARSER_TOKENIZER: list = []


@pytest.fixture(autouse=True, scope="module")
def _parser_tokenizer(tiny_files):
    _PARSER_TOKENIZER[:] = [_engine(tiny_files["generic"]).tokenizer]


@pytest.mark.parametrize("which", ["smollm2", "gemma"])
def test_real_models_call_tools_and_the_next_turn_reuses_the_cached_prefix(which, smollm2_file, model_file):
    """The generic format on both real models: required and named calls valid
    in every seeded run; an agent loop (call, result, answer) whose second
    turn starts from the first turn's cached prefix."""
    engine = strata_runtime.load(smollm2_file if which == "smollm2" else model_file, progress=False,
                                 context_length=2048, parallel=2)
    messages = [{"role": "user", "content": "What's the weather in Paris, in celsius?"}]
    for seed in range(3):
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            c = engine.chat(messages, tools=TOOLS, tool_choice=choice, max_tokens=100, temperature=0.7, seed=seed,
                            parallel_tool_calls=False)  # sampled, a 135M model may list calls until max_tokens
            _check_calls(c, choice["function"] if isinstance(choice, dict) else {})
    one = {"tools": TOOLS, "max_tokens": 100, "temperature": 0, "parallel_tool_calls": False}
    first = engine.chat(messages, tool_choice="required", **one)
    call = first.reply.tool_calls[0]
    turn = messages + [{"role": "assistant", "content": None, "tool_calls": [call.as_openai()]},
                       {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 18, "sky": "cloudy"}'}]
    second = engine.chat(turn, **one)
    assert second.finish_reason in ("stop", "tool_calls")
    assert second.cached_tokens > first.prompt_tokens // 2, (second.cached_tokens, first.prompt_tokens)
