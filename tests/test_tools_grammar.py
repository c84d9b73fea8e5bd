"""The tools library on its own (fsd_local/tools): family detection, the parse of what each template writes,
the grammars (free text until the trigger under auto, the call from the first token when forced) on a real
llama.cpp vocabulary through llguidance, and markers that are special tokens."""

from __future__ import annotations

import json

import jsonschema
import llguidance as llg
import pytest

from fsd_local import Engine
from fsd_local.constrain import compile_grammar, tokenizer_for
from fsd_local.llama.chat_template import ChatTemplate
from fsd_local.tools import ToolError, ToolModel, detect, plan_tools, tool_request
from fsd_local.tools.families import FAMILIES, closed
from support.tinymodels import write_tiny_gguf
from support.tool_templates import TEMPLATES, with_template

TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "time", "parameters": TIME}}]
ASK = [{"role": "user", "content": "what time is it?"}]
CALLS = [("get_time", {"zone": "utc"}), ("get_time", {"zone": "cet"})]


def template(family: str) -> ChatTemplate:
    return ChatTemplate(TEMPLATES[family], "<s>", "</s>")


def model_of(engine: Engine, family: str) -> ToolModel:
    return ToolModel(template(family), lambda t, s: engine.tokenize(t, add_special=s), engine.token_bytes)


def test_the_family_is_detected_from_the_template():
    for name in ("hermes", "llama3", "mistral", "mistral-args"):
        assert detect(TEMPLATES[name]).name == name  # type: ignore[union-attr]
    assert detect(TEMPLATES["none"]) is None


