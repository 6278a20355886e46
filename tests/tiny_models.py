"""Builders for the tiny random-weight models the oracle tests export (no downloads).

Every model is built from a fixed seed, saved with ``save_pretrained``
(safetensors) next to a word-level tokenizer with a small chat template, so
the exporter sees exactly what it sees for a real Hugging Face folder.

The vocabulary is ``<s> </s> <unk> user assistant system w006 w007 ...``:
fixed-width words, so no token's text is a prefix of another's and stop-string
tests can name a token's text unambiguously. Decoding a WordLevel tokenizer
joins tokens with single spaces.

Caveat: transformers 5 forces ``Qwen2Tokenizer`` (byte-level BPE rebuilt from the
vocab) onto any qwen2 folder, so a qwen2 bundle's tokenizer cannot encode these
words. qwen2 tests therefore pass ``input_ids``; text tests use llama and gpt2.

torch and transformers are imported inside the functions: test modules that
only need the constants (and the no-torch subprocess test) stay light.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

SPECIALS = ("<s>", "</s>", "<unk>")
ROLE_WORDS = ("user", "assistant", "system")
BOS_ID, EOS_ID = 0, 1
PROMPT_IDS = list(range(6, 26))  # 20 plain words, no chat template: the oracle tests' prompt
FIRST_WORD = len(SPECIALS) + len(ROLE_WORDS)  # id of the first "wNNN" word
# Jinja, rendered both by transformers (the exporter copies it) and by the runtime's sandbox.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant {% endif %}")

# HF initialises weights with std 0.02, which gives logits of std ~0.15 in a 64-wide
# model: top-2 gaps of ~1e-2 would make greedy argmax fragile under fp32 reordering.
# std 0.15 gives logits of std ~2, far-apart top-2 logits, and still-spread softmaxes.
INIT_STD = 0.15
HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2  # GQA: two query heads per kv head (gpt2 has no GQA)
N_POSITIONS = 256  # gpt2's learned position table; bundles use max_context <= this


def word(token_id: int) -> str:
    """The text of a token id in the tiny vocabulary."""
    if token_id < len(SPECIALS):
        return SPECIALS[token_id]
    if token_id < FIRST_WORD:
        return ROLE_WORDS[token_id - len(SPECIALS)]
    return f"w{token_id:03d}"


def vocab(size: int) -> dict[str, int]:
    return {word(i): i for i in range(size)}


def save_tokenizer(out: Path, size: int, eos_id: int = EOS_ID) -> None:
    """A WordLevel tokenizer over ``size`` words, saved as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab(size), unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # pad = unk: transformers 5 loads every qwen2 folder as Qwen2Tokenizer, which otherwise
    # appends its own pad token "<|endoftext|>" past the model's vocab.
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token=word(eos_id),
                                   unk_token="<unk>", pad_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def _config(arch: str, vocab_size: int, eos_id: int, overrides: dict | None = None) -> Any:
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, bos_token_id=BOS_ID, eos_token_id=eos_id, initializer_range=INIT_STD)
    llama_like = dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512, **common)
    if arch == "llama":
        cls, fields = LlamaConfig, dict(llama_like, tie_word_embeddings=False)
    elif arch == "mistral":
        # Mistral: llama's layout plus a sliding window (none here unless overridden).
        cls, fields = MistralConfig, dict(llama_like, head_dim=HIDDEN // HEADS, tie_word_embeddings=False,
                                          sliding_window=None)
    elif arch == "qwen2":
        # Qwen2: q/k/v projections carry biases, embeddings tied to the output layer.
        cls, fields = Qwen2Config, dict(llama_like, tie_word_embeddings=True, use_sliding_window=False)
    elif arch == "gpt2":
        cls, fields = GPT2Config, dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=N_POSITIONS,
                                       activation_function="gelu_new", **common)
    elif arch in FAMILY_FIELDS:
        from transformers import AutoConfig

        return AutoConfig.for_model(arch, **{**llama_like, **FAMILY_FIELDS[arch], **(overrides or {})})
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    return cls(**{**fields, **(overrides or {})})


