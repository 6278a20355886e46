"""Cheaper drafts (early-exit self-drafts, vocabulary-truncated draft heads) keep output identical.

Guards: the exporter validates both variants against PyTorch (first N layers, head
columns); the manifest records head_size/head_tokens and refuses inconsistent
ones; proposals stay inside the head's token subset; greedy output equals plain
greedy (exact mode); with sampling, p_draft is zero outside the subset and sums to 1 (so the
rejection rule stays exact).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from specedge.errors import InvalidParameterError, ManifestError
from specedge.export.bundle import ExportConfig, export_bundle
from specedge.bundle.manifest import load_manifest
from specedge.runtime.drafters import ModelDrafter
from specedge.runtime.generator import Generator
from specedge.runtime.sampling import SamplingConfig

from tiny_models import build_model

PROMPT = [7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    folder = build_model(root / "m", "llama", seed=31)
    out = root / "b"
    export_bundle(ExportConfig(target=str(folder), draft="self-int8", draft_layers=1, draft_vocab=64, out=out,
                               max_context=128, quiet=True))
    return out


def test_manifest_records_the_variant(bundle):
    m = load_manifest(bundle)
    assert m.draft.n_layers == 1 and m.target.n_layers == 2
    assert m.draft.head_size == 64 and m.draft.vocab_size == m.target.vocab_size
    assert m.draft.head_tokens in m.files
    report = m.extra.validation["draft:fp32-untied"]
    assert max(report.max_abs_diff.values()) < 1e-4  # compared with PyTorch's first layer, head columns


def test_greedy_output_unchanged_and_proposals_inside_head(bundle):
    g = Generator.from_bundle(bundle)
    plain = g.generate(input_ids=PROMPT, max_new_tokens=40, speculation=False, exact=True).token_ids
    for k in (1, 3, 6):
        assert g.generate(input_ids=PROMPT, max_new_tokens=40, draft_tokens=k, exact=True).token_ids == plain
    drafter = ModelDrafter(g.draft, SamplingConfig(), head_ids=g.draft_head_ids,
                           vocab_size=g.manifest.target.vocab_size)
    drafter.begin(np.array(PROMPT))
    proposal = drafter.propose(np.array(PROMPT), 6)
    assert set(proposal.tokens.tolist()) <= set(g.draft_head_ids.tolist())


def test_sampling_p_draft_lives_on_the_head(bundle):
    g = Generator.from_bundle(bundle)
    head = g.draft_head_ids
    drafter = ModelDrafter(g.draft, SamplingConfig(temperature=1.0), seed=0, head_ids=head,
                           vocab_size=g.manifest.target.vocab_size)
    drafter.begin(np.array(PROMPT))
    proposal = drafter.propose(np.array(PROMPT), 4)
    assert proposal.draft_probs.shape == (len(proposal.tokens), g.manifest.target.vocab_size)
    outside = np.setdiff1d(np.arange(g.manifest.target.vocab_size), head)
    assert np.all(proposal.draft_probs[:, outside] == 0)
    np.testing.assert_allclose(proposal.draft_probs.sum(-1), 1.0, atol=1e-9)
    for i, token in enumerate(proposal.tokens):
        assert proposal.draft_probs[i, token] > 0


def test_inconsistent_head_fields_are_refused(bundle, tmp_path):
    import shutil

    copy = shutil.copytree(bundle, tmp_path / "b")
    path = copy / "manifest.json"
    obj = json.loads(path.read_text())
    del obj["models"]["draft"]["head_tokens"]
    path.write_text(json.dumps(obj))
    with pytest.raises(ManifestError, match="head_size.*head_tokens.*go together"):
        load_manifest(copy)


def test_variant_options_are_checked_before_export(tmp_path):
    with pytest.raises(InvalidParameterError, match="draft_layers needs a self-draft"):
        ExportConfig(target="x", out=tmp_path / "o", draft="other-model", draft_layers=2)
    with pytest.raises(InvalidParameterError, match="draft_vocab needs a draft"):
        ExportConfig(target="x", out=tmp_path / "o", draft_vocab=100)
