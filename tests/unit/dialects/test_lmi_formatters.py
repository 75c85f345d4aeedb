"""LMI output formatters on fake event streams (no model): framing, shapes, registry, custom hooks."""

from __future__ import annotations

import json

import pytest
from text_generation.types import Response, StreamResponse

from lmi_serve.dialects.common.schema import OUTPUT_FORMATTERS, LmiRequestError, RollingRequest, parse_rolling_request
from lmi_serve.dialects.lmi.formatters import (
    FORMATTERS, OutputFormatter, RenderContext, choose_formatter, render_json, render_jsonlines_chunk,
    render_sse_chunk,
)
from lmi_serve.dialects.lmi.hooks import GenerationOutput, apply_input_formatter, custom_formatter
from lmi_serve.engine.types import FinishReason, TokenEvent, TopToken
from lmi_serve.handler_api import Input

PROMPT = "Deep Learning is"
PREFILL = (TopToken(1, "<s>", None, True), TopToken(50, "Deep", -3.5), TopToken(51, " Learning is", -1.25))


def events(finish=FinishReason.LENGTH) -> list[TokenEvent]:
    """Four tokens; the second is held back (text ""), the third releases both texts."""
    return [
        TokenEvent(10, " a", -0.5, False, top_tokens=(TopToken(10, " a", -0.5), TopToken(11, " the", -1.0)),
                   prompt_tokens=PREFILL),
        TokenEvent(12, "", -0.25, False, top_tokens=(TopToken(12, " fi", -0.25), TopToken(13, " go", -2.0))),
        TokenEvent(14, " field.", -0.125, False, top_tokens=(TopToken(14, "eld.", -0.125), TopToken(2, "</s>", -3.0, True))),
        TokenEvent(2, "", -0.0625, True, finish, top_tokens=(TopToken(2, "</s>", -0.0625, True), TopToken(10, " a", -4.0))),
    ]


def ctx(**kw) -> RenderContext:
    return RenderContext(PROMPT, **kw)


def chunks(render, context, evs) -> list[str]:
    return [render(context, evs[:i]) for i in range(1, len(evs) + 1)]


LMI_TOKENS = [{"id": 10, "text": " a", "log_prob": -0.5}, {"id": 12, "text": "", "log_prob": -0.25},
              {"id": 14, "text": " field.", "log_prob": -0.125},
              {"id": 2, "text": "", "log_prob": -0.0625, "special_token": True}]
TGI_TOKENS = [{"id": 10, "text": " a", "logprob": -0.5, "special": False},
              {"id": 12, "text": "", "logprob": -0.25, "special": False},
              {"id": 14, "text": " field.", "logprob": -0.125, "special": False},
              {"id": 2, "text": "", "logprob": -0.0625, "special": True}]


# --- json -----------------------------------------------------------------------------------

def test_json_plain():
    assert render_json(ctx(), events()) == '{"generated_text": " a field."}'


def test_json_details():
    body = json.loads(render_json(ctx(details=True), events(FinishReason.EOS_TOKEN)))
    assert body == {"generated_text": " a field.", "details": {
        "finish_reason": "eos_token", "generated_tokens": 4, "inputs": PROMPT, "tokens": LMI_TOKENS}}


@pytest.mark.parametrize("reason, text", [(FinishReason.LENGTH, "length"), (FinishReason.EOS_TOKEN, "eos_token"),
                                          (FinishReason.STOP_SEQUENCE, "stop_sequence"),
                                          (FinishReason.CANCELLED, "abort")])
def test_json_finish_reasons(reason, text):
    assert json.loads(render_json(ctx(details=True), events(reason)))["details"]["finish_reason"] == text


def test_json_return_full_text():
    assert json.loads(render_json(ctx(return_full_text=True), events()))["generated_text"] == PROMPT + " a field."


