"""specedge: speculative decoding for edge and workstation LLM deployment.

The public API mirrors Hugging Face's: ``Generator.from_bundle(path)``, then
``.generate(...)`` or ``.stream(...)``. Nothing here imports torch, and names are
resolved lazily so that ``import specedge.export.fetch`` stays standard-library only.
"""

__version__ = "0.1.0"

_PUBLIC = {
    "Generator": "specedge.runtime.generator",
    "GenerationConfig": "specedge.runtime.options",
    "GenerationResult": "specedge.runtime.results",
    "GenerationStats": "specedge.runtime.stats",
    "SamplingConfig": "specedge.runtime.sampling",
    "EngineOptions": "specedge.engines.base",
    "SpecedgeError": "specedge.errors",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'specedge' has no attribute {name!r}")
