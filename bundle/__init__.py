"""The bundle format: what ``specedge export`` writes and the runtime reads.

* :mod:`.manifest`: manifest.json (models, IO names, tokenizer, speculation defaults, files with
  sha256) and loading it safely (paths that leave the bundle are refused);
* :mod:`.extra`: the manifest's typed ``extra`` records (cost profile, validation, exact steps,
  quality, engines);
* :mod:`.schema`: the field readers and bounds every parser uses;
* :mod:`.graphfile`: the files an ONNX graph names, read from its protobuf without ``onnx``;
* :mod:`.pathcheck`: names the file system will take.

Standard library only (numpy where a file holds an array): the format depends on no runtime, export,
cli or server module, and loads with nothing else installed.
"""