def test_json_prefill_and_top_tokens():
    details = json.loads(render_json(ctx(details=True, decoder_input_details=True, top_n_tokens=2),
                                     events()))["details"]
    assert details["prefill"] == [{"id": 1, "text": "<s>", "log_prob": None},
                                  {"id": 50, "text": "Deep", "log_prob": -3.5},
                                  {"id": 51, "text": " Learning is", "log_prob": -1.25}]
    assert len(details["top_tokens"]) == 4 and all(len(step) == 2 for step in details["top_tokens"])
    assert details["top_tokens"][2][1] == {"id": 2, "text": "</s>", "log_prob": -3.0, "special_token": True}


def test_json_no_prefill_or_top_tokens_unless_asked():
    details = json.loads(render_json(ctx(details=True), events()))["details"]
    assert "prefill" not in details and "top_tokens" not in details and "seed" not in details


def test_json_best_of_sequences():
    other = [TokenEvent(20, " cool", -0.75, False), TokenEvent(21, "!", -1.5, False, FinishReason.STOP_SEQUENCE)]
    details = json.loads(render_json(ctx(details=True, return_full_text=True), events(), [other]))["details"]
    assert details["best_of_sequences"] == [{
        "generated_text": PROMPT + " cool!", "finish_reason": "stop_sequence", "generated_tokens": 2,
        "tokens": [{"id": 20, "text": " cool", "log_prob": -0.75}, {"id": 21, "text": "!", "log_prob": -1.5}]}]


def test_json_error():
    evs = events()[:2] + [TokenEvent.failure("boom")]
    assert json.loads(render_json(ctx(details=True), evs)) == {
        "generated_text": "", "details": {"finish_reason": "error", "generated_tokens": None, "inputs": None,
                                          "tokens": None}, "error": "boom"}
    assert json.loads(render_json(ctx(), [TokenEvent.failure("boom")]))["error"] == "boom"


def test_json_error_in_another_sequence_fails_the_response():
    body = json.loads(render_json(ctx(), events(), [[TokenEvent.failure("oom")]]))
    assert body["error"] == "oom" and body["details"]["finish_reason"] == "error"


def test_non_finite_logprob_is_null():
    evs = [TokenEvent(3, "x", float("-inf"), False, FinishReason.LENGTH)]
    assert json.loads(render_json(ctx(details=True), evs))["details"]["tokens"][0]["log_prob"] is None


# --- json, tgi_compat -----------------------------------------------------------------------

def test_tgi_json_is_array_with_details_validated_by_client():
    body = json.loads(render_json(ctx(tgi_compat=True), events(FinishReason.EOS_TOKEN)))
    assert isinstance(body, list) and len(body) == 1
    details = body[0]["details"]
    assert details["tokens"] == TGI_TOKENS
    assert details["prefill"] == [] and details["seed"] is None and details["finish_reason"] == "eos_token"
    response = Response(**body[0])
    assert response.generated_text == " a field." and response.details.generated_tokens == 4
    assert [t.special for t in response.details.tokens] == [False, False, False, True]


def test_tgi_json_full_options_validated_by_client():
    other = [TokenEvent(20, " cool", -0.75, False, FinishReason.LENGTH,
                        top_tokens=(TopToken(20, " cool", -0.75), TopToken(9, "?", -2.0)))]
    context = ctx(tgi_compat=True, decoder_input_details=True, top_n_tokens=2, seed=42, return_full_text=True,
                  other_seeds=(43,))
    body = json.loads(render_json(context, events(), [other]))
    details = body[0]["details"]
    assert details["prefill"][0] == {"id": 1, "text": "<s>", "logprob": None}
    assert details["prefill"][1] == {"id": 50, "text": "Deep", "logprob": -3.5}
    assert details["seed"] == 42
    assert details["top_tokens"][0] == [{"id": 10, "text": " a", "logprob": -0.5, "special": False},
                                        {"id": 11, "text": " the", "logprob": -1.0, "special": False}]
    [seq] = details["best_of_sequences"]
    assert seq["prefill"] == details["prefill"] and seq["seed"] == 43
    response = Response(**body[0])
    assert response.generated_text == PROMPT + " a field."
    assert len(response.details.prefill) == 3 and response.details.prefill[0].logprob is None
    assert response.details.best_of_sequences[0].generated_text == PROMPT + " cool"
    assert response.details.best_of_sequences[0].seed == 43
    assert len(response.details.top_tokens) == 4


