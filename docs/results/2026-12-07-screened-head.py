"""Copy a bundle and screen one model's int8 output head with the shipped export/head_screen.py, to measure an
existing bundle without exporting it again (docs/results/2026-12-07-screened-head.md).

    python docs/results/2026-12-07-screened-head.py SRC DST target          # the target screened
    python docs/results/2026-12-07-screened-head.py SRC DST draft --as-target --no-screen
                                                                            # the draft as DST's target

``--as-target`` makes the model DST's target (``bench profile`` and ``eval`` read a bundle's target);
``--no-screen`` only copies (the unscreened side of a comparison); ``--any-size`` screens a head below
MIN_HEAD_ELEMENTS too (how SmolLM2's was measured); ``--copy-block N`` gives the int4 copy blocks of N
(docs/results/2026-12-07-wide-int8-blocks.md; default: the int8 head's). Files not rewritten are hard links.
"""

import argparse
import hashlib
import json
import os
import shutil
from pathlib import Path

from specedge.export.head_screen import MIN_HEAD_ELEMENTS, add_head_screen

parser = argparse.ArgumentParser()
parser.add_argument("src", type=Path)
parser.add_argument("dst", type=Path)
parser.add_argument("role", choices=["target", "draft"])
parser.add_argument("--as-target", action="store_true")
parser.add_argument("--no-screen", action="store_true")
parser.add_argument("--any-size", action="store_true", help="screen a head below MIN_HEAD_ELEMENTS too")
parser.add_argument("--copy-block", type=int, default=None, help="the int4 copy's block (default: the head's)")
args = parser.parse_args()

manifest = json.loads((args.src / "manifest.json").read_text())
entry = dict(manifest["models"][args.role])
rewritten = {entry["graph"], *entry["data_files"]} if not args.no_screen else set()
shutil.rmtree(args.dst, ignore_errors=True)
for path in args.src.rglob("*"):
    rel = path.relative_to(args.src)
    if path.is_dir():
        (args.dst / rel).mkdir(parents=True, exist_ok=True)
        continue
    (args.dst / rel).parent.mkdir(parents=True, exist_ok=True)
    if rel.as_posix() in rewritten:
        shutil.copy2(path, args.dst / rel)  # rewritten in place: a real copy
    elif rel.name != "manifest.json":
        os.link(path, args.dst / rel)
if not args.no_screen:
    print(add_head_screen(args.dst / entry["graph"], entry["vocab_size"], min_elements=0 if args.any_size else MIN_HEAD_ELEMENTS,
                         copy_block=args.copy_block))
    for rel in sorted(rewritten):
        data = (args.dst / rel).read_bytes()
        manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
if args.as_target:
    manifest["models"]["target"] = entry | {"source": manifest["models"]["target"]["source"]}
(args.dst / "manifest.json").write_text(json.dumps(manifest, indent=2))
