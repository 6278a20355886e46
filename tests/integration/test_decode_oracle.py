"""Invariant: specedge's baseline loop is transformers' greedy decoding, token for token.

With speculation off, ``Generator.generate`` in exact mode (the 2-row steps the oracle validated;
fast 1-row steps where this machine's export recorded the graph as not row-invariant) must emit exactly the tokens of ``model.generate(do_sample=False)`` for every supported architecture; stop after
EOS with finish_reason "stop"; stop at max_new_tokens (or max_context) with
"length"; render chat prompts as transformers does; and stream deltas that add
up to the final text. A Generator reuses its caches, so repeated calls must not
leak state between generations.
"""

from __future__ import annotations

import pytest

from conftest import ARCHS, MAX_CONTEXT, PROMPT_IDS
from exactness import exact_holds
from tiny_models import hf_greedy, load_hf, word

N_TOKENS = 48


@pytest.fixture(scope="module")
def hf_reference(tiny_model):
    """transformers' greedy continuation of PROMPT_IDS per arch (computed once)."""
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = hf_greedy(load_hf(tiny_model(arch)), PROMPT_IDS, N_TOKENS)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_baseline_greedy_equals_transformers_generate(arch, arch_bundle, load_generator, hf_reference):
    expected = hf_reference(arch)
    assert len(expected) == N_TOKENS, "the fixture seed was chosen so that greedy meets no EOS"
    gen = load_generator(arch_bundle(arch))
    # Exact where this machine's export recorded the graph row-invariant (gpt2's standard graph is not
    # on every CPU: there exact mode is refused and its 1-row plain steps are compared).
    result = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, speculation=False, exact=exact_holds(gen))
    assert result.token_ids == expected
    assert result.finish_reason == "length"
    assert result.prompt_ids == PROMPT_IDS
    assert result.stats.new_tokens == N_TOKENS
    assert result.stats.steps == N_TOKENS - 1  # one target forward per token after the prefill's
    assert result.stats.drafted == 0 and result.stats.drafter == "none"
    if arch != "qwen2":  # see tiny_models: transformers rewrites the tiny qwen2 tokenizer
        assert result.text == " ".join(word(t) for t in expected if t > 2)  # specials are skipped


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_chat_prompt_renders_and_decodes_like_transformers(arch, tiny_model, arch_bundle, load_generator):
    from transformers import AutoTokenizer

    folder = tiny_model(arch)
    messages = [{"role": "system", "content": "w040 w041"}, {"role": "user", "content": "w010 w011 w012 w013"}]
    hf_ids = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    gen = load_generator(arch_bundle(arch))
    assert gen.encode_prompt(messages=messages) == list(hf_ids)
    result = gen.generate(messages=messages, max_new_tokens=24, speculation=False, exact=exact_holds(gen))
    assert result.token_ids == hf_greedy(load_hf(folder), list(hf_ids), 24)
    # A plain string prompt is wrapped as one user message.
    single = [{"role": "user", "content": "w010 w011"}]
    assert gen.encode_prompt("w010 w011") == gen.encode_prompt(messages=single)
    assert gen.encode_prompt("w010 w011", chat=False) == [10, 11]


@pytest.mark.parametrize("n", [1, 2, 7, 31])
def test_max_new_tokens_is_respected(n, llama_bundle, load_generator, hf_reference):
    result = load_generator(llama_bundle).generate(input_ids=PROMPT_IDS, max_new_tokens=n, speculation=False, exact=True)
    assert result.token_ids == hf_reference("llama")[:n]
    assert result.finish_reason == "length"
    assert result.stats.new_tokens == n == len(result.stats.token_times_s)


def _first_new_token_after(tokens: list[int], index: int) -> tuple[int, int]:
    """A token whose first occurrence in ``tokens`` is at position >= ``index``: (token, position)."""
    for pos in range(index, len(tokens)):
        if tokens[pos] not in tokens[:pos] and tokens[pos] > 2:
            return tokens[pos], pos
    raise AssertionError("no suitable EOS candidate in the greedy output")


def test_stops_at_the_eos_the_exporter_read_from_the_config(tiny_model, export, load_generator, hf_reference):
    """Make greedy's 6th-or-later new token the model's EOS: generation ends right after it."""
    eos, pos = _first_new_token_after(hf_reference("llama"), 5)
    folder = tiny_model("llama", eos_id=eos)  # same seed, same weights; only config + tokenizer EOS differ
    expected = hf_greedy(load_hf(folder), PROMPT_IDS, N_TOKENS)
    assert expected == hf_reference("llama")[:pos + 1]  # transformers stops there too

    bundle = export(folder)
    gen = load_generator(bundle)
    assert eos in gen.manifest.target.eos_token_ids
    result = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, speculation=False, exact=True)
    assert result.token_ids == expected
    assert result.token_ids[-1] == eos
    assert result.finish_reason == "stop"
    assert result.stats.new_tokens == pos + 1
    # EOS is the tokenizer's special eos token here, so the text stops before it.
    assert result.text == " ".join(word(t) for t in expected[:-1] if t > 2)


def test_eos_exactly_at_max_new_tokens_is_a_stop(tiny_model, export, load_generator, hf_reference):
    eos, pos = _first_new_token_after(hf_reference("llama"), 5)
    gen = load_generator(export(tiny_model("llama", eos_id=eos)))
    result = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=pos + 1, speculation=False, exact=True)
    assert result.token_ids[-1] == eos and len(result.token_ids) == pos + 1
    assert result.finish_reason == "stop"


def test_generation_ends_at_max_context_with_length(llama_bundle, load_generator, tiny_model):
    prompt = [(7 * i) % 290 + 6 for i in range(MAX_CONTEXT - 16)]
    gen = load_generator(llama_bundle)
    result = gen.generate(input_ids=prompt, max_new_tokens=100, speculation=False, exact=True)
    assert result.finish_reason == "length"
    assert "max_context" in result.message
    assert 0 < len(result.token_ids) <= MAX_CONTEXT - len(prompt)
    assert len(prompt) + len(result.token_ids) >= MAX_CONTEXT - 1  # it did not stop early
    assert result.token_ids == hf_greedy(load_hf(tiny_model("llama")), prompt, len(result.token_ids))


def test_streaming_deltas_concatenate_to_the_final_text(llama_bundle, load_generator):
    gen = load_generator(llama_bundle)
    full = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=40, speculation=False)
    stream = gen.stream(input_ids=PROMPT_IDS, max_new_tokens=40, speculation=False)
    deltas = list(stream)
    assert len(deltas) > 10  # one delta per committed token in plain decoding
    assert "".join(deltas) == full.text == stream.result.text
    assert stream.result.token_ids == full.token_ids
    seen = []
    gen.stream(input_ids=PROMPT_IDS, max_new_tokens=40, speculation=False, callback=seen.append)
    assert "".join(seen) == full.text


def test_repeated_calls_do_not_leak_state(llama_bundle, load_generator, hf_reference):
    gen = load_generator(llama_bundle)
    first = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=20, speculation=False, exact=True).token_ids
    gen.generate(input_ids=[50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63], max_new_tokens=30,
                 speculation=False, exact=True)
    again = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=20, speculation=False, exact=True).token_ids
    assert first == again == hf_reference("llama")[:20]
