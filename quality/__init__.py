"""``specedge eval``: how much a bundle's target lost on the way in from its source checkpoint.

- :mod:`.metrics`: perplexity and top-1 agreement from logits (numpy, float64);
- :mod:`.evaluate`: the texts (built in, or files), their chunks, and the bundle's target graph
  scored through the engine, teacher-forced. The source side (transformers) lives in
  ``export/quality.py`` and is imported only when a source is scored.

Imports neither torch nor transformers: the bundle side runs in the edge install.
"""
