"""Tiny random-weight models for ``specedge doctor --verify``: a 2-layer Llama checkpoint with a
word-level tokenizer, exported to bundles in a scratch folder. torch and transformers are
imported only when a model is built (``exporter_missing`` says why they cannot be)."""

from __future__ import annotations

from pathlib import Path

VOCAB = 300


def exporter_missing() -> str | None:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        return (f"the exporter needs torch and transformers ({exc}): pip install 'specedge[export]' "
                "(the CPU torch wheel is enough)")
    return None


def build_tiny_model(out: Path, seed: int) -> Path:
    """A 2-layer random-weight Llama (hidden 64, 4 heads, 2 KV heads, vocab 300) with a word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    # std 0.15 (HF's 0.02 gives logits of std ~0.15 here): far-apart top-2 logits, so fp rounding on
    # another device cannot flip a greedy argmax.
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, initializer_range=0.15)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(str(out))
    words = ["<s>", "</s>", "<unk>"] + [f"w{i:03d}" for i in range(3, VOCAB)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<unk>").save_pretrained(str(out))
    return out


def export_tiny(work: Path, name: str, **options) -> Path:
    from .bundle import ExportConfig, export_bundle

    out = work / name
    if not out.exists():
        export_bundle(ExportConfig(target=str(work / "target"), draft=str(work / "draft"), out=out,
                                   max_context=128, quiet=True, **options))
    return out
