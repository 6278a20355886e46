"""Invariant: a bundle encodes text as its source's own tokenizer does, and export refuses one that does not.

- A GGUF file's special-token rules come from its metadata: a tiny gemma3 GGUF written with Gemma 3's
  ``tokenizer.ggml.add_bos_token = True`` exports with ``add_bos_token`` true, and a raw prompt's ids
  (what ``specedge generate --raw`` encodes) start with ``<bos>`` and equal transformers' tokenization
  of the same GGUF file; greedy generation then equals transformers' on that file. (Before the parity
  check, the dequantized copy's unset flag became "no BOS", and real Gemma answered garbage.)
- Rules that live only in a tokenizer.json post-processor count too: a BOS it prepends is kept, an
  EOS it appends is refused by name (the runtime cannot append one).
- A bundle whose encoding differs from the source's fails export with TokenizerParityError, naming
  the text and the first differing token, before any graph is built.

Every other export (tests/integration/test_families.py and the rest) runs the same check.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tiny_models import CHAT_TEMPLATE, GEMMA_BOS_ID, gemma_tokens, hf_greedy, write_gguf

PROMPT = "The three primary colors of light are"
CONTEXT = 64
N_NEW = 16


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """SPECEDGE_CACHE for this module: the GGUF's dequantized copy lands (and is reused) here."""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECEDGE_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def gemma_gguf(tiny_model, tmp_path_factory, cache) -> Path:
    folder = tiny_model("gemma3_text", seed=3, vocab_size=len(gemma_tokens()))
    return write_gguf(folder, tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf")


@pytest.fixture(scope="module")
def gemma_bundle(gemma_gguf, tmp_path_factory) -> Path:
    from specedge.export.bundle import ExportConfig, export_bundle

    out = tmp_path_factory.mktemp("bundles") / "gemma"
    export_bundle(ExportConfig(target=str(gemma_gguf), out=out, quiet=True, max_context=CONTEXT))
    return out


def _gguf_tokenizer(gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def test_a_gemma_gguf_that_asks_for_bos_exports_with_it_and_generates_as_transformers(gemma_gguf, gemma_bundle,
                                                                                      load_generator):
    import torch
    from transformers import AutoModelForCausalLM

    from specedge.bundle.manifest import load_manifest

    assert load_manifest(gemma_bundle).tokenizer.add_bos_token is True
    reference = _gguf_tokenizer(gemma_gguf)
    expected_ids = reference.encode(PROMPT)
    gen = load_generator(gemma_bundle)
    out = gen.generate(PROMPT, chat=False, max_new_tokens=N_NEW, speculation=False)  # what --raw runs
    assert out.prompt_ids[0] == GEMMA_BOS_ID
    assert out.prompt_ids == expected_ids
    model = AutoModelForCausalLM.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name,
                                                 dtype=torch.float32).eval()
    assert out.token_ids == hf_greedy(model, expected_ids, N_NEW)
    # The chat template writes <bos> itself: the runtime does not double it, nor does transformers.
    messages = [{"role": "user", "content": "Hello world"}]
    chat_ids = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert gen.codec.encode_chat(messages) == list(chat_ids)
    assert chat_ids[:2] == [GEMMA_BOS_ID, reference.convert_tokens_to_ids("<start_of_turn>")]


def test_dropping_the_gguf_bos_rule_fails_export_naming_the_text_and_first_token(gemma_gguf, tmp_path,
                                                                                monkeypatch):
    """The old behaviour (an unset flag read as "no BOS"), put back by hand, is caught by the check."""
    from specedge.errors import TokenizerParityError
    from specedge.export import bundle
    from specedge.export.bundle import ExportConfig, export_bundle

    monkeypatch.setattr(bundle, "added_bos", lambda tokenizer: False)
    with pytest.raises(TokenizerParityError, match=rf"text '{PROMPT}' differently .* first difference at token 0: "
                                                   rf"ours \d+ 'The' vs source {GEMMA_BOS_ID} '<bos>'"):
        export_bundle(ExportConfig(target=str(gemma_gguf), out=tmp_path / "b", quiet=True, max_context=CONTEXT))
    assert not (tmp_path / "b").exists()


def test_an_encoding_that_differs_from_the_source_fails_export(tiny_model, tmp_path, monkeypatch):
    """Any difference between the runtime's encoding and transformers' fails, whatever its cause."""
    from specedge.errors import TokenizerParityError
    from specedge.export.bundle import ExportConfig, export_bundle
    from specedge.runtime.text import TextCodec

    plain_encode = TextCodec.encode
    monkeypatch.setattr(TextCodec, "encode", lambda self, text: plain_encode(self, text)[:-1])
    with pytest.raises(TokenizerParityError, match=r"first difference at token \d+: ours \(end\) vs source \d+ "):
        export_bundle(ExportConfig(target=str(tiny_model("llama")), out=tmp_path / "b", quiet=True,
                                   max_context=CONTEXT))


def _with_post_processor(folder: Path, dst: Path, template: str, chat_template: str | None = None) -> Path:
    """A copy of ``folder`` whose tokenizer.json post-processor adds special tokens (no flag says so),
    with ``chat_template`` in place of the tiny one when given."""
    shutil.copytree(folder, dst)
    if chat_template is not None:
        config = json.loads((dst / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (dst / "tokenizer_config.json").write_text(json.dumps(config))
        (dst / "chat_template.jinja").write_text(chat_template)
    path = dst / "tokenizer.json"
    obj = json.loads(path.read_text())
    obj["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": t, "type_id": 0}} if t.startswith("<") else
                   {"Sequence": {"id": "A", "type_id": 0}} for t in template.split()],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in (("<s>", 0), ("</s>", 1))},
    }
    path.write_text(json.dumps(obj))
    return dst


