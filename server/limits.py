"""The server's tunable limits and their defaults, defined once.

Plain constants with no dependency, so ``specedge serve``'s options (cli/serve.py) read the
same defaults as :func:`specedge.server.app.create_app` without importing starlette.
"""

DEFAULT_QUEUE_SIZE = 16  # waiting requests; on one device a deeper queue is only a longer wait
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a long chat history is ~100 KB; more is a mistake or an attack
# A chat reply's length when the request sends no max_tokens (Pipecat and LiveKit send none, and
# without a cap a small model talked to the end of its context: 2,021 tokens, 10 s, per turn).
# 256 tokens is about 190 English words, over a minute of speech: far above a spoken turn (1-3
# sentences, 20-80 tokens), so it cuts only runaway replies. 0 (`--max-tokens 0`) lifts the cap.
DEFAULT_MAX_TOKENS = 256
DEFAULT_SHUTDOWN_GRACE_S = 5.0  # how long a running reply may go on after SIGTERM before it is cut
MAX_SHUTDOWN_GRACE_S = 3600.0  # a longer grace is a typo: a supervisor would kill the process first
# Which requests may reuse each other's cached prompt prefixes (`specedge serve --cache-sharing`). A
# request's cache_salt always separates it from other salts, whatever the policy.
CACHE_SHARING = {
    "key": "only requests with the same API key and the same cache_salt share cached prefixes",
    "salt": "only requests with the same cache_salt share cached prefixes, whatever their API key",
    "none": "no request reuses another's cached prefix (every prompt is prefilled in full, and the suffix "
            "drafter's reply memory is off)",
}
# The default lets no client learn another's prompt from reused_tokens or timing (docs/SERVER.md: cache sharing and privacy).
DEFAULT_CACHE_SHARING = "key"
