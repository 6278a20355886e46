"""Run a specedge command with runtime/loop.py PREFILL_CHUNK set (an A/B of chunked prefill).

Usage: python 2026-12-06-bench-chunk.py CHUNK bench conversation BUNDLE --preemptive ...
"""
import sys
from specedge.runtime import loop
loop.PREFILL_CHUNK = int(sys.argv[1])
from specedge.cli.main import main
sys.argv = ["specedge"] + sys.argv[2:]
main()