def test_tgi_json_cancelled_stays_parseable():
    body = json.loads(render_json(ctx(tgi_compat=True), events(FinishReason.CANCELLED)))
    assert Response(**body[0]).details.finish_reason == "length"


def test_tgi_json_error():
    evs = [TokenEvent.failure("CUDA out of memory")]
    assert json.loads(render_json(ctx(tgi_compat=True), evs)) == {
        "error": "Request failed during generation: CUDA out of memory", "error_type": "generation"}


# --- jsonlines ------------------------------------------------------------------------------

def test_jsonlines_framing_and_content():
    lines = chunks(render_jsonlines_chunk, ctx(), events())
    assert all(line.endswith("\n") and line.count("\n") == 1 for line in lines)
    objs = [json.loads(line) for line in lines]
    assert objs[:3] == [{"token": t} for t in LMI_TOKENS[:3]]
    assert objs[3] == {"token": LMI_TOKENS[3], "generated_text": " a field."}


def test_jsonlines_token_texts_concatenate_to_generated_text():
    objs = [json.loads(line) for line in chunks(render_jsonlines_chunk, ctx(return_full_text=True), events())]
    assert PROMPT + "".join(o["token"]["text"] for o in objs) == objs[-1]["generated_text"]
    objs = [json.loads(line) for line in chunks(render_jsonlines_chunk, ctx(), events())]
    assert "".join(o["token"]["text"] for o in objs) == objs[-1]["generated_text"]


def test_jsonlines_details_on_last_line_without_tokens():
    objs = [json.loads(line) for line in chunks(render_jsonlines_chunk, ctx(details=True), events())]
    assert all("details" not in o for o in objs[:-1])
    assert objs[-1]["details"] == {"finish_reason": "length", "generated_tokens": 4, "inputs": PROMPT}


def test_jsonlines_top_tokens_and_prefill():
    context = ctx(details=True, top_n_tokens=2, decoder_input_details=True)
    objs = [json.loads(line) for line in chunks(render_jsonlines_chunk, context, events())]
    assert objs[0]["top_tokens"] == [{"id": 10, "text": " a", "log_prob": -0.5},
                                     {"id": 11, "text": " the", "log_prob": -1.0}]
    assert len(objs[-1]["details"]["prefill"]) == 3


def test_jsonlines_error_line():
    evs = events()[:2] + [TokenEvent.failure("boom")]
    assert render_jsonlines_chunk(ctx(details=True), evs) == json.dumps({
        "token": {"id": -1, "text": "", "log_prob": -1, "special_token": True}, "generated_text": "",
        "details": {"finish_reason": "error", "generated_tokens": None, "inputs": None}, "error": "boom"}) + "\n"


def test_jsonlines_with_tgi_compat_uses_tgi_frames():
    for line in chunks(render_jsonlines_chunk, ctx(tgi_compat=True), events()):
        StreamResponse(**json.loads(line))


# --- sse ------------------------------------------------------------------------------------

def test_sse_framing_matches_jsonlines():
    context = ctx(details=True)
    for sse, line in zip(chunks(render_sse_chunk, context, events()), chunks(render_jsonlines_chunk, context, events())):
        assert sse == "data: " + line[:-1] + "\n\n"


def test_sse_never_sends_done():
    frames = chunks(render_sse_chunk, ctx(), events())
    assert not any("[DONE]" in f for f in frames)


def _tgi_frames(context, evs) -> list[dict]:
    frames = chunks(render_sse_chunk, context, evs)
    assert all(f.startswith("data: ") and f.endswith("\n\n") for f in frames)
    return [json.loads(f[len("data:"):]) for f in frames]


