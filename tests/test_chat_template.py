"""Chat templates: the one stored in the GGUF, rendered in Jinja's sandbox."""

from __future__ import annotations

import pytest
from gguf_factory import write_gguf

from strata_runtime.chat_template import ChatTemplate, ChatTemplateError
from strata_runtime.gguf_file import GGUFFile

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_template_from_the_file_is_used(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", metadata={"tokenizer.chat_template": CHATML})
    source = GGUFFile.open(path).get("tokenizer.chat_template")
    template = ChatTemplate.for_model(source, "gemma3", "<bos>", "<eos>")
    assert template.origin == "file"
    text = template.render([{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_builtin_template_when_the_file_has_none():
    template = ChatTemplate.for_model(None, "gemma3", "<bos>", "<eos>")
    assert template.origin == "built-in gemma3"
    text = template.render([{"role": "user", "content": " Hi "}, {"role": "assistant", "content": "Hello"},
                            {"role": "user", "content": "Bye"}])
    assert text == ("<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert ChatTemplate.for_model(None, "unknown-arch", "", "") is None


def test_template_cannot_escape_the_sandbox():
    template = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="the chat template failed"):
        template.render([{"role": "user", "content": "x"}])


def test_template_raise_exception_reaches_the_caller():
    template = ChatTemplate("{{ raise_exception('only user turns, please') }}")
    with pytest.raises(ChatTemplateError, match="only user turns, please"):
        template.render([{"role": "user", "content": "x"}])
