"""Loading a bundle: manifest and checksums, tokenizer and chat template, engines.

Everything here runs once per Generator, before any generation; the result is a
frozen :class:`LoadedBundle` the Generator's call path reads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..engines import EngineOptions, backend_for, create_engine, runtime_description
from ..errors import BundleError, InvalidParameterError, ManifestError
from ..bundle.manifest import Manifest, TokenizerEntry, load_head_tokens, load_manifest, resolve_inside
from ..bundle.extra import CostProfile
from ..bundle.schema import choice
from .drafters import DRAFTER_CHOICES, needs_draft_model
from .text import TextCodec


@dataclass(frozen=True)
class LoadedBundle:
    bundle: Path
    manifest: Manifest
    codec: TextCodec
    target: object  # Engine
    draft: object | None  # Engine; None when the bundle has none or load_draft=False
    draft_head_ids: np.ndarray | None  # int32 [head_size]: a vocabulary-truncated draft head's ids
    threads: int  # intra-op threads the sessions were created with (0 = ORT default)
    cost_profile: CostProfile | None  # the manifest's measured step costs, when taken on this machine and setting
    runtime: str = ""  # the target's engines.runtime_description (backend, ORT version, provider)


def check_speculation(manifest: Manifest) -> None:
    """The manifest's drafter, checked against the registry (the format layer checks only its spelling)."""
    drafter = choice(manifest.speculation.drafter, DRAFTER_CHOICES, "speculation.drafter")
    if needs_draft_model(drafter) and manifest.draft is None:
        raise ManifestError(f"manifest field 'speculation.drafter' is {drafter!r} but the bundle has no models.draft")


def load_codec(bundle: Path, tok: TokenizerEntry) -> TextCodec:
    """The bundle's TextCodec as generation uses it: its tokenizer file, chat template and BOS rule.

    Export calls this too, on the bundle it is writing, to check tokenizer parity with the source.
    """
    template = None
    if tok.chat_template:
        try:
            template = resolve_inside(bundle, tok.chat_template).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise BundleError(f"chat template {tok.chat_template!r} is not UTF-8 text: {exc.reason} at byte "
                              f"{exc.start}") from None
    return TextCodec(resolve_inside(bundle, tok.file), template, bos_token=tok.bos_token,
                     eos_token=tok.eos_token, add_bos_token=tok.add_bos_token)


def load_bundle(path: str | Path, *, provider: str = "cpu", threads: int = 0, draft_threads: int | None = None,
                verify_checksums: bool = True, load_draft: bool = True,
                engine_options: EngineOptions | None = None) -> LoadedBundle:
    """Load a bundle folder written by ``specedge export`` (see ``Generator.from_bundle``)."""
    if isinstance(path, bool) or not isinstance(path, (str, Path)):
        raise InvalidParameterError(f"the bundle must be a folder path (str or Path); got {type(path).__name__}")
    bundle = Path(path)
    manifest = load_manifest(bundle, verify_checksums=verify_checksums)
    check_speculation(manifest)
    # Two sessions alternate on the same cores when a draft is loaded. ORT's worker threads
    # keep spinning after a run and would steal the other session's cores (the int4 Qwen pair's
    # k=4 speculation ran 9.4 tok/s that way, 14.8 with spinning off), but spinning off slows
    # every run's own parallel sections. So spinning stays on inside a run and stops when the
    # run returns (`specedge bench threads`, AVX-512 EPYC, 2 threads, Qwen int4 pair, off -> stop:
    # plain 14.96 -> 15.88 tok/s, model k=4 12.99 -> 14.02; with stop an idle draft no longer
    # slows plain decoding; docs/results/2026-12-03-spinning-qwen-int4-avx512.md).
    two_sessions = manifest.draft is not None and load_draft
    options = engine_options or EngineOptions(provider=provider, intra_op_threads=threads,
                                              stop_spinning_after_run=two_sessions)
    codec = load_codec(bundle, manifest.tokenizer)
    if codec.vocab_size > manifest.target.vocab_size:
        raise InvalidParameterError(f"tokenizer has {codec.vocab_size} tokens but the target's vocab_size is "
                                    f"{manifest.target.vocab_size}")
    # The engine registry picks the backend per model: CPU, the device-resident ORT engine, or a
    # native TensorRT plan the bundle records.
    target_graph = resolve_inside(bundle, manifest.target.graph)
    target = create_engine(manifest.target, target_graph, options,
                           backend_for(manifest.target, target_graph, options.provider))
    draft = None
    if manifest.draft is not None and load_draft:
        draft_options = replace(options, intra_op_threads=draft_threads if draft_threads is not None
                                else options.intra_op_threads)
        draft_graph = resolve_inside(bundle, manifest.draft.graph)
        draft = create_engine(manifest.draft, draft_graph, draft_options,
                              backend_for(manifest.draft, draft_graph, options.provider))
    head_ids = load_head_tokens(bundle, manifest.draft) if draft is not None else None
    recorded = manifest.extra.cost_profile
    # A profile taken on another machine or thread setting is dropped: warmup() re-measures.
    usable = recorded if recorded is not None and recorded.usable(options.intra_op_threads) else None
    backend = backend_for(manifest.target, target_graph, options.provider)
    return LoadedBundle(bundle, manifest, codec, target, draft, head_ids, options.intra_op_threads, usable,
                        runtime_description(backend, options.provider))
