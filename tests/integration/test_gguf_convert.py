"""A GGUF file converted one tensor at a time equals transformers' whole-model conversion (issue #38).

Invariants guarded here:
- every tensor of the streamed folder equals, dtype and bits, what ``from_pretrained(gguf_file=...)``
  loads (K-quants, the affine and 8-bit types, Gemma's stored ``1 + w`` norms), with the rows
  dequantized in chunks and the tensors spread over several shards;
- the config, generation config and tokenizer files are the ones ``save_pretrained`` writes;
- the folder loads both ways export reads it (streamed, and whole by transformers);
- a family whose tensor processor merges tensors across the file is converted whole instead.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("torch")

from tiny_models import gemma_tokens, write_gguf  # noqa: E402

# K-quants need rows of 256: the tiny qwen3 at a width they take (as tests/integration/test_gguf_import.py).
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 128}
MIX = {"attn_q.weight": "Q4_K", "attn_k.weight": "Q4_K", "attn_v.weight": "Q6_K", "attn_output.weight": "Q4_1",
       "ffn_gate.weight": "Q5_K", "ffn_up.weight": "Q4_0", "ffn_down.weight": "Q5_0",
       "token_embd.weight": "Q8_0", "output.weight": "Q6_K"}


def _whole(gguf_path):
    """transformers' own conversion: state dict (numpy), config dict, generation config dict."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # save_pretrained drops the tied copy
    return state, model.config.to_dict() | {"class": type(model).__name__}, model.generation_config.to_dict()


def _streamed_folder(folder):
    from safetensors.numpy import load_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    state = {}
    for file in sorted(set(index["weight_map"].values())):
        state.update(load_file(folder / file))
    assert set(index["weight_map"]) == set(state)
    return state, len(set(index["weight_map"].values()))


@pytest.fixture(params=["qwen3-mix", "gemma3"])
def source(request, tiny_model, tmp_path):
    if request.param == "gemma3":
        return write_gguf(tiny_model("gemma3_text", seed=3, vocab_size=len(gemma_tokens())),
                          tmp_path / "tiny-gemma3.gguf")
    return write_gguf(tiny_model("qwen3", seed=0, config=SHAPE), tmp_path / "tiny-qwen3.gguf", types=MIX)


def test_a_streamed_conversion_equals_transformers_whole_one(source, tmp_path, monkeypatch):
    from specedge.export import gguf_convert

    # Rows and shards small enough that every weight is dequantized in several chunks and the
    # folder has many shards.
    monkeypatch.setattr(gguf_convert, "_DEQUANT_ROWS", 64)
    monkeypatch.setattr(gguf_convert, "SHARD_BYTES", 64 << 10)
    folder = tmp_path / "converted"
    folder.mkdir()
    calls = []
    gguf_convert.convert_gguf(source, folder, progress=lambda done, total: calls.append((done, total)))
    state, shards = _streamed_folder(folder)
    want, config, generation = _whole(source)
    want_class = config["class"]
    assert shards > 2
    assert sorted(state) == sorted(want)
    for name, array in want.items():
        assert state[name].dtype == array.dtype and np.array_equal(state[name], array), name
    saved = json.loads((folder / "config.json").read_text())
    assert saved["architectures"] == [want_class]
    for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "tie_word_embeddings", "rope_theta", "bos_token_id",
                "eos_token_id"):
        assert saved.get(key) == config.get(key), key
    assert "quantization_config" not in saved
    saved_generation = json.loads((folder / "generation_config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert saved_generation.get(key) == generation.get(key), key
    assert (folder / "tokenizer.json").is_file()
    assert [done for done, _ in calls] == list(range(calls[-1][1] + 1))  # 0 before the first tensor, then each


def test_the_converted_folder_loads_streamed_and_whole(source, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from specedge.export.gguf_convert import convert_gguf
    from specedge.export.streamed import load_streamed

    folder = tmp_path / "converted"
    folder.mkdir()
    convert_gguf(source, folder)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    whole = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    streamed = load_streamed(folder)
    assert streamed is not None
    with torch.no_grad():
        a = whole(ids).logits
        b = streamed(ids).logits
    assert torch.equal(a, b)


def test_a_processor_that_merges_tensors_is_converted_whole(tiny_model, tmp_path, monkeypatch):
    """A processor that stores tensors in ``parsed_parameters`` (as transformers' MoE ones do) stops the
    streamed conversion; load_gguf then converts the file through transformers whole, into a folder
    without the streamed attempt's leftovers."""
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    from specedge.export import gguf_convert
    from specedge.export.loader import load_gguf

    source = write_gguf(tiny_model("qwen3", seed=0, config=SHAPE), tmp_path / "tiny-qwen3.gguf")

    class Merging(hf_gguf.TensorProcessor):
        def process(self, weights, name, **kwargs):
            kwargs["parsed_parameters"]["tensors"]["merged." + name] = weights
            return hf_gguf.GGUFTensor(weights, None, {})

    with monkeypatch.context() as patch:
        patch.setitem(hf_gguf.TENSOR_PROCESSORS, "qwen3", Merging)
        folder = tmp_path / "streamed"
        folder.mkdir()
        with pytest.raises(gguf_convert.NotStreamable, match="Merging merges tensors"):
            gguf_convert.convert_gguf(source, folder)

    def refuse(path, folder, **_):
        (folder / "model-00001.safetensors").write_bytes(b"partial")
        raise gguf_convert.NotStreamable("a test's processor merges tensors across the file")

    monkeypatch.setattr(gguf_convert, "convert_gguf", refuse)
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path / "cache"))
    out, _ = load_gguf(source, quiet=True)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    want, _, _ = _whole(source)
    from safetensors.numpy import load_file

    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
