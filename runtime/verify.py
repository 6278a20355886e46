"""The verifier: a pure function of (proposal, target logits, sampling config, rng).

Contract (as in llama.cpp's header): given k drafted tokens and the target's
logits for the k+1 positions ``[last_committed, d1..dk]``, return between 1 and
k+1 tokens to commit. The first ``n_accepted`` are draft tokens; the last one is
the target's own token (a correction after a rejection, or a bonus token when
every draft token was accepted). Always at least one token, so a step never stalls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .sampling import SamplingConfig, sample, warp

# A top-2 logit gap below this is a "near-tie": there a (k+1)-token verify may pick a
# different argmax than a 1-token step, because float sums are not batch-invariant.
# Export measures each graph's verify-vs-step logit difference among each row's top tokens
# (export/validate.py batch_variance) and the Generator uses twice that (see near_tie_gap()).
# This default is for bundles without the measurement: fp32 graphs differ by <1e-5 (0 on the
# fused-GQA SmolLM2 graph), int4 MatMulNBits with int8 activations by 0.2-1.0 logits (Qwen2.5
# 1.5B, SmolLM2 135M, measured here).
NEAR_TIE_GAP = 1e-3
QUANTIZED_NEAR_TIE_GAP = 2.0


def near_tie_gap(precision: str, measured_variance: float | None = None) -> float:
    """The top-2 gap under which a target's argmax may flip between verify and step shapes."""
    if measured_variance is not None:
        return max(2.0 * measured_variance, NEAR_TIE_GAP)
    return NEAR_TIE_GAP if precision == "fp32" else QUANTIZED_NEAR_TIE_GAP


@dataclass(frozen=True)
class Proposal:
    """What a drafter proposes for one step.

    ``tokens``: int64 ``[k']`` with 0 <= k' <= k. ``draft_probs``: float64
    ``[k', V]``, the warped draft distribution each token was drawn from, or
    None for deterministic drafters (n-gram lookup), which count as point masses.
    ``from_model``: a draft model ran to make it (False: a lookup, which runs none); the
    loop's step accounting reads it, the verifier does not.
    """

    tokens: np.ndarray
    draft_probs: np.ndarray | None = None
    from_model: bool = False

    @staticmethod
    def empty() -> "Proposal":
        return Proposal(np.zeros(0, np.int64))


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # 1..k+1 tokens to commit
    n_accepted: int  # how many of them are draft tokens
    near_ties: int = 0  # committed positions whose target top-2 gap was below the near-tie gap (greedy only)


def verify(proposal: Proposal, target_logits: np.ndarray, config: SamplingConfig,
           rng: np.random.Generator | None, near_tie: float = NEAR_TIE_GAP) -> Verdict:
    """Dispatch to the greedy or the speculative-sampling rule.

    ``target_logits``: float32 ``[k'+1, V]`` for positions ``[last, d1..dk']``.
    """
    if config.greedy:
        return verify_greedy(proposal.tokens, target_logits, near_tie)
    return verify_sampling(proposal, target_logits, config, rng)


def verify_greedy(draft_tokens: np.ndarray, target_logits: np.ndarray, near_tie: float = NEAR_TIE_GAP) -> Verdict:
    """Accept draft tokens up to the first mismatch with the target's argmax, then the target's token."""
    target_ids = np.argmax(target_logits, axis=-1)
    k = len(draft_tokens)
    mismatch = np.nonzero(target_ids[:k] != draft_tokens)[0]
    n = int(mismatch[0]) if len(mismatch) else k
    committed = [int(t) for t in draft_tokens[:n]] + [int(target_ids[n])]
    # Top-2 gap of each committed position, from the argmax already taken: masking the top
    # entry and taking the max is 3x cheaper than np.partition over a 150k vocabulary.
    rows_idx = np.arange(n + 1)
    rows = target_logits[: n + 1]
    top = rows[rows_idx, target_ids[: n + 1]]
    rest = rows.copy()
    rest[rows_idx, target_ids[: n + 1]] = -np.inf
    near = int(np.count_nonzero(top - rest.max(axis=-1) < near_tie))
    return Verdict(committed, n, near)


def verify_sampling(proposal: Proposal, target_logits: np.ndarray, config: SamplingConfig,
                    rng: np.random.Generator) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

    Token i is accepted with probability min(1, p_target(d_i) / p_draft(d_i)). At the
    first rejection the correction is drawn from normalize(max(p_target - p_draft, 0)),
    which makes the committed token distributed exactly as p_target. If all are accepted,
    a bonus token is drawn from the target's last position.
    """
    draft_tokens = proposal.tokens
    k = len(draft_tokens)
    p_target = warp(target_logits[: k + 1], config)  # [k+1, V]
    committed: list[int] = []
    for i in range(k):
        token = int(draft_tokens[i])
        if proposal.draft_probs is None:
            p_draft_row = np.zeros_like(p_target[i])
            p_draft_row[token] = 1.0  # a deterministic drafter proposes with certainty
        else:
            p_draft_row = proposal.draft_probs[i]
        q = p_draft_row[token]
        ratio = p_target[i, token] / q if q > 0 else 0.0
        if rng.random() < min(1.0, ratio):
            committed.append(token)
            continue
        residual = np.maximum(p_target[i] - p_draft_row, 0.0)
        total = residual.sum()
        # An all-zero residual only happens when p_target == p_draft up to rounding;
        # then p_target itself is the exact correction distribution.
        correction = sample(residual / total, rng) if total > 1e-12 else sample(p_target[i], rng)
        return Verdict(committed + [correction], i)
    committed.append(sample(p_target[k], rng))
    return Verdict(committed, k)
