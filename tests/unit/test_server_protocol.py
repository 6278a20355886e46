"""Invariant: the server's wire format (server/protocol.py, plain dicts, no HTTP) turns a valid OpenAI
request into the prompt and GenerationConfig the library would use, and anything else into a typed
4xx APIError naming the parameter; never a 500, never a silently ignored field.

Runs without the ``serve`` extra (protocol.py needs no starlette), on the numpy reference Generator.
The HTTP app itself is tested in tests/integration/test_server.py.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference_engine import PROMPT_IDS
from specedge.runtime.options import OPTIONS
from specedge.server import protocol
from specedge.server.protocol import APIError, parse_request

MODEL = "reference"


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    from reference_engine import reference_generator

    return reference_generator(tmp_path_factory.mktemp("server"))


def _parse(gen, kind: str, body: dict, **kw):
    return parse_request(kind, body, gen, model_name=MODEL, **kw)


def _refused(gen, kind: str, body: dict, status: int, param: str | None, match: str, **kw) -> APIError:
    with pytest.raises(APIError, match=match) as info:
        _parse(gen, kind, body, **kw)
    assert info.value.status == status and info.value.param == param, info.value.body()
    return info.value


def test_a_chat_request_is_the_templated_prompt_and_openais_defaults(gen):
    messages = [{"role": "developer", "content": "w020"}, {"role": "user", "content": "w010 w011"}]
    req = _parse(gen, "chat", {"model": MODEL, "messages": messages})
    expected = gen.encode_prompt(messages=[{"role": "system", "content": "w020"},
                                           {"role": "user", "content": "w010 w011"}])
    assert req.prompt_ids == expected and req.kind == "chat" and req.id.startswith("chatcmpl-")
    assert req.config.temperature == protocol.OPENAI_DEFAULT_TEMPERATURE  # OpenAI samples by default
    assert req.config.max_new_tokens == gen.max_context - len(expected)  # the room left in the context
    # a server cap (`serve --max-tokens`) bounds that default; the request's own value wins over it
    assert _parse(gen, "chat", {"messages": messages}, max_tokens=7).config.max_new_tokens == 7
    assert _parse(gen, "chat", {"messages": messages, "max_tokens": 9}, max_tokens=7).config.max_new_tokens == 9
    assert _parse(gen, "chat", {"messages": messages, "max_completion_tokens": 11},
                  max_tokens=7).config.max_new_tokens == 11
    assert _parse(gen, "completion", {"prompt": "w010"}, max_tokens=7).config.max_new_tokens == \
        protocol.COMPLETIONS_DEFAULT_MAX_TOKENS


def test_a_completion_takes_text_or_token_ids_and_16_tokens_by_default(gen):
    text = _parse(gen, "completion", {"prompt": "w010 w011", "temperature": 0})
    assert text.prompt_ids == gen.codec.encode("w010 w011") and text.config.temperature == 0
    assert text.config.max_new_tokens == protocol.COMPLETIONS_DEFAULT_MAX_TOKENS
    ids = _parse(gen, "completion", {"prompt": [PROMPT_IDS], "max_tokens": 5})
    assert ids.prompt_ids == PROMPT_IDS and ids.config.max_new_tokens == 5


def test_the_specedge_extension_sets_server_options(gen):
    """draft_window 0 spells None ("off"), as the option says."""
    body = {"prompt": PROMPT_IDS, "specedge": {"drafter": "suffix", "draft_tokens": 3, "draft_window": 0,
                                               "reuse_prefix": False}}
    config = _parse(gen, "completion", body).config
    assert (config.drafter, config.draft_tokens, config.draft_window, config.reuse_prefix) == ("suffix", 3, None, False)
    assert set(protocol.SPECEDGE_FIELDS) == {name for name, option in OPTIONS.items() if option.server}


@pytest.mark.parametrize("kind, body, status, param, match", [
    ("chat", {}, 400, "messages", "messages is required"),
    ("chat", {"messages": []}, 400, "messages", "non-empty list"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "string or a list"),
    ("chat", {"messages": [{"role": "user", "content": "w010"}], "n": 2}, 400, "n", "n must be 1"),
    ("chat", {"messages": [{"role": "user", "content": "w010"}], "model": "other"}, 404, "model", "does not exist"),
    ("completion", {"prompt": PROMPT_IDS, "logprobs": 2}, 400, "logprobs", "logprobs"),
    ("completion", {"prompt": PROMPT_IDS, "specedge": {"gamma": 4}}, 400, "specedge.gamma", "unknown specedge field"),
    ("completion", {"prompt": PROMPT_IDS, "specedge": {"draft_tokens": 999}}, 400, "specedge.draft_tokens",
     "draft_tokens"),
    ("completion", {"prompt": PROMPT_IDS, "temperature": 9}, 400, "temperature", "temperature"),
    ("completion", {"prompt": [96]}, 400, "prompt", r"outside \[0, 96\)"),
    ("completion", {"prompt": list(range(6, 90)) * 4}, 400, "prompt", "max_context is 256"),
])
def test_bad_requests_are_4xx_naming_the_parameter(gen, kind, body, status, param, match):
    _refused(gen, kind, body, status, param, match)


def test_speculation_a_server_cannot_give_is_refused(gen, tmp_path):
    from reference_engine import reference_generator

    body = {"prompt": PROMPT_IDS, "specedge": {"speculation": True}}
    _refused(gen, "completion", body, 400, "specedge.speculation", "speculation is off", speculation=False)
    targetonly = reference_generator(tmp_path / "no-draft", draft=None)
    _refused(targetonly, "completion", {"prompt": PROMPT_IDS, "specedge": {"drafter": "model"}}, 400,
             "specedge.drafter", "needs a draft model")


def test_the_response_bodies_carry_the_generated_text_and_usage(gen):
    req = _parse(gen, "chat", {"messages": [{"role": "user", "content": "w010"}], "max_tokens": 6, "temperature": 0})
    result = gen.generate(input_ids=req.prompt_ids, config=req.config)
    body = protocol.completion_body(req, result)
    assert body["choices"][0]["message"]["content"] == result.text and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(req.prompt_ids), "completion_tokens": 6,
                             "total_tokens": len(req.prompt_ids) + 6,  # cached: OpenAI's name for reused
                             "prompt_tokens_details": {"cached_tokens": result.stats.reused_tokens}}
    assert body["specedge"]["drafted"] == result.stats.drafted
    last = protocol.chunk(req, result=result)
    assert last["choices"][0]["finish_reason"] == "length" and last["object"] == "chat.completion.chunk"


_json = st.recursive(st.none() | st.booleans() | st.integers(-3, 300) | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=12)
_fields = st.sampled_from(["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed",
                           "stop", "stream", "stream_options", "n", "specedge", "logprobs", "user", "max_completion_tokens"])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["chat", "completion"]), body=st.dictionaries(_fields, _json, max_size=6))
def test_random_bodies_parse_or_are_a_typed_4xx(gen, kind, body):
    try:
        req = _parse(gen, kind, body)
    except APIError as exc:
        assert 400 <= exc.status < 500, exc.body()
        assert exc.message
        return
    assert req.prompt_ids and all(0 <= t < gen.manifest.target.vocab_size for t in req.prompt_ids)


def test_exact_mode_is_the_servers_default_only_when_started_with_exact(gen):
    body = {"prompt": PROMPT_IDS}
    assert _parse(gen, "completion", body).config.exact is False  # fast by default
    assert _parse(gen, "completion", body, exact=True).config.exact is True  # serve --exact
    own = {"prompt": PROMPT_IDS, "specedge": {"exact": False}}
    assert _parse(gen, "completion", own, exact=True).config.exact is False  # the request's own value wins
    assert _parse(gen, "completion", {**own, "specedge": {"exact": True}}).config.exact is True
    _refused(gen, "completion", {"prompt": PROMPT_IDS, "specedge": {"exact": 1}}, 400, "specedge.exact", "a bool")


def test_serve_exact_refuses_a_bundle_exact_mode_cannot_run_at_start(gen, monkeypatch):
    pytest.importorskip("starlette")
    from dataclasses import replace

    from specedge.bundle.extra import ExactSteps
    from specedge.errors import InvalidParameterError
    from specedge.server.app import create_app

    not_invariant = replace(gen.manifest.extra, exact_steps={"target": ExactSteps(False, 1.3, 2.0)})
    monkeypatch.setattr(gen, "manifest", replace(gen.manifest, extra=not_invariant))
    with pytest.raises(InvalidParameterError, match="not row-invariant"):
        create_app(gen, exact=True, warmup=False)
    create_app(gen, warmup=False)  # fast mode serves it
