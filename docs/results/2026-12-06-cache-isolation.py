"""Issue #41 items 2 and 5, measured: reuse per turn with interleaved callers, and the disclosure experiment.

Usage (a bundle with a chat template; without one, the tiny test bundle is built, which needs torch):

    python docs/results/2026-12-06-cache-isolation.py reuse [--bundle DIR] [--callers 1 3 8] [--turns 4]
    (--bundle DIR that does not exist: the tiny bundle is built and kept there)
    python docs/results/2026-12-06-cache-isolation.py disclosure [--bundle DIR]

``reuse``: N callers (cache_slots = N) share one 40-word system prompt and talk round robin, each
turn sending its whole history. Reported: reused tokens / prompt tokens per turn, over all turns
and over turns 2+ (turn 1 can reuse at most the system prompt), and the slots used.

``disclosure``: the attack from the issue, at the token level. A victim's prompt holds a 4-digit
secret after a public prefix; between the victim's turns an attacker sends the prefix, the digits
found so far and a guess, and reads ``specedge.reused_tokens`` of its own reply through the server.
It runs with and without keys and salts; reported: the digits recovered and the requests sent.
Runs on whatever specedge is importable (run it on a checkout before the change to compare).
"""

from __future__ import annotations

import argparse
import inspect
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tiny_bundle(out: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import build_model  # noqa: E402

    from specedge.export.bundle import ExportConfig, export_bundle

    src = out / "src"
    build_model(src, "llama", seed=0)
    bundle = out / "bundle"
    export_bundle(ExportConfig(target=str(src), out=bundle, max_context=256, quiet=True))
    return bundle


def words(start: int, n: int) -> str:
    return " ".join(f"w{i:03d}" for i in range(start, start + n))


def reuse(bundle: Path, callers_list: list[int], turns: int) -> None:
    from specedge.runtime.generator import Generator

    print("callers  slots_used  reuse_all_turns  reuse_turns_2+  (reused / prompt tokens, summed)")
    for callers in callers_list:
        gen = Generator.from_bundle(bundle, threads=1, cache_slots=callers)
        system = {"role": "system", "content": words(40, 40)}
        messages = {c: [system] for c in range(callers)}
        totals = {"all": [0, 0], "later": [0, 0]}
        for turn in range(turns):
            for c in range(callers):
                messages[c].append({"role": "user", "content": words(100 + 12 * c + 3 * turn, 6)})
                out = gen.generate(messages=messages[c], max_new_tokens=12, speculation=False)
                messages[c].append({"role": "assistant", "content": out.text})
                for key in ("all",) + (("later",) if turn else ()):
                    totals[key][0] += out.stats.reused_tokens
                    totals[key][1] += out.stats.prompt_tokens
        used = sum(1 for s in gen.slots.slots if s.tokens)
        print(f"{callers:7d}  {used:10d}  {totals['all'][0] / totals['all'][1]:15.3f}  "
              f"{totals['later'][0] / totals['later'][1]:14.3f}")


PUBLIC = list(range(40, 70))  # the victim's system prompt before the secret
SECRET = [74, 77, 71, 79]  # "4719": digit d is token 70 + d
VICTIM_TURN = list(range(100, 106))


def disclosure(bundle: Path) -> None:
    from starlette.testclient import TestClient

    from specedge.runtime.generator import Generator
    from specedge.server.app import create_app

    has_sharing = "cache_sharing" in inspect.signature(create_app).parameters
    cases = [  # (name, server keys, victim (key, salt), attacker (key, salt), cache_sharing)
        ("one key, no salts", ("k",), ("k", None), ("k", None), "key"),
        ("one key, different salts", ("k",), ("k", "victim"), ("k", "attacker"), "key"),
        ("one key, the same salt", ("k",), ("k", "team"), ("k", "team"), "key"),
        ("two keys, no salts", ("k1", "k2"), ("k1", None), ("k2", None), "key"),
        ("two keys, the same salt, --cache-sharing salt", ("k1", "k2"), ("k1", "s"), ("k2", "s"), "salt"),
        ("one key, --cache-sharing none", ("k",), ("k", None), ("k", None), "none"),
    ]
    for slots in (1, 4):
        print(f"\ncache_slots={slots}")
        for name, keys, (vkey, vsalt), (akey, asalt), sharing in cases:
            if not has_sharing and (len(keys) > 1 or vsalt or asalt or sharing != "key"):
                print(f"  {name:48s} not supported by this checkout")
                continue
            kw = {"cache_sharing": sharing} if has_sharing else {}
            gen = Generator.from_bundle(bundle, threads=1, cache_slots=slots)
            with TestClient(create_app(gen, api_key=keys if len(keys) > 1 else keys[0], warmup=False, **kw)) as c:
                def send(prompt, key, salt):
                    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "specedge": {"speculation": False}}
                    if salt is not None:
                        body["cache_salt"] = salt
                    r = c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
                    r.raise_for_status()
                    return r.json()["specedge"]["reused_tokens"]

                found, requests = [], 0
                for position in range(len(SECRET)):
                    hit = None
                    for digit in range(10):
                        send(PUBLIC + SECRET + VICTIM_TURN, vkey, vsalt)  # the victim's turn
                        reused = send(PUBLIC + found + [70 + digit, 200, 201], akey, asalt)
                        requests += 1
                        if reused > len(PUBLIC) + len(found):  # the guess extended the shared prefix
                            hit = digit
                            break
                    if hit is None:
                        break
                    found.append(70 + hit)
                code = "".join(str(t - 70) for t in found)
                print(f"  {name:48s} recovered {code or '-':4s} ({len(found)}/4 digits) in {requests} requests")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["reuse", "disclosure"])
    parser.add_argument("--bundle", type=Path, default=None)
    parser.add_argument("--callers", type=int, nargs="+", default=[1, 3, 8])
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bundle = args.bundle if args.bundle and args.bundle.exists() else tiny_bundle(Path(tmp))
        if args.bundle and not args.bundle.exists():  # keep it, so a run on another checkout uses the same one
            bundle = Path(shutil.copytree(bundle, args.bundle))
        if args.what == "reuse":
            reuse(bundle, args.callers, args.turns)
        else:
            disclosure(bundle)


if __name__ == "__main__":
    main()