def test_tgi_sse_frames_validated_by_client():
    context = ctx(tgi_compat=True, seed=7, prompt_tokens_count=3)
    objs = _tgi_frames(context, events(FinishReason.EOS_TOKEN))
    assert [o["index"] for o in objs] == [1, 2, 3, 4]
    assert [o["token"] for o in objs] == TGI_TOKENS
    assert all(o["generated_text"] is None and o["details"] is None for o in objs[:-1])
    assert objs[-1]["generated_text"] == " a field."
    assert objs[-1]["details"] == {"finish_reason": "eos_token", "generated_tokens": 4, "seed": 7, "input_length": 3}
    assert all("top_tokens" not in o for o in objs)
    parsed = [StreamResponse(**o) for o in objs]
    assert "".join(p.token.text for p in parsed) == parsed[-1].generated_text
    assert parsed[-1].details.seed == 7


def test_tgi_sse_top_tokens_and_full_text():
    objs = _tgi_frames(ctx(tgi_compat=True, top_n_tokens=2, return_full_text=True), events())
    assert objs[1]["top_tokens"] == [{"id": 12, "text": " fi", "logprob": -0.25, "special": False},
                                     {"id": 13, "text": " go", "logprob": -2.0, "special": False}]
    assert objs[-1]["generated_text"] == PROMPT + " a field."
    for o in objs:
        StreamResponse(**o)


def test_tgi_sse_error_event():
    frame = render_sse_chunk(ctx(tgi_compat=True), events()[:1] + [TokenEvent.failure("boom")])
    assert frame == 'data: {"error": "Request failed during generation: boom", "error_type": "generation"}\n\n'


# --- registry -------------------------------------------------------------------------------

def test_registry_entries():
    assert {name: (f.mimetype, f.render_final is not None, f.render_chunk is not None)
            for name, f in FORMATTERS.items()} == {
        "json": ("application/json", True, False),
        "jsonlines": ("application/jsonlines", False, True),
        "sse": ("text/event-stream", False, True),
    }


@pytest.mark.parametrize("stream, tgi, expected", [
    (False, False, "json"), (False, True, "json"), (True, False, "jsonlines"), (True, True, "sse")])
def test_default_choice(stream, tgi, expected):
    assert choose_formatter(None, None, stream, tgi).name == expected


def test_request_beats_configured():
    assert choose_formatter("sse", "jsonlines", True, False).name == "sse"
    assert choose_formatter(None, "sse", True, False).name == "sse"
    assert choose_formatter(None, "jsonlines", False, False).name == "jsonlines"


def test_registry_implements_the_schema_names():
    # The schema validates `output_formatter` against its own list, so it need not import the renderers.
    assert sorted(FORMATTERS) == sorted(OUTPUT_FORMATTERS)


def test_unknown_names():
    with pytest.raises(LmiRequestError, match=r"parameters.output_formatter: unknown output formatter 'xml'; "
                                              r"choose one of \['json', 'jsonlines', 'sse'\]"):
        choose_formatter("xml", None, False, False)
    with pytest.raises(LmiRequestError, match=r"option.output_formatter: unknown output formatter 'csv'"):
        choose_formatter(None, "csv", True, False)


def test_formatter_decides_framing():
    json_f, lines_f = FORMATTERS["json"], FORMATTERS["jsonlines"]
    assert json_f.streams(True) is False and json_f.streams(False) is False
    assert lines_f.streams(True) is True and lines_f.streams(False) is True
    both = custom_formatter(lambda out: "x")
    assert both.streams(True) is True and both.streams(False) is False


def test_render_body_joins_chunks_or_renders_final():
    context = ctx(details=True)
    assert FORMATTERS["json"].render_body(context, events()) == render_json(context, events())
    assert FORMATTERS["jsonlines"].render_body(context, events()) == "".join(
        chunks(render_jsonlines_chunk, context, events()))


