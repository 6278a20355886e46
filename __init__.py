"""specedge: speculative decoding for edge and workstation LLM deployment.

The public API mirrors Hugging Face's: ``Generator.from_bundle(path)``, then
``.generate(...)`` or ``.stream(...)``. Nothing here imports torch.
"""

__version__ = "0.1.0"
