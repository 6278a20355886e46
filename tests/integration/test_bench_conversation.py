"""Invariant: the conversation benchmark replays the same call in every configuration, and reuse
shows up as reused tokens while the greedy replies stay identical."""

from __future__ import annotations

import json
import os
import sys

import pytest
from click.testing import CliRunner


def test_conversation_bench_reuses_and_replies_identically(self_spec_bundle, tmp_path):
    from specedge.cli.main import main

    talk = tmp_path / "talk.json"  # the tiny bundle's context is 256 tokens: a short call
    talk.write_text(json.dumps({"system": "w010 w011 w012 w013 w014 w015", "turns": ["w020 w021", "w030", "w040 w041"]}))
    out = CliRunner().invoke(main, ["bench", "conversation", str(self_spec_bundle), "--conversation", str(talk),
                                    "--turns", "3", "--no-llamacpp",
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


def test_concurrent_callers_copy_the_system_prompt_and_reply_identically(self_spec_bundle, tmp_path):
    """--callers 3: each call keeps its own slot; a new call's first turn reuses the system prompt
    another call's slot holds (copied), the cold configuration reuses nothing, replies stay identical."""
    from specedge.cli.main import main

    talk = tmp_path / "talk.json"  # replies longer than the slots' continuation slack: calls stay apart
    talk.write_text(json.dumps({"system": "w010 w011 w012 w013 w014 w015", "turns": ["w020 w021", "w030", "w040"]}))
    out = CliRunner().invoke(main, ["bench", "conversation", str(self_spec_bundle), "--conversation", str(talk),
                                    "--no-llamacpp", "--callers", "3", "--configs", "cold,reuse",
                                    "--max-new-tokens", "12", "--threads", "1", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output[out.output.index("{"):])
    assert doc["identical"] is True
    rows = {(t["config"], t["caller"], t["turn"]): t for t in doc["turns"]}
    assert len(rows) == 2 * 3 * 3
    firsts = [rows["reuse", caller, 0] for caller in range(3)]
    assert firsts[0]["reused_tokens"] == 0
    system = firsts[1]["reused_tokens"]
    assert system > 0 and firsts[2]["reused_tokens"] == system  # the system prompt's tokens, copied
    assert all(rows["cold", c, t]["reused_tokens"] == 0 for c in range(3) for t in range(3))
    # Later turns continue each call's own slot: everything but the previous reply's last token.
    assert all(rows["reuse", c, t]["reused_tokens"] > rows["reuse", c, t - 1]["prompt_tokens"] - 2
               for c in range(3) for t in (1, 2))
    assert doc["summary"]["reuse"]["ttft_first_other_p50_s"] > 0
    text = CliRunner().invoke(main, ["bench", "conversation", str(self_spec_bundle), "--conversation", str(talk),
                                     "--no-llamacpp", "--callers", "2", "--configs", "reuse",
                                     "--max-new-tokens", "2", "--threads", "1"])
    assert "other calls' turn 1 p50" in text.output and "TTFT per turn (ms), the first call:" in text.output
    refused = CliRunner().invoke(main, ["bench", "conversation", str(self_spec_bundle), "--preemptive",
                                        "--callers", "2"])
    assert refused.exit_code == 2 and "--preemptive replays one call" in refused.output


def test_unknown_conversation_configs_are_refused(self_spec_bundle):
    from specedge.cli.main import main

    out = CliRunner().invoke(main, ["bench", "conversation", str(self_spec_bundle), "--configs", "warm"])
    assert out.exit_code == 2 and "unknown conversation configuration(s) ['warm']" in out.output
    assert "error:" in out.output


# A stand-in for the llama.cpp conversation peer speaking bench/peer_worker.py's protocol: it
# offers the two configurations, replies with our reply, and takes 10 ms per new token, reading a
# prompt's tokens past the longest prefix it held (cache-prompt) or all of them (cold) at 1 ms each.
FAKE_LLAMACPP = """
import json, sys
init = json.loads(sys.stdin.readline())
assert init["peer"] == "llamacpp-conversation", init
print(json.dumps({"configs": ["llamacpp-cold", "llamacpp-cache-prompt"], "info": {"fake": True},
                  "notes": ["fake llama.cpp"]}), flush=True)
held = []
for line in sys.stdin:
    request = json.loads(line)
    ids, config = request["job"]["prompt_ids"], request["config"]
    common = 0
    if config == "llamacpp-cache-prompt":
        while common < min(len(held), len(ids)) and held[common] == ids[common]:
            common += 1
        held = list(ids)
    first = 0.001 * (len(ids) - common)
    reply = request["job"]["reference"][:request["n"]] or [1]
    print(json.dumps({"tokens": reply, "times": [first + 0.01 * j for j in range(len(reply))]}), flush=True)
"""


@pytest.fixture
def fake_llamacpp(tmp_path, monkeypatch):
    from specedge.bench import peers

    script = tmp_path / "fake_llamacpp.py"
    script.write_text(FAKE_LLAMACPP)
    monkeypatch.setattr(peers, "_worker_command", lambda: [sys.executable, str(script)])


def test_the_llamacpp_peer_runs_the_same_turns_next_to_ours(self_spec_bundle, tmp_path, fake_llamacpp):
    from specedge.cli.main import main

    talk = tmp_path / "talk.json"
    talk.write_text(json.dumps({"system": "w010 w011 w012 w013 w014 w015", "turns": ["w020 w021", "w030", "w040"]}))
    out = CliRunner().invoke(main, ["bench", "conversation", str(self_spec_bundle), "--conversation", str(talk),
                                    "--max-new-tokens", "4", "--threads", "1", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output[out.output.index("{"):])
    assert doc["identical"] is True and doc["peer"]["notes"] == ["fake llama.cpp"]
    assert set(doc["summary"]) == {"cold", "reuse", "reuse+prefill", "llamacpp-cold", "llamacpp-cache-prompt"}
    rows = {(t["config"], t["turn"]): t for t in doc["turns"]}
    for turn in range(3):
        ours = rows[("reuse", turn)]
        for config in ("llamacpp-cold", "llamacpp-cache-prompt"):
            peer = rows[(config, turn)]
            # The same turn: the reuse history's prompt, and (here) our reply given back.
            assert peer["prompt_tokens"] == ours["prompt_tokens"] and peer["peer"] and peer["same_reply"]
            assert peer["new_tokens"] == ours["new_tokens"]
        # The fake's TTFT is 1 ms per token read: cold reads the whole prompt, the prompt cache only what is new.
        assert rows[("llamacpp-cold", turn)]["ttft_s"] == pytest.approx(0.001 * ours["prompt_tokens"])
        if turn:
            assert rows[("llamacpp-cache-prompt", turn)]["ttft_s"] < rows[("llamacpp-cold", turn)]["ttft_s"]
    assert [sorted(row["ttft_s"]) for row in doc["ttft_by_turn"]] == \
        [sorted(doc["summary"])] * 3
    text = CliRunner().invoke(main, ["bench", "conversation", str(self_spec_bundle), "--conversation", str(talk),
                                     "--max-new-tokens", "2", "--threads", "1", "--configs", "reuse"])
    assert "| turn | prompt tokens | reuse | llamacpp-cold | llamacpp-cache-prompt |" in text.output
    assert "peer replies equal to ours: 6 of 6" in text.output and "note: fake llama.cpp" in text.output


def test_without_llamacpp_the_bench_runs_alone(self_spec_bundle, tmp_path, monkeypatch):
    """The real worker, with llama_cpp made unimportable: the peer is skipped with the reason."""
    from specedge.bench.peers import PeerContext, PeerSkipped, setup_llamacpp_conversation
    from specedge.cli.main import main
    from specedge.bundle.manifest import load_manifest

    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(PeerSkipped, match="llama-cpp-python is not installed"):
        setup_llamacpp_conversation(PeerContext(1, {}, load_manifest(self_spec_bundle)), None)
    blocker = tmp_path / "block" / "llama_cpp"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('blocked for this test')\n")
    monkeypatch.setenv("PYTHONPATH", str(blocker.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    talk = tmp_path / "talk.json"
    talk.write_text(json.dumps({"system": "w010 w011", "turns": ["w020", "w030"]}))
    out = CliRunner().invoke(main, ["bench", "conversation", str(self_spec_bundle), "--conversation", str(talk),
                                    "--max-new-tokens", "2", "--threads", "1", "--configs", "reuse", "--json"])
    assert out.exit_code == 0, out.output
    assert "llama.cpp peer: llama-cpp-python is not installed" in out.output
    doc = json.loads(out.output[out.output.index("{"):])
    assert doc["peer"] is None and set(doc["summary"]) == {"reuse"}
    bare = CliRunner().invoke(main, ["bench", "conversation", str(self_spec_bundle), "--conversation", str(talk),
                                     "--max-new-tokens", "2", "--threads", "1", "--configs", "reuse",
                                     "--no-llamacpp"])
    assert bare.exit_code == 0 and "llama.cpp peer" not in bare.output and "llamacpp" not in bare.output