def _bundle_codec(folder: Path, out: Path):
    """(the bundle's codec, the source tokenizer, its BOS rule) as export writes and checks them,
    without building graphs."""
    from transformers import AutoTokenizer

    from specedge.export.bundle import _save_tokenizer
    from specedge.export.loader import LoadedModel
    from specedge.export.tokenizer_parity import added_bos, source_tokenizer
    from specedge.runtime.loading import load_codec

    reference = source_tokenizer(LoadedModel(None, AutoTokenizer.from_pretrained(str(folder)), "tiny", (1,), folder))
    out.mkdir()
    entry = _save_tokenizer(reference, out, add_bos_token=added_bos(reference))
    return load_codec(out, entry), reference, entry.add_bos_token


def test_a_bos_that_only_a_post_processor_adds_is_kept(tiny_model, tmp_path):
    from specedge.export.tokenizer_parity import check_parity

    folder = _with_post_processor(tiny_model("llama"), tmp_path / "src", "<s> A",
                                  chat_template="{{ bos_token }}" + CHAT_TEMPLATE)
    codec, reference, add_bos = _bundle_codec(folder, tmp_path / "bundle")
    assert reference("w006").input_ids == [0, 6] and add_bos is True
    assert codec.encode("w006 w007") == [0, 6, 7]
    report = check_parity(codec, reference, add_bos)
    assert report.texts > 10 and report.conversations == 3


def test_a_chat_encoding_that_differs_from_the_source_fails(tiny_model, tmp_path):
    """The runtime prepends the BOS the tokenizer adds to a chat too; transformers' apply_chat_template
    leaves BOS to the template. A template that writes none then encodes differently: refused."""
    from specedge.errors import TokenizerParityError
    from specedge.export.tokenizer_parity import check_parity

    folder = _with_post_processor(tiny_model("llama"), tmp_path / "src", "<s> A", chat_template=CHAT_TEMPLATE)
    codec, reference, add_bos = _bundle_codec(folder, tmp_path / "bundle")
    with pytest.raises(TokenizerParityError, match=r"encodes chat \['user'\] .* first difference at token 0: "
                                                   r"ours 0 '<s>' vs source 3 'user'"):
        check_parity(codec, reference, add_bos)


def test_an_eos_a_post_processor_appends_is_refused_by_name(tiny_model, tmp_path):
    from specedge.errors import TokenizerParityError
    from specedge.export.bundle import ExportConfig, export_bundle

    folder = _with_post_processor(tiny_model("llama"), tmp_path / "src", "A </s>")
    with pytest.raises(TokenizerParityError, match=r"appends 1 '</s>' to every text"):
        export_bundle(ExportConfig(target=str(folder), out=tmp_path / "b", quiet=True, max_context=CONTEXT))
