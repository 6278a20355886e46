"""Invariant: the conversation benchmark replays the same call in every configuration, and reuse
shows up as reused tokens while the greedy replies stay identical."""

from __future__ import annotations

import json

from click.testing import CliRunner


def test_conversation_bench_reuses_and_replies_identically(self_spec_bundle, tmp_path):
    from specedge.cli.main import main

    talk = tmp_path / "talk.json"  # the tiny bundle's context is 256 tokens: a short call
    talk.write_text(json.dumps({"system": "w010 w011 w012 w013 w014 w015", "turns": ["w020 w021", "w030", "w040 w041"]}))
    out = CliRunner().invoke(main, ["bench", "conversation", str(self_spec_bundle), "--conversation", str(talk),
                                    "--turns", "3",
                                    "--max-new-tokens", "4", "--threads", "1", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output[out.output.index("{"):])
    assert doc["identical"] is True
    summary = doc["summary"]
    assert set(summary) == {"cold", "reuse", "reuse+prefill"}
    assert summary["cold"]["reused_tokens"] == 0
    assert summary["reuse"]["reused_tokens"] > 0
    # With prefill-ahead every turn finds all but its last prompt token already cached.
    turns = [t for t in doc["turns"] if t["config"] == "reuse+prefill"]
    assert all(t["reused_tokens"] == t["prompt_tokens"] - 1 for t in turns)


def test_unknown_conversation_configs_are_refused(self_spec_bundle):
    from specedge.cli.main import main

    out = CliRunner().invoke(main, ["bench", "conversation", str(self_spec_bundle), "--configs", "warm"])
    assert out.exit_code == 2 and "unknown conversation configuration(s) ['warm']" in out.output
    assert "error:" in out.output