REPLY_SPAN = {  # where each template writes an assistant turn with calls
    "hermes": ("<|im_start|>assistant\n", "<|im_end|>"),
    "llama3": ("assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "mistral": ("[/INST]", "</s>"),
    "mistral-args": ("[/INST]", "</s>"),
}


@pytest.mark.parametrize("family", list(REPLY_SPAN))
def test_the_parse_reads_back_the_calls_the_template_writes(family):
    n = 1 if family == "llama3" else 2  # the llama3 template writes one call per turn
    calls = [
        {"id": f"abcdefgh{i}", "type": "function", "function": {"name": name, "arguments": args}}
        for i, (name, args) in enumerate(CALLS[:n])
    ]
    convo = [*ASK, {"role": "assistant", "content": "", "tool_calls": calls}, {"role": "user", "content": "ok"}]
    text = template(family).render(convo, tools=TOOLS)
    begin, end = REPLY_SPAN[family]
    reply = text.split(begin)[1].split(end)[0]
    parsed = next(f for f in FAMILIES if f.name == family).parse(reply)
    assert not parsed.malformed and not parsed.truncated
    assert [(c.name, c.arguments) for c in parsed.calls] == CALLS[:n]


@pytest.fixture(scope="module")
def engine(tiny_pair):
    with Engine(target=tiny_pair[1], n_ctx=2048, n_threads=1) as eng:
        yield eng


def matcher(engine: Engine, grammar: str):
    m = llg.LLMatcher(tokenizer_for(engine.target), compile_grammar(grammar, None), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def feed(engine: Engine, m, text: str) -> bool:
    """Consume `text` as the tiny vocabulary's byte tokens (<0x00> is id 3): its tokenizer would add a space."""
    assert engine.token_bytes(3 + ord("a")) == b"a"
    return all(m.consume_token(3 + b) for b in text.encode())


CALL_TEXT = {
    "hermes": (
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>',
        '<tool_call>\n{"name": "got',
    ),
    "llama3": ('{"name": "get_time", "parameters": {"zone": "utc"}}', '{"name": "got'),
    "mistral": ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "utc"}}]', '[TOOL_CALLS][{"name": "got'),
    "mistral-args": ('[TOOL_CALLS]get_time[ARGS]{"zone": "utc"}', "[TOOL_CALLS]got"),
}


@pytest.mark.parametrize("family", list(CALL_TEXT))
def test_auto_is_free_text_until_the_model_opens_a_call(engine, family):
    grammar = plan_tools(model_of(engine, family), tool_request(TOOLS), ASK, 2048, 64).grammar
    assert grammar is not None
    good, bad = CALL_TEXT[family]
    m = matcher(engine, grammar)
    assert feed(engine, m, "it is noon, or so. <tool> {x}") and m.is_accepting()  # text may end anywhere
    prefix = "" if family == "llama3" else "let me see. "  # llama3: a reply is a call or text, not both
    m = matcher(engine, grammar)
    assert feed(engine, m, prefix + good) and m.is_accepting()
    m = matcher(engine, grammar)
    assert not feed(engine, m, prefix + bad)  # once the call is open, only the tools' names fit


@pytest.mark.parametrize("family", list(CALL_TEXT))
def test_a_forced_call_starts_at_the_first_token(engine, family):
    req = tool_request(TOOLS, "required", parallel=False)
    grammar = plan_tools(model_of(engine, family), req, ASK, 2048, 64).grammar
    assert grammar is not None
    good, _ = CALL_TEXT[family]
    assert not feed(engine, matcher(engine, grammar), "sure")
    m = matcher(engine, grammar)
    assert feed(engine, m, good) and m.is_stopped()  # one call, then nothing more (parallel_tool_calls false)


def test_content_is_held_back_only_while_it_may_open_a_call():
    hermes, _, llama3, _ = FAMILIES
    assert hermes.releasable("Sure <tool") == len("Sure ")
    assert hermes.releasable("Sure <tool_call>\n{") == len("Sure ")
    assert hermes.releasable("a < b") == len("a < b")
    assert llama3.releasable("  ") == 0 and llama3.releasable(' {"na') == 0
    assert llama3.releasable("Hi there") == len("Hi there")


def test_objects_in_tool_schemas_are_closed_unless_they_say():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string"}}},
            "c": {"type": "object", "properties": {}, "additionalProperties": True},
            "d": {"const": {"properties": {}}},
        },
    }
    out = closed(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["additionalProperties"] is True
    assert out["properties"]["d"] == {"const": {"properties": {}}}
    assert "additionalProperties" not in schema  # the request's own schema is left as it is (the template shows it)


def test_tool_definitions_are_checked():
    assert tool_request([{"type": "function", "function": {"name": "f"}}]).tools[0].parameters["type"] == "object"
    with pytest.raises(ToolError, match="tools must be a list"):
        tool_request({"name": "f"})
    with pytest.raises(ToolError, match="description must be a string"):
        tool_request([{"type": "function", "function": {"name": "f", "description": 3}}])


def test_a_marker_that_is_a_special_token_is_written_as_that_token(tmp_path, tiny_pair):
    """A vocabulary holding [TOOL_CALLS] as one control token: the grammar names the token (text cannot spell
    a special token), the reply's text shows nothing for it, and the parse still finds the call."""
    plain = write_tiny_gguf(tmp_path / "t.gguf", seed=2, noise=0.1, control=["[TOOL_CALLS]"])
    target = with_template(plain, tmp_path / "mistral.gguf", TEMPLATES["mistral"])
    with Engine(target=str(target), n_ctx=2048, n_threads=1) as eng:
        (marker,) = eng.tokenize("[TOOL_CALLS]", add_special=False)
        model = ToolModel(ChatTemplate.of(eng.target), lambda t, s: eng.tokenize(t, add_special=s), eng.token_bytes)
        plan = plan_tools(model, tool_request(TOOLS, "required", parallel=False), ASK, 2048, 200)
        assert plan.grammar is not None and f"<[{marker}]>" in plan.grammar
        c = eng.generate(plan.prompt, max_tokens=200, mode="ar", grammar=plan.grammar)
        parsed = plan.parse(c.token_ids)
    assert c.token_ids[0] == marker and not c.text.startswith("[TOOL_CALLS]")
    (call,) = parsed.calls
    assert call.name == "get_time" and len(call.id) == 9
    jsonschema.validate(call.arguments, TIME)
    assert json.loads(c.text)[0]["name"] == "get_time"


CUT = {  # two calls, the second cut short by max_tokens
    "hermes": '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "argu',
    "llama3": '{"name": "a", "parameters": {}}; {"name": "b", "para',
    "mistral": '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "argu',
    "mistral-args": '[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{"x": ',
}


@pytest.mark.parametrize("family", list(CUT))
def test_a_reply_cut_inside_a_call_keeps_the_whole_calls_before_it(family):
    parser = next(f for f in FAMILIES if f.name == family)
    parsed = parser.parse(CUT[family])
    assert parsed.truncated and not parsed.malformed and [c.name for c in parsed.calls] == ["a"]
    broken = parser.parse(CUT[family][: CUT[family].index('"a"' if family != "mistral-args" else "a[")] + "{")
    # nothing whole: the reply stays text
    assert broken.malformed and not broken.calls and broken.content