def test_context_for_request():
    req = parse_rolling_request({"inputs": "Hi", "parameters": {"details": True, "top_n_tokens": 2,
                                                                "return_full_text": True}})
    context = RenderContext.for_request(req, tgi_compat=True, seed=3, prompt_tokens_count=2)
    assert context == RenderContext("Hi", True, False, 2, True, True, 3, 2)


# --- custom formatters ----------------------------------------------------------------------

def test_custom_output_formatter_per_event():
    seen: list[GenerationOutput] = []

    def fmt(out: GenerationOutput) -> str:
        seen.append(out)
        return json.dumps({"text": out.generated_text}) + "\n" if out.finished else ""

    formatter = choose_formatter(None, "json", True, False, custom=custom_formatter(fmt, stream=True))
    assert formatter.name == "fmt" and formatter.mimetype == "application/jsonlines"
    out = chunks(formatter.render_chunk, ctx(), events())
    assert out == ["", "", "", '{"text": " a field."}\n']
    assert [o.finished for o in seen] == [False, False, False, True]
    assert seen[1].tokens == LMI_TOKENS[:2] and seen[1].finish_reason is None
    last = seen[-1]
    assert last.inputs == PROMPT and last.finish_reason == "length" and last.error is None
    assert last.details["generated_tokens"] == 4 and last.details["tokens"] == LMI_TOKENS


def test_custom_output_formatter_once_at_end():
    calls = []

    def fmt(out):
        calls.append(out)
        return {"answer": out.generated_text, "n": len(out.details["best_of_sequences"])}

    fmt.content_type = "application/x-custom"
    formatter = choose_formatter(None, None, False, False, custom=custom_formatter(fmt, stream=False))
    assert formatter.mimetype == "application/x-custom"
    other = [TokenEvent(20, " x", -1.0, False, FinishReason.LENGTH)]
    assert formatter.render_final(ctx(), events(), [other]) == '{"answer": " a field.", "n": 1}'
    assert len(calls) == 1 and calls[0].finished


def test_custom_formatter_defaults_and_error_view():
    formatter = custom_formatter(lambda out: None)
    assert formatter.mimetype == "application/json"
    assert formatter.render_final(ctx(), events()) == ""
    seen = []
    custom_formatter(seen.append, stream=True).render_chunk(ctx(), [TokenEvent.failure("bad")])
    assert seen[0].finish_reason == "error" and seen[0].error == "bad" and seen[0].finished


def test_request_name_beats_custom():
    custom = custom_formatter(lambda out: "")
    assert choose_formatter("jsonlines", None, False, False, custom=custom).name == "jsonlines"


def test_input_formatter():
    def fmt(item: Input, **kwargs):
        body = item.get_as_json()
        return {"inputs": body["question"], "parameters": {"max_new_tokens": kwargs["limit"]}, "stream": True}

    item = Input.from_http(b'{"question": "Why?"}', {"Content-Type": "application/json"}, {}, "req-1")
    req = apply_input_formatter(fmt, item, limit=4)
    assert req == RollingRequest("Why?", parse_rolling_request({"inputs": "x", "parameters": {
        "max_new_tokens": 4}}).parameters, True)


def test_input_formatter_failures_become_request_errors():
    def broken(item, **kwargs):
        raise KeyError("question")

    with pytest.raises(LmiRequestError, match="Input formatter broken failed: 'question'"):
        apply_input_formatter(broken, Input())
    with pytest.raises(LmiRequestError, match="Missing required field 'inputs'"):
        apply_input_formatter(lambda item: {"parameters": {}}, Input())
    with pytest.raises(LmiRequestError, match="JSON object"):
        apply_input_formatter(lambda item: "just text", Input())


def test_input_formatter_may_return_a_request():
    req = RollingRequest("x", parse_rolling_request({"inputs": "x"}).parameters)
    assert apply_input_formatter(lambda item: req, Input()) is req


def test_formatter_dataclass_shape():
    f = OutputFormatter("x", "text/plain", render_final=lambda c, e, o=(): "body")
    assert f.render_body(ctx(), events()) == "body" and f.streams(True) is False