# The other families (tests/integration/test_families.py), by model_type: llama_like's shape plus what each
# family names differently or needs to show its features.
FAMILY_FIELDS: dict[str, dict] = {
    "qwen3": dict(head_dim=HIDDEN // HEADS, tie_word_embeddings=False),
    "gemma2": dict(head_dim=HIDDEN // HEADS, query_pre_attn_scalar=24, sliding_window=8),
    "gemma3_text": dict(head_dim=HIDDEN // HEADS, query_pre_attn_scalar=24, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(tie_word_embeddings=False, pad_token_id=None),
    "smollm3": dict(tie_word_embeddings=False, pad_token_id=None),
    "granite": dict(tie_word_embeddings=False),
    "olmo2": dict(tie_word_embeddings=False),
    "stablelm": dict(tie_word_embeddings=False),
    "gpt_neox": dict(tie_word_embeddings=False),
    "starcoder2": dict(tie_word_embeddings=True),
}


def _model_class(config: Any) -> Any:
    """The causal-LM class transformers pairs with this config class (LlamaForCausalLM, GPT2LMHeadModel, ...)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def build_model(out: Path, arch: str, seed: int, *, vocab_size: int = 300, tokenizer_size: int | None = None,
                eos_id: int = EOS_ID, perturb: tuple[Path, float] | None = None,
                config: dict | None = None) -> Path:
    """Write a tiny random model folder (safetensors + tokenizer) to ``out``; return ``out``.

    ``config``: transformers config fields that override the tiny defaults (a sliding window,
    a rope type, an activation, ...).

    ``perturb=(folder, scale)``: start from the weights saved in ``folder`` and add
    Gaussian noise of ``scale`` times each tensor's std, drawn from ``seed``. That gives
    a draft that agrees with its target often but not always.
    """
    import torch

    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    torch.manual_seed(seed)
    model_config = _config(arch, vocab_size, eos_id, config)
    cls = _model_class(model_config)
    model = cls(model_config).eval()
    gen = torch.Generator().manual_seed(seed + 10_000)
    with torch.no_grad():
        if perturb is not None:
            src, scale = perturb
            model.load_state_dict(cls.from_pretrained(str(src), dtype=torch.float32).state_dict())
            for p in model.parameters():
                p.add_(scale * p.std() * torch.randn(p.shape, generator=gen))
        else:
            # HF zero-initialises biases and sets norm weights to 1; random values make
            # the tests prove the exporter reads them (qwen2's qkv bias, gpt2's LayerNorm).
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.copy_(INIT_STD * torch.randn(p.shape, generator=gen))
                elif "norm" in name or ".ln_" in name:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(out))
    save_tokenizer(out, tokenizer_size or vocab_size, eos_id)
    return out


def load_hf(folder: Path) -> Any:
    """The transformers model of a tiny folder, float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def hf_greedy(model: Any, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding (stops after the config's EOS, like specedge)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([input_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=model.config.eos_token_id, attention_mask=torch.ones(1, len(input_ids),
                                                                                              dtype=torch.long))
    return out[0, len(input_ids):].tolist()


def assert_model_drafts_equal_plain(gen, prompts=([1, 5, 9, 13, 2, 7], [1, 40, 41, 42]), n: int = 24) -> None:
    """Exact-mode speculation with the bundle's draft model equals plain greedy decoding on ``prompts``."""
    for prompt in prompts:
        plain = gen.generate(input_ids=prompt, max_new_tokens=n, speculation=False, chat=False, exact=True)
        spec = gen.generate(input_ids=prompt, max_new_tokens=n, chat=False, drafter="model", exact=True)
        assert spec.token_ids == plain.token_ids, prompt


def edit_manifest(bundle: Path, edit) -> dict:
    """Apply ``edit(obj)`` to bundle/manifest.json in place (manifest.json has no checksum of its own)."""
    path = Path(bundle) / "manifest.json"
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj, indent=2))
    return obj


def copy_bundle(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# A Gemma-style sentencepiece vocabulary for tiny gemma3 GGUF files, laid out as Gemma 3's: the
# control tokens first (<pad> <eos> <bos> <unk> <mask>, then the chat markers), the 256 byte-fallback
# tokens, single characters, then a few words with every prefix (transformers rebuilds Gemma's merges
# from the vocabulary, so each word needs a chain of pieces to be merged from).
GEMMA_CONTROL = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>")
GEMMA_BOS_ID, GEMMA_EOS_ID = 2, 1
GEMMA_WORDS = ("The", "three", "primary", "colors", "of", "light", "are", "red", "green", "blue", "Hello",
               "world", "user", "model", "What", "is", "and")
# Gemma 3's chat template in miniature: it writes <bos> itself, as the real one does.
GEMMA_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                       "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
                       "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def gemma_tokens() -> list[str]:
    """The tiny Gemma vocabulary (``GEMMA_CONTROL``, bytes, characters, word prefixes), in id order."""
    import string

    tokens = list(GEMMA_CONTROL) + [f"<0x{b:02X}>" for b in range(256)]
    tokens += ["\u2581", "\n", "\t"] + list(string.ascii_letters + string.digits + string.punctuation)
    for word in GEMMA_WORDS:
        for spelled in (word, "\u2581" + word):
            tokens += [spelled[:n] for n in range(2, len(spelled) + 1)]
    return list(dict.fromkeys(tokens))


# Byte offsets of the fp16 scale fields in one block of the K-quant types write_gguf fills at random.
_K_FP16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _gguf_blocks(data: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """``data`` [rows, cols] float32 as GGML ``kind`` blocks, [rows, bytes] uint8 (see :func:`write_gguf`)."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[kind]
    if kind not in _K_FP16_FIELDS:
        return gguf.quantize(data, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (data.shape[0], data.shape[1] // block, size), dtype=np.uint8)
    # |value| up to about 3 std: Q4_K/Q5_K d*sc*q (sc < 64, q < 32), Q6_K d*sc*(q-32) (|sc| <= 128).
    step = 3 * float(data.std()) / (64 * 32 if kind != "Q6_K" else 128 * 32)
    for offset in _K_FP16_FIELDS[kind]:
        scale = (rng.uniform(0.5, 1.5, raw.shape[:2]) * step).astype(np.float16)
        raw[..., offset:offset + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(data.shape[0], -1)


def write_gguf(folder: Path, out: Path, types: dict[str, str] | None = None, seed: int = 0) -> Path:
    """Write the tiny model in ``folder`` as a GGUF file the way llama.cpp's converter names it.

    ``types``: GGUF tensor name, or its name within a block ("attn_v.weight"), -> GGML type name
    ("Q4_0", "Q6_K", ...); other tensors are F32. Types the ``gguf`` package quantizes (Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0) quantize the model's weights; it has no K-quant quantizer, so Q4_K, Q5_K and
    Q6_K tensors are random blocks (``seed``) scaled to the weight's magnitude: the file then
    defines those weights, and transformers' dequantization of it is the reference.

    Tensor names come from the ``gguf`` package's own HF -> GGUF name map. Families written: qwen3
    (its GGUF tensors are the HF tensors renamed; the tokenizer is a byte-level BPE vocabulary
    without merges, so tests pass token ids) and gemma3_text (norm weights stored as 1 + w, as
    llama.cpp's converter writes them; the tiny Gemma sentencepiece vocabulary of
    :func:`gemma_tokens`, which the model's vocab_size must match, with Gemma 3's tokenizer
    metadata: ``tokenizer.ggml.add_bos_token = True``, no EOS, no space prefix, a chat template).
    llama's q/k permutation would need the converter's rewrites too.
    """
    import gguf

    import numpy as np

    model = load_hf(folder)
    cfg = model.config
    rng = np.random.default_rng(seed)
    if cfg.model_type not in ("qwen3", "gemma3_text"):
        raise ValueError(f"write_gguf writes qwen3 and gemma3_text only, not {cfg.model_type!r}")
    gemma = cfg.model_type == "gemma3_text"
    arch = gguf.MODEL_ARCH.GEMMA3 if gemma else gguf.MODEL_ARCH.QWEN3
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(out), "gemma3" if gemma else "qwen3")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    rope = cfg.rope_parameters["full_attention"] if gemma else cfg.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if gemma:
        tokens = gemma_tokens()
        if len(tokens) != cfg.vocab_size:
            raise ValueError(f"a tiny gemma3 GGUF needs vocab_size={len(tokens)} (gemma_tokens()), not {cfg.vocab_size}")
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([gguf.TokenType.CONTROL if t in GEMMA_CONTROL and t != "<unk>" else
                                gguf.TokenType.UNKNOWN if t == "<unk>" else
                                gguf.TokenType.BYTE if t.startswith("<0x") else gguf.TokenType.NORMAL
                                for t in tokens])
        writer.add_token_scores([-float(i) for i in range(len(tokens))])
        writer.add_bos_token_id(GEMMA_BOS_ID)
        writer.add_eos_token_id(GEMMA_EOS_ID)
        writer.add_unk_token_id(GEMMA_CONTROL.index("<unk>"))
        writer.add_pad_token_id(GEMMA_CONTROL.index("<pad>"))
        # What Gemma 3's GGUF files say (tokenizer.ggml.*), and what a bundle must keep.
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        writer.add_add_space_prefix(False)
        writer.add_chat_template(GEMMA_CHAT_TEMPLATE)
    else:
        # transformers builds a Qwen2Tokenizer, which appends "<|endoftext|>" unless the vocabulary has it:
        # the last word takes that name, so the tokenizer keeps the model's vocab size.
        tokens = list(vocab(cfg.vocab_size))[:-1] + ["<|endoftext|>"]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types([gguf.TokenType.CONTROL if i < len(SPECIALS) else gguf.TokenType.NORMAL
                                for i in range(len(tokens))])
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_token_merges([])
        writer.add_bos_token_id(BOS_ID)
        writer.add_eos_token_id(cfg.eos_token_id)
    for name, tensor in model.state_dict().items():
        if gemma and name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: llama.cpp writes the embedding once
        data = tensor.float().numpy()
        if gemma and name.endswith("norm.weight"):
            data = data + 1.0  # Gemma's RMSNorm scales by (1 + w); the GGUF stores 1 + w
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        kind = (types or {}).get(gguf_name) or (types or {}).get(gguf_name.split(".", 2)[-1])
        if kind is None:
            writer.add_tensor(gguf_name, data)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(gguf_name, _gguf_blocks(data, kind, rng), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def model_json(**changes) -> dict:
    """A target model entry as a manifest records it (2 layers, vocab 64), with ``changes``."""
    model = {"graph": "target/model.onnx", "architecture": "llama", "source": "tiny", "precision": "fp32",
             "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "hidden_size": 32, "vocab_size": 64,
             "max_context": 128, "eos_token_ids": [2], "kv_dtype": "float32",
             "data_files": ["target/model.onnx.data"], "tokenizer_sha256": "", "attention": "standard",
             "io": {}}
    return {**model, **changes}


def manifest_json(*, version: int | None = None, extra: dict | None = None, **model_changes) -> dict:
    """A decoded manifest.json of a target-only bundle (files of empty content), for parser tests;
    ``version`` defaults to the current FORMAT_VERSION."""
    from specedge.bundle.manifest import FORMAT_VERSION

    version = FORMAT_VERSION if version is None else version
    digest = {"sha256": hashlib.sha256(b"").hexdigest(), "size": 0}
    return {"format": "specedge-bundle", "format_version": version, "created_by": "specedge 0.1.0",
            "models": {"target": model_json(**model_changes)},
            "tokenizer": {"file": "tokenizer.json", "config": None, "chat_template": None, "sha256": "",
                          "bos_token": None, "eos_token": None, "add_bos_token": False},
            "speculation": {"drafter": "ngram", "draft_tokens": 4, "max_draft_tokens": 8, "adaptive": True},
            "files": {name: digest for name in ("tokenizer.json", "target/model.onnx", "target/model.onnx.data")},
            "extra": {} if extra is None else extra}
