"""Invariant, at a real model's size: a random-weight checkpoint with Llama-3.2-3B's shape (3.2B
parameters, fp16 safetensors) exports at int4, validated, within issue #38's memory bound: 1.5 x its
largest fp32 tensor (the 128,256 x 3,072 tied embedding, 1.58 GB) + 2 GB = 4.36 GB of peak RSS.

The export runs in a child process measured by ``specedge export-measure``'s own code (the child's
VmHWM). About 6 minutes and 20 GB of disk (the 6.4 GB fixture, the 12.8 GB fp32 graph the quantizer
reads, the bundle) on a 2-core box; a machine with less free disk or memory skips it, saying so.
"""

from __future__ import annotations

import shutil

import pytest

pytestmark = pytest.mark.slow

SHAPE = "llama-3.2-3b"
NEEDS_DISK = 24e9  # fixture + fp32 scratch graph + bundle, with room to spare
NEEDS_MEMORY = 8e9  # the bound plus the test process and the page cache the writes churn through


def test_a_3b_shaped_checkpoint_exports_int4_within_the_memory_bound(tmp_path):
    from specedge.bundle.manifest import load_manifest
    from specedge.export.fixture import SHAPES, write_fixture
    from specedge.export.measure import available_bytes, measure_export

    free = shutil.disk_usage(tmp_path).free
    if free < NEEDS_DISK or available_bytes() < NEEDS_MEMORY:
        pytest.skip(f"needs {NEEDS_DISK / 1e9:.0f} GB of free disk and {NEEDS_MEMORY / 1e9:.0f} GB of available "
                    f"memory; this machine has {free / 1e9:.0f} GB and {available_bytes() / 1e9:.1f} GB")
    shape = SHAPES[SHAPE]
    source = write_fixture(SHAPE, tmp_path / "source")
    out = tmp_path / "bundle"
    largest = 4 * shape.vocab_size * shape.hidden_size  # the embedding, in fp32
    bound = 1.5 * largest + 2e9
    measured = measure_export(["--target", str(source), "--out", str(out), "--precision", "int4",
                               "--max-context", "1024", "--quant-mix", "rtn-sym4", "--quiet"], out,
                              max_rss_bytes=int(2 * bound), echo=False)
    assert measured.returncode == 0, measured.stderr_tail
    assert measured.peak_rss_bytes <= bound, (measured.peak_rss_bytes, bound, measured.report())
    manifest = load_manifest(out)
    # The int4 graph was compared with the source itself (layer-limited validation: the whole fp32 graph
    # is never loaded), and its first layers' fp32 graph was validated edge by edge.
    reports = manifest.extra.validation
    assert "target:int4-vs-source" in reports and any(k.startswith("target:fp32-first-") for k in reports)
    assert manifest.target.precision == "int4" and manifest.target.n_layers == shape.num_hidden_layers
