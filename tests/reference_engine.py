"""A torch-free reference engine: a tiny llama-like transformer in numpy, and a Generator on it.

Why: the runtime (loop, verifier, drafters, controller, cost model, Generator, server protocol)
talks to models only through the :class:`specedge.engines.base.Engine` protocol. With this engine
its unit tests run in the edge install (numpy, onnxruntime, tokenizers, click, jinja2), with no
export and no torch. The ONNX Runtime engine and the exporter are tested in tests/integration.

The model: token embedding, ``n_layers`` x (RMSNorm -> GQA attention with RoPE -> residual,
RMSNorm -> SwiGLU MLP -> residual), final RMSNorm, an untied output layer. Random float32
weights drawn from a fixed seed (:class:`ReferenceWeights`); :meth:`ReferenceWeights.perturbed`
adds seeded noise, which makes a draft that agrees with its target often but not always.

What is exact: :meth:`ReferenceEngine.forward` runs its n rows one at a time through the same
one-row code path (every row is a matrix-vector product; numpy's BLAS takes different kernels,
and so different rounding, for one row and for several). A row of an n-row forward is therefore
bit-identical, logits and K/V alike, to a 1-row forward at the same position on the same cache,
on every CPU. Two caches filled with the same tokens hold the same bits. Nothing else is promised:
results may differ between numpy builds, as ORT's differ between CPUs.

The Engine contract it keeps (as engines/ort.py does): K/V of the new tokens are written into
the loop-owned position-major :class:`KVCache` at positions ``kv.length ..``, ``kv.length``
advances by n, logits come back float32 ``[min(num_logits, n), vocab]`` for the last rows, an
overflow raises ContextOverflowError before anything is written, and the first forward on an
empty cache checks the logits are finite.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specedge.engines.base import KVCache, check_finite_logits
from specedge.errors import InvalidParameterError
from specedge.bundle.manifest import Manifest, ModelEntry, SpeculationDefaults, TokenizerEntry
from specedge.runtime.generator import Generator
from specedge.runtime.loading import LoadedBundle
from specedge.runtime.text import TextCodec
from tiny_models import CHAT_TEMPLATE, EOS_ID, PROMPT_IDS, SPECIALS, vocab, word


@dataclass(frozen=True)
class ReferenceConfig:
    """Shape of a reference model. ``n_heads`` must be a multiple of ``n_kv_heads`` (GQA groups)."""

    vocab_size: int = 96
    hidden: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    intermediate: int = 64
    max_context: int = 256
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    # Output-layer std: hidden 32 with std 0.35 gives logits of std ~2, so greedy top-2 gaps are
    # wide and temperature-1 softmaxes still spread over several tokens (chi-square tests need both).
    logit_std: float = 0.35

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads or self.hidden % self.n_heads or (self.hidden // self.n_heads) % 2:
            raise InvalidParameterError(f"reference model shape {self}: n_heads must be a multiple of n_kv_heads "
                                        "and hidden / n_heads an even head_dim")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads


@dataclass(frozen=True)
class ReferenceWeights:
    """float32 weights of one reference model. Matrices are stored ``[out, in]`` (y = W @ x)."""

    config: ReferenceConfig
    embed: np.ndarray  # [vocab, hidden]
    layers: tuple[dict[str, np.ndarray], ...]  # attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down
    final_norm: np.ndarray  # [hidden]
    lm_head: np.ndarray  # [vocab, hidden]

    @classmethod
    def random(cls, config: ReferenceConfig = ReferenceConfig(), seed: int = 0) -> "ReferenceWeights":
        """Gaussian weights from ``seed``: 1/sqrt(fan_in) scaling keeps the residual stream's size
        steady through the layers; norm gains 1 +- 0.1 (not all ones, so a norm that was skipped
        would show)."""
        rng = np.random.default_rng(seed)
        c = config
        kv_width = c.n_kv_heads * c.head_dim

        def matrix(rows: int, cols: int, std: float | None = None) -> np.ndarray:
            return (rng.standard_normal((rows, cols)) * (std or cols ** -0.5)).astype(np.float32)

        def gain(size: int) -> np.ndarray:
            return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)

        layers = tuple({"attn_norm": gain(c.hidden), "wq": matrix(c.hidden, c.hidden), "wk": matrix(kv_width, c.hidden),
                        "wv": matrix(kv_width, c.hidden), "wo": matrix(c.hidden, c.hidden), "mlp_norm": gain(c.hidden),
                        "w_gate": matrix(c.intermediate, c.hidden), "w_up": matrix(c.intermediate, c.hidden),
                        "w_down": matrix(c.hidden, c.intermediate)} for _ in range(c.n_layers))
        return cls(c, matrix(c.vocab_size, c.hidden, 1.0), layers, gain(c.hidden),
                   matrix(c.vocab_size, c.hidden, c.logit_std))

    def perturbed(self, scale: float, seed: int) -> "ReferenceWeights":
        """A copy with Gaussian noise of ``scale`` times each tensor's std added (drawn from ``seed``):
        a draft that agrees with this model often, not always."""
        rng = np.random.default_rng(seed)

        def noisy(w: np.ndarray) -> np.ndarray:
            return (w + scale * w.std() * rng.standard_normal(w.shape)).astype(np.float32)

        return ReferenceWeights(self.config, noisy(self.embed),
                                tuple({k: noisy(v) for k, v in layer.items()} for layer in self.layers),
                                noisy(self.final_norm), noisy(self.lm_head))


def _rms_norm(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    return (x / np.sqrt(np.mean(x * x) + eps) * gain).astype(np.float32)


class ReferenceEngine:
    """An :class:`specedge.engines.base.Engine` over :class:`ReferenceWeights` (see the module docstring).

    ``head_ids``: int64 ``[head_size]``: score only these token ids (a vocabulary-truncated draft
    head, as ``export --draft-vocab`` builds); logits are then ``[rows, head_size]``.
    """

    def __init__(self, weights: ReferenceWeights, *, max_context: int | None = None,
                 head_ids: np.ndarray | None = None) -> None:
        self.weights = weights
        self.config = c = weights.config
        self.vocab_size = c.vocab_size
        self.max_context = max_context or c.max_context
        self.head_ids = None if head_ids is None else np.asarray(head_ids, np.int64)
        self._lm_head = weights.lm_head if head_ids is None else weights.lm_head[self.head_ids]
        half = c.head_dim // 2
        inv_freq = c.rope_theta ** (-np.arange(half, dtype=np.float64) / half)
        angles = np.arange(self.max_context, dtype=np.float64)[:, None] * inv_freq[None, :]
        self._cos = np.cos(angles).astype(np.float32)  # [max_context, head_dim / 2]
        self._sin = np.sin(angles).astype(np.float32)
        self.forwards = 0  # forward calls so far (tests count sessions run)

    def new_cache(self) -> KVCache:
        c = self.config
        return KVCache(c.n_layers, c.n_kv_heads, c.head_dim, self.max_context, np.float32, "position-major")

    def _rope(self, x: np.ndarray, position: int) -> np.ndarray:
        """Rotate ``x`` ``[heads, head_dim]`` by ``position`` (llama's rotate-half convention)."""
        half = x.shape[-1] // 2
        cos, sin = self._cos[position], self._sin[position]
        a, b = x[:, :half], x[:, half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def _row(self, token: int, position: int, kv: KVCache) -> np.ndarray:
        """One token at ``position``: write its K/V into ``kv`` and return its final hidden state."""
        c, w = self.config, self.weights
        group = c.n_heads // c.n_kv_heads
        scale = np.float32(c.head_dim ** -0.5)
        h = w.embed[token].copy()
        for i, layer in enumerate(w.layers):
            x = _rms_norm(h, layer["attn_norm"], c.rms_eps)
            q = self._rope((layer["wq"] @ x).reshape(c.n_heads, c.head_dim), position)
            kv.keys[i][position] = self._rope((layer["wk"] @ x).reshape(c.n_kv_heads, c.head_dim), position)
            kv.values[i][position] = (layer["wv"] @ x).reshape(c.n_kv_heads, c.head_dim)
            keys = kv.keys[i][:position + 1]  # [T, kv_heads, head_dim]: the prefix plus this token
            values = kv.values[i][:position + 1]
            # GQA: query head j reads kv head j // group.
            scores = np.einsum("gqd,tgd->gqt", q.reshape(c.n_kv_heads, group, c.head_dim), keys) * scale
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs = scores / scores.sum(axis=-1, keepdims=True)
            attn = np.einsum("gqt,tgd->gqd", probs, values).reshape(c.hidden)
            h = h + layer["wo"] @ attn
            x = _rms_norm(h, layer["mlp_norm"], c.rms_eps)
            gate = layer["w_gate"] @ x
            h = h + layer["w_down"] @ (gate / (1.0 + np.exp(-gate)) * (layer["w_up"] @ x))  # SwiGLU
        return _rms_norm(h, w.final_norm, c.rms_eps)

    def forward(self, input_ids: np.ndarray, kv: KVCache, num_logits: int = 1) -> np.ndarray:
        """``input_ids`` int64 ``[n]`` at positions ``kv.length ..``; returns float32 logits
        ``[min(num_logits, n), vocab]`` (``head_size`` wide with ``head_ids``) for the last rows."""
        ids = np.asarray(input_ids, np.int64).reshape(-1)
        n = int(ids.shape[0])
        if n < 1:
            raise InvalidParameterError("forward needs at least one token")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise InvalidParameterError(f"token ids must lie in [0, {self.vocab_size}); got {ids.tolist()}")
        num_logits = max(1, min(int(num_logits), n))
        kv.reserve(n)
        start = kv.length
        self.forwards += 1
        hidden = [self._row(int(t), start + j, kv) for j, t in enumerate(ids)]
        logits = np.stack([self._lm_head @ x for x in hidden[n - num_logits:]]).astype(np.float32)
        kv.length = start + n
        if start == 0:
            check_finite_logits(logits, "reference", "reference")
        return logits


# ----------------------------------------------------------------------------- a Generator on it
# Seeds and settings the unit tests share. TARGET_SEED's greedy continuation of PROMPT_IDS runs
# 64 tokens without EOS and does not fall into a short loop (tests/unit/test_reference_engine.py
# pins both); DRAFT is the target plus noise: it agrees with the target on most greedy steps, not
# all (the same test pins that too), so a drafter meets both accepted and corrected blocks.
TARGET_SEED = 0
DRAFT_NOISE = 0.1  # times each tensor's std: greedy agreement ~0.6, sampling overlap ~0.84
DRAFT_SEED = 1


def write_tokenizer(folder: Path, size: int) -> None:
    """tokenizer.json (a WordLevel tokenizer over ``size`` words of tests/tiny_models.py's vocabulary,
    the specials marked special) and chat_template.jinja, written with the tokenizers library alone."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab(size), unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def model_entry(engine: ReferenceEngine, role: str) -> ModelEntry:
    c = engine.config
    head = 0 if engine.head_ids is None else len(engine.head_ids)
    return ModelEntry(graph=f"{role}/reference", architecture="reference", source=f"reference ({role})",
                      precision="fp32", n_layers=c.n_layers, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
                      head_dim=c.head_dim, hidden_size=c.hidden, vocab_size=c.vocab_size,
                      max_context=engine.max_context, eos_token_ids=(EOS_ID,),
                      head_tokens=f"{role}/head_tokens.bin" if head else None, head_size=head)


def reference_bundle(folder: Path, target: ReferenceEngine, draft: ReferenceEngine | None = None, *,
                     speculation: SpeculationDefaults = SpeculationDefaults()) -> LoadedBundle:
    """A :class:`LoadedBundle` as ``load_bundle`` returns it, over reference engines: a real
    Manifest and a real TextCodec (tokenizer.json and the chat template written to ``folder``)."""
    folder = Path(folder)
    write_tokenizer(folder, target.vocab_size)
    manifest = Manifest(target=model_entry(target, "target"),
                        tokenizer=TokenizerEntry(file="tokenizer.json", config=None, chat_template="chat_template.jinja",
                                                 bos_token=word(0), eos_token=word(EOS_ID)),
                        speculation=speculation, files={},
                        draft=None if draft is None else model_entry(draft, "draft"),
                        created_by="tests/reference_engine.py")
    codec = TextCodec(folder / "tokenizer.json", CHAT_TEMPLATE, bos_token=word(0), eos_token=word(EOS_ID))
    head_ids = None if draft is None or draft.head_ids is None else draft.head_ids
    return LoadedBundle(folder, manifest, codec, target, draft, head_ids, threads=1, cost_profile=None)


def target_weights(config: ReferenceConfig = ReferenceConfig(), seed: int = TARGET_SEED) -> ReferenceWeights:
    return ReferenceWeights.random(config, seed)


def draft_weights(target: ReferenceWeights, noise: float = DRAFT_NOISE, seed: int = DRAFT_SEED) -> ReferenceWeights:
    return target.perturbed(noise, seed)


def reference_generator(folder: Path, *, draft: str | ReferenceWeights | None = "perturbed",
                        config: ReferenceConfig = ReferenceConfig(), target_seed: int = TARGET_SEED,
                        speculation: SpeculationDefaults = SpeculationDefaults(), **generator_options) -> Generator:
    """A full Generator on reference engines, built in ``folder``.

    ``draft``: "perturbed" (the target plus DRAFT_NOISE: agrees often, not always), "self" (the
    target's own weights: every draft token is accepted), explicit weights, or None (no draft model).
    """
    weights = target_weights(config, target_seed)
    if isinstance(draft, str):
        draft = {"perturbed": lambda: draft_weights(weights), "self": lambda: weights}[draft]()
    target_engine = ReferenceEngine(weights)
    draft_engine = None if draft is None else ReferenceEngine(draft)
    return Generator(reference_bundle(folder, target_engine, draft_engine, speculation=speculation),
                     **generator_options)


def plain_greedy(engine: ReferenceEngine, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The reference's own greedy decoding, one token per forward, stopping after EOS: the oracle
    the runtime's outputs are compared with (it uses no runtime code but the KVCache)."""
    kv = engine.new_cache()
    logits = engine.forward(np.asarray(prompt, np.int64), kv)
    out: list[int] = []
    while len(out) < max_new_tokens and len(prompt) + len(out) < engine.max_context:
        token = int(np.argmax(logits[-1]))
        out.append(token)
        if token == EOS_ID or len(prompt) + len(out) >= engine.max_context:
            break
        logits = engine.forward(np.array([token], np.int64), kv)
    return out


__all__ = ["DRAFT_NOISE", "DRAFT_SEED", "PROMPT_IDS", "TARGET_SEED", "ReferenceConfig", "ReferenceEngine",
           "ReferenceWeights", "draft_weights", "model_entry", "plain_greedy", "reference_bundle",
           "reference_generator", "target_weights", "write_tokenizer"]
