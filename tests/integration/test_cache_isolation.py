"""Invariant: one client's cached conversation never tells another what it holds, and each
conversation keeps its own slot.

- The disclosure experiment (issue #41): a victim's system prompt holds a secret; an attacker
  with another cache salt (Generator) or another API key (server) sends guesses between the
  victim's turns and sees ``reused_tokens == 0`` for every guess, the right one included; the
  victim's conversation is untouched when a free slot exists. With the same salt (or key), the
  prefix is shared, as documented: the right guess reuses one token more.
- /health shows the cache slots only to a caller with a key (to everyone when none is set).
- ``cache_sharing``: "salt" shares across keys by salt, "none" reuses nothing; a malformed
  ``cache_salt`` is a 400 naming it.
- Interleaved callers (3, on 3 slots) with one system prompt each keep their own slot and reuse
  their whole previous turn (before: all shared one slot and reused only the system prompt).
"""

from __future__ import annotations

import pytest

PUBLIC = list(range(40, 70))  # the victim's system prompt up to the secret
SECRET = [74, 77, 71, 79]  # "the vault code is 4719"
VICTIM_TURN = list(range(100, 106))


@pytest.fixture
def make(llama_bundle):
    from specedge.runtime.generator import Generator

    return lambda **kw: Generator.from_bundle(llama_bundle, threads=1, **kw)


def _guess(position: int, digit: int) -> list[int]:
    """The attacker's prompt: the public prefix, the digits known so far, a guess, then filler."""
    return PUBLIC + SECRET[:position] + [digit] + [200, 201]


def _attack(gen, secret: list[int], victim: str | None, attacker: str | None) -> list[int]:
    """The attacker's view: its reused_tokens for each guess of the first digit, sent between the
    victim's turns (the victim resends its conversation each time)."""
    seen = []
    for digit in range(70, 80):
        gen.generate(input_ids=PUBLIC + secret + VICTIM_TURN, max_new_tokens=4, speculation=False, cache_salt=victim)
        seen.append(gen.generate(input_ids=_guess(0, digit), max_new_tokens=2, speculation=False,
                                 cache_salt=attacker).stats.reused_tokens)
    return seen


@pytest.mark.parametrize("slots", [1, 4])
@pytest.mark.parametrize("victim,attacker", [("victim", "attacker"), ("victim", None), (None, "attacker")])
def test_another_salt_learns_nothing_from_reused_tokens(make, slots, victim, attacker):
    seen = _attack(make(cache_slots=slots), SECRET, victim, attacker)
    # What the attacker sees does not depend on the secret: only on its own earlier guesses.
    assert seen == _attack(make(cache_slots=slots), [78] + SECRET[1:], victim, attacker)
    assert seen[0] == 0 and max(seen) <= len(PUBLIC)


@pytest.mark.parametrize("slots", [1, 4])
def test_the_victims_conversation_survives_another_salt_when_a_slot_is_free(make, slots):
    gen = make(cache_slots=slots)
    history = PUBLIC + SECRET + VICTIM_TURN
    first = gen.generate(input_ids=history, max_new_tokens=4, speculation=False, cache_salt="victim")
    gen.generate(input_ids=_guess(0, SECRET[0]), max_new_tokens=2, speculation=False, cache_salt="attacker")
    again = gen.generate(input_ids=history + first.token_ids + [110], max_new_tokens=2, speculation=False,
                         cache_salt="victim")
    # One slot: the attacker's call took it, and the victim reuses nothing of the attacker's. Four:
    # the attacker got a free slot and the victim's whole conversation is still there.
    assert again.stats.reused_tokens == (0 if slots == 1 else len(history) + len(first.token_ids) - 1)


def test_the_same_salt_shares_the_prefix_as_documented(make):
    gen = make(cache_slots=1)
    gen.generate(input_ids=PUBLIC + SECRET + VICTIM_TURN, max_new_tokens=2, speculation=False, cache_salt="team")
    right = gen.generate(input_ids=_guess(0, SECRET[0]), max_new_tokens=2, speculation=False, cache_salt="team")
    gen.generate(input_ids=PUBLIC + SECRET + VICTIM_TURN, max_new_tokens=2, speculation=False, cache_salt="team")
    wrong = gen.generate(input_ids=_guess(0, SECRET[0] + 1), max_new_tokens=2, speculation=False, cache_salt="team")
    assert (right.stats.reused_tokens, wrong.stats.reused_tokens) == (len(PUBLIC) + 1, len(PUBLIC))


