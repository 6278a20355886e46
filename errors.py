"""Typed exceptions raised at specedge's boundaries.

Every error a user can trigger with bad input derives from :class:`SpecedgeError`,
so an embedding application can catch one type. Messages name the offending
field, path or value and say what is allowed.
"""

from __future__ import annotations


class SpecedgeError(Exception):
    """Base class for every error specedge raises on purpose."""


class InvalidParameterError(SpecedgeError, ValueError):
    """A generation, export or engine parameter is outside its allowed range."""


class BundleError(SpecedgeError):
    """A bundle folder is missing, incomplete or inconsistent."""


class ManifestError(BundleError):
    """manifest.json is unreadable, has an unknown version, or a field is missing or ill-typed."""


class UnsafePathError(ManifestError):
    """A manifest path resolves outside the bundle (``..``, absolute path or symlink)."""


class ChecksumError(BundleError):
    """A file's sha256 or size differs from what the manifest or catalog records."""


class ModelLoadError(BundleError):
    """An ONNX file is truncated or corrupt, or its IO does not match the manifest."""


class ChatTemplateError(BundleError):
    """The bundle's chat template fails: it does not compile, raises, or exceeds its render budget."""


class NonFiniteLogitsError(ModelLoadError):
    """A graph produced NaN or infinite logits: its weights are corrupt (or it overflows its precision)."""


class VocabMismatchError(BundleError):
    """Draft and target do not share a vocabulary (size or tokenizer hash)."""


class BackendUnavailableError(SpecedgeError):
    """The requested engine backend or execution provider is not available here."""


class ContextOverflowError(SpecedgeError, ValueError):
    """The prompt (plus the tokens it must generate) does not fit in max_context."""


class ForwardCancelled(SpecedgeError):
    """A forward was stopped by its generation's cancel (engines/base.py :class:`Interrupt`) before it
    finished: the cache's ``length`` is unchanged, and nothing it wrote past ``length`` is held."""


class PromptCacheError(SpecedgeError):
    """A persisted prompt cache cannot be used: missing, truncated or corrupt, or saved for
    another bundle or setting (the message names the mismatching field)."""


class ExportError(SpecedgeError):
    """Export could not read the source model or write the bundle."""


class UnsupportedModelError(ExportError):
    """The checkpoint asks for a model feature the graph builder does not implement (named in the message)."""


class ExportValidationError(ExportError):
    """ONNX Runtime's outputs differ from PyTorch's beyond the tolerance."""


class TokenizerParityError(ExportError):
    """The bundle's tokenizer (as the runtime encodes) gives other token ids than the source's own
    tokenizer on a text or conversation; the message names it and the first differing token."""


class FetchError(SpecedgeError):
    """A catalog model could not be downloaded, assembled or verified."""
