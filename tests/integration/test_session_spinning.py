"""How the loaded sessions spin: ORT's worker threads busy-wait inside a run in every case; when a
target and a draft share the cores, the spinning stops as each run returns (session.force_spinning_stop)
so an idle session never steals the running one's cores (runtime/loading.py)."""

from __future__ import annotations

from specedge.runtime.loading import load_bundle


def _config(engine, key: str) -> str:
    return engine.session.get_session_options().get_session_config_entry(key)


def test_two_sessions_spin_inside_a_run_and_stop_after_it(int4_bundle):
    loaded = load_bundle(int4_bundle, threads=1)
    for engine in (loaded.target, loaded.draft):
        assert engine.options.allow_spinning and engine.options.stop_spinning_after_run
        assert _config(engine, "session.force_spinning_stop") == "1"


def test_a_lone_target_keeps_spinning_between_runs(llama_bundle, int4_bundle):
    for loaded in (load_bundle(llama_bundle, threads=1), load_bundle(int4_bundle, threads=1, load_draft=False)):
        assert loaded.draft is None
        assert loaded.target.options.allow_spinning and not loaded.target.options.stop_spinning_after_run


def test_bench_threads_compares_every_spinning_policy_with_equal_outputs(int4_bundle, capsys):
    import json

    from specedge.bench import threads

    # Pipelined setups split the cores (the target on fewer threads than the reference): equal bits
    # across thread counts were measured, not promised, so they stay out of an equality test.
    rc = threads.run(int4_bundle, prompts=1, max_new_tokens=6, repeats=1, draft_tokens=2, pipelined=False)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and report["output_mismatches"] == []
    names = list(report["results"])
    assert names[0] == "plain, spin stop" and report["results"][names[0]]["speedup_median"] == 1.0
    for spin in threads.DEFAULT_SPINNING:
        assert any(name.endswith(f"spin {spin}") and name.startswith("sequential") for name in names)


def test_bench_threads_refuses_an_unknown_spinning_policy(int4_bundle):
    from click.testing import CliRunner

    from specedge.cli.main import main

    result = CliRunner().invoke(main, ["bench", "threads", str(int4_bundle), "--spinning", "stop,sometimes"])
    assert result.exit_code == 2 and "use a comma list of stop, off, on; got 'stop,sometimes'" in result.output
