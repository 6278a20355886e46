"""Random-weight checkpoints with a real model's shape, for measuring an export without a download.

``write_fixture(shape, out)`` writes an HF folder (config.json, model.safetensors in fp16,
tokenizer.json, tokenizer_config.json) whose config carries the public architecture numbers of
a released model (``SHAPES``). The weights are seeded normal noise (std 0.02, HF's own init);
norm weights are 1. Nothing the size of the model is ever held in memory: the safetensors
header is computed from the shapes first, then each tensor is drawn and written in chunks of
at most ``CHUNK_BYTES``.

The tokenizer is a byte-level BPE over the 256 byte symbols with no merges (every text
encodes, one token per byte), padded with unreachable filler tokens up to the config's
vocabulary size, so the embedding and output layer have the real model's width.

Only numpy and the ``tokenizers`` library are imported: no torch.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import InvalidParameterError

INIT_STD = 0.02  # transformers' default initializer_range
CHUNK_BYTES = 64 << 20  # the most random data held at once while writing one tensor
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


@dataclass(frozen=True)
class Shape:
    """The architecture numbers of a released model (from its published config.json)."""

    model_type: str  # "llama" | "qwen2"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    rope_scaling: dict | None = None
    qkv_bias: bool = False  # qwen2: q/k/v projections carry biases
    extra: dict = field(default_factory=dict)  # further config.json fields

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(HF parameter name, shape) of every weight, in file order."""
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        yield "model.embed_tokens.weight", (self.vocab_size, h)
        for n in range(self.num_hidden_layers):
            p = f"model.layers.{n}"
            yield f"{p}.input_layernorm.weight", (h,)
            for name, rows in (("q", q), ("k", kv), ("v", kv)):
                yield f"{p}.self_attn.{name}_proj.weight", (rows, h)
                if self.qkv_bias:
                    yield f"{p}.self_attn.{name}_proj.bias", (rows,)
            yield f"{p}.self_attn.o_proj.weight", (h, q)
            yield f"{p}.post_attention_layernorm.weight", (h,)
            yield f"{p}.mlp.gate_proj.weight", (i, h)
            yield f"{p}.mlp.up_proj.weight", (i, h)
            yield f"{p}.mlp.down_proj.weight", (h, i)
        yield "model.norm.weight", (h,)
        if not self.tie_word_embeddings:
            yield "lm_head.weight", (self.vocab_size, h)

    @property
    def parameters(self) -> int:
        return sum(int(np.prod(s)) for _, s in self.tensors())

    @property
    def largest_tensor(self) -> int:
        """Elements of the largest single tensor (the issue's memory goal is stated against it)."""
        return max(int(np.prod(s)) for _, s in self.tensors())

    def config(self) -> dict:
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.model_type]
        cfg = {"architectures": [arch], "model_type": self.model_type, "hidden_size": self.hidden_size,
               "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
               "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
               "vocab_size": self.vocab_size, "tie_word_embeddings": self.tie_word_embeddings,
               "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
               "rms_norm_eps": self.rms_norm_eps, "hidden_act": "silu", "torch_dtype": "float16",
               "bos_token_id": self.vocab_size - 2, "eos_token_id": self.vocab_size - 1,
               "initializer_range": INIT_STD}
        if self.rope_scaling is not None:
            cfg["rope_scaling"] = self.rope_scaling
        return {**cfg, **self.extra}


_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
# Public architecture numbers of each model's released config.json.
SHAPES: dict[str, Shape] = {
    "llama-3.2-1b": Shape("llama", 2048, 8192, 16, 32, 8, 128256, True, 500000.0, 131072, 1e-5,
                          {**_LLAMA3_ROPE, "factor": 32.0}, extra={"head_dim": 64}),
    "llama-3.2-3b": Shape("llama", 3072, 8192, 28, 24, 8, 128256, True, 500000.0, 131072, 1e-5,
                          {**_LLAMA3_ROPE, "factor": 32.0}, extra={"head_dim": 128}),
    "llama-3.1-8b": Shape("llama", 4096, 14336, 32, 32, 8, 128256, False, 500000.0, 131072, 1e-5,
                          {**_LLAMA3_ROPE, "factor": 8.0}, extra={"head_dim": 128}),
    "qwen2.5-7b": Shape("qwen2", 3584, 18944, 28, 28, 4, 152064, False, 1000000.0, 32768, 1e-6, qkv_bias=True,
                        extra={"use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 28}),
}


def _safetensors_header(entries: list[tuple[str, tuple[int, ...]]]) -> bytes:
    """The 8-byte length + JSON header of an fp16 safetensors file holding ``entries`` in order."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in entries:
        size = int(np.prod(shape)) * 2
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * ((-len(body)) % 8)  # the data then starts 8-byte aligned
    return struct.pack("<Q", len(body)) + body


def _write_tensor(f, name: str, shape: tuple[int, ...], seed: int) -> None:
    """Draw one tensor in row chunks of at most CHUNK_BYTES (as fp32) and append it as fp16."""
    if name.endswith("norm.weight"):
        f.write(np.ones(shape, np.float16).tobytes())
        return
    rng = np.random.default_rng(seed)
    rows = shape[0]
    per_row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    step = max(1, CHUNK_BYTES // (4 * per_row))
    for start in range(0, rows, step):
        n = min(step, rows - start)
        chunk = rng.standard_normal((n, *shape[1:]), dtype=np.float32)
        chunk *= INIT_STD
        f.write(chunk.astype(np.float16).tobytes())


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A byte-level BPE without merges padded to ``vocab_size`` ids; BOS and EOS are the last two ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < len(alphabet) + 2:
        raise InvalidParameterError(f"vocab_size {vocab_size} is below the {len(alphabet) + 2} a byte-level "
                                    "tokenizer needs")
    vocab = {s: i for i, s in enumerate(alphabet)}
    # Fillers hold ids no merge can reach, so the embedding keeps the real model's width.
    vocab.update({f"<filler_{i}>": i for i in range(len(alphabet), vocab_size - 2)})
    vocab.update({BOS: vocab_size - 2, EOS: vocab_size - 1})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(BOS, special=True), AddedToken(EOS, special=True)])
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "model_max_length": 131072, "add_bos_token": False,
              "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def write_fixture(shape: Shape | str, out: Path, *, seed: int = 0) -> Path:
    """Write the random-weight HF folder of ``shape`` (a ``Shape`` or a name in ``SHAPES``) to ``out``; return ``out``.

    The folder is written under a temporary name and renamed when complete.
    """
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise InvalidParameterError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
        shape = SHAPES[shape]
    out = Path(out)
    if out.exists():
        raise InvalidParameterError(f"{out} already exists; choose another folder")
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    tmp.mkdir(parents=True)
    entries = list(shape.tensors())
    with open(tmp / "model.safetensors", "wb") as f:
        f.write(_safetensors_header(entries))
        for index, (name, dims) in enumerate(entries):
            _write_tensor(f, name, dims, seed * 100_003 + index)
    (tmp / "config.json").write_text(json.dumps(shape.config(), indent=2), encoding="utf-8")
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": shape.vocab_size - 2, "eos_token_id": shape.vocab_size - 1}), encoding="utf-8")
    write_tokenizer(tmp, shape.vocab_size)
    os.replace(tmp, out)
    return out