def test_a_published_prompt_cache_is_reused_by_every_salt_and_nothing_past_it(make, tmp_path):
    gen = make(cache_slots=2)
    system = [{"role": "system", "content": " ".join(f"w{i:03d}" for i in range(40, 70))}]
    held = gen.save_prompt_cache(tmp_path / "system.cache", messages=system)["tokens"]
    turn = system + [{"role": "user", "content": "w120 w121"}]
    out = gen.generate(messages=turn, max_new_tokens=2, speculation=False, cache_salt="a")
    assert out.stats.reused_tokens == held
    other = gen.generate(messages=turn, max_new_tokens=2, speculation=False, cache_salt="b")
    assert other.stats.reused_tokens <= held  # never a's user turn


def test_interleaved_callers_each_keep_their_slot_and_reuse_their_whole_previous_turn(make):
    from specedge.runtime.slots import common_prefix

    gen = make(cache_slots=3)
    system = {"role": "system", "content": " ".join(f"w{i:03d}" for i in range(40, 80))}
    messages = {c: [system] for c in range(3)}
    held = {}
    for turn in range(3):
        for c in range(3):  # round robin: each caller's turns interleave with the others'
            user = " ".join(f"w{150 + 30 * c + 6 * turn + i:03d}" for i in range(6))
            messages[c] = messages[c] + [{"role": "user", "content": user}]
            ids = gen.encode_prompt(messages=messages[c])
            out = gen.generate(messages=messages[c], max_new_tokens=8, speculation=False)
            if turn == 0:  # a free slot, with the system prompt another caller's slot holds copied in
                expected = 0 if c == 0 else common_prefix(held[0], ids)
            else:
                expected = min(common_prefix(held[c], ids), len(ids) - 1)
            assert out.stats.reused_tokens == expected, (turn, c)
            if turn:
                assert expected == len(held[c])  # the whole previous turn, not only the system prompt
            held[c] = ids + out.token_ids[:-1]  # the last reply token is never fed
            messages[c] = messages[c] + [{"role": "assistant", "content": out.text}]
    assert len(gen.slots.slots) == 3


# ----------------------------------------------------------------------------- the server
KEYS = ("sk-victim", "sk-attacker")


@pytest.fixture
def client(make):
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from specedge.server.app import create_app

    opened = []

    def open_(*, api_key=KEYS, cache_sharing="key", slots=1):
        c = TestClient(create_app(make(cache_slots=slots), api_key=api_key, warmup=False,
                                  cache_sharing=cache_sharing))
        opened.append(c.__enter__())
        return c

    yield open_
    for c in opened:
        c.__exit__(None, None, None)


def _complete(c, prompt: list[int], key: str | None, **body) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                         "specedge": {"speculation": False}, **body}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def _reused(c, prompt: list[int], key: str | None, **body) -> int:
    return _complete(c, prompt, key, **body)["specedge"]["reused_tokens"]


def test_another_key_learns_nothing_and_the_same_key_shares(client):
    c = client()
    victim = PUBLIC + SECRET + VICTIM_TURN
    for digit in (SECRET[0], SECRET[0] + 1):
        _reused(c, victim, KEYS[0])
        assert _reused(c, _guess(0, digit), KEYS[1]) == 0
    # The same key (one tenant, no salt): the prefix is shared, so the right guess shows (documented).
    _reused(c, victim, KEYS[0])
    assert _reused(c, _guess(0, SECRET[0]), KEYS[0]) == len(PUBLIC) + 1
    # ... unless the clients behind that key send different salts.
    _reused(c, victim, KEYS[0], cache_salt="caller-1")
    assert _reused(c, _guess(0, SECRET[0]), KEYS[0], cache_salt="caller-2") == 0


def test_cache_sharing_salt_shares_across_keys_and_none_reuses_nothing(client):
    c = client(cache_sharing="salt")
    _reused(c, PUBLIC + SECRET, KEYS[0], cache_salt="s")
    assert _reused(c, PUBLIC + SECRET + [5], KEYS[1], cache_salt="s") == len(PUBLIC + SECRET)
    c = client(cache_sharing="none", slots=2)
    _reused(c, PUBLIC + SECRET, KEYS[0])
    assert _reused(c, PUBLIC + SECRET + [5], KEYS[0]) == 0


def test_health_shows_the_slots_only_to_a_caller_with_a_key(client):
    c = client()
    _reused(c, PUBLIC + SECRET, KEYS[0])
    public = c.get("/health").json()
    assert public["status"] == "ok" and "cache" not in public
    assert "cache" not in c.get("/health", headers={"Authorization": "Bearer wrong"}).json()
    private = c.get("/health", headers={"Authorization": f"Bearer {KEYS[1]}"}).json()
    assert private["cache"]["held_tokens"] == [len(PUBLIC + SECRET) + 1]  # the last reply token is never fed
    assert "cache" in client(api_key=None).get("/health").json()  # no key: everyone is authorised


@pytest.mark.parametrize("salt", ["", 7, ["a"]])
def test_a_malformed_cache_salt_is_refused_by_name(client, salt):
    c = client()
    r = c.post("/v1/completions", json={"prompt": PUBLIC, "cache_salt": salt},
               headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
