"""``specedge serve``: parse options, load the bundle, run uvicorn. Nothing else."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import BackendUnavailableError
from ..server.limits import (CACHE_SHARING, DEFAULT_CACHE_SHARING, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_TOKENS,
                             DEFAULT_QUEUE_SIZE, DEFAULT_SHUTDOWN_GRACE_S, MAX_SHUTDOWN_GRACE_S)
from .options import load_from, load_options
LOOPBACK = ("127.0.0.1", "::1", "localhost")
# specedge is installed from a clone (it is not on PyPI): both forms, the clone's first.
SERVE_INSTALL_HINT = "pip install -e '.[serve]' from a clone (or pip install 'specedge-*.whl[serve]' from a built wheel)"


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. The default is loopback only; 0.0.0.0 exposes the server to the network.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="TCP port (0: any free port).")
@click.option("--api-key", "api_keys", envvar="SPECEDGE_API_KEY", multiple=True,
              help="Require 'Authorization: Bearer KEY' on /v1/* (also $SPECEDGE_API_KEY, keys separated by "
              "spaces). Repeatable: one key per client, and clients with different keys never share cached "
              "prompts (--cache-sharing).")
@click.option("--api-key-file", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
              help="Read more API keys from FILE, one per line ('#' comments and blank lines skipped).")
@click.option("--model-name", default=None, help="The model id clients send (default: the bundle folder's name).")
@click.option("--max-tokens", type=click.IntRange(min=0), default=DEFAULT_MAX_TOKENS, show_default=True,
              help="Tokens a chat reply may run when the request sends neither max_tokens nor "
              "max_completion_tokens (Pipecat and LiveKit send none); a request's own value wins. "
              "0: up to the end of the context (OpenAI's rule).")
@click.option("--queue-size", type=click.IntRange(min=0), default=DEFAULT_QUEUE_SIZE, show_default=True,
              help="Requests that may wait while one generates; the next gets 429.")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=DEFAULT_MAX_BODY_BYTES, show_default=True,
              help="Larger request bodies get 413.")
@load_options("threads", "provider", "verify_checksums", "cache_slots")
@click.option("--no-speculation", is_flag=True, help="Plain decoding for every request (the baseline); "
              "the draft model is not loaded.")
@click.option("--exact", is_flag=True, help="Run every request in exact mode (token-identical greedy output: 2-row "
              "plain steps, 1.2-1.4x a plain step on int4 CPU bundles) unless it sends "
              "\"specedge\": {\"exact\": false}; without it requests are fast unless they send {\"exact\": true}.")
@click.option("--no-warmup", is_flag=True, help="Skip running every session once at startup.")
@click.option("--shutdown-grace", type=click.FloatRange(0, MAX_SHUTDOWN_GRACE_S), default=DEFAULT_SHUTDOWN_GRACE_S,
              show_default=True,
              help="Seconds a running reply may go on after SIGTERM; then it ends with finish_reason 'length'. "
              "Queued and new requests get 503 at once.")
@click.option("--cache-memory", type=click.FloatRange(min=0, min_open=True), default=None,
              help="MB the conversation caches may take (default: --cache-slots alone decides).")
@click.option("--cache-sharing", type=click.Choice(list(CACHE_SHARING)), default=DEFAULT_CACHE_SHARING,
              show_default=True,
              help="Which requests may reuse each other's cached prompt prefixes (a shared prefix is faster, "
              "and that speed, like specedge.reused_tokens, tells a client what another sent): "
              + "; ".join(f"{name}: {text}" for name, text in CACHE_SHARING.items())
              + ". A request's cache_salt always separates it; without any key, all clients are one tenant "
              "and only salts separate them.")
@click.option("--prompt-cache", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="File holding the K/V of a fixed prefix (--system-prompt): loaded at start when it exists "
              "(refused if saved for another bundle or setting), else computed and written, so a restart does "
              "not prefill the system prompt again.")
@click.option("--system-prompt", default=None,
              help="The fixed system prompt --prompt-cache holds ('@FILE' reads it from FILE). Needed to create "
              "the cache; when given with an existing cache, the cache must hold exactly this prompt.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True, help="uvicorn's and specedge's log level (info: one line per request).")
def serve(bundle: Path, host: str, port: int, api_keys: tuple[str, ...], api_key_file: Path | None,
          model_name: str | None, max_tokens: int, queue_size: int, max_body_bytes: int,
          no_speculation: bool, exact: bool, no_warmup: bool, shutdown_grace: float,
          cache_memory: float | None, cache_sharing: str, prompt_cache: Path | None, system_prompt: str | None,
          log_level: str, **kw) -> None:
    """Serve a bundle over an OpenAI-compatible API (chat and completions, streaming or not).

    \b
    One model, one generation at a time; requests wait in a FIFO queue.
      specedge serve bundles/smollm2 --port 8000
      curl http://127.0.0.1:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'
    Needs the serve extra: pip install -e '.[serve]' in a clone (from a wheel: 'specedge-*.whl[serve]').
    """
    try:
        from ..server.app import create_app
        from ..server.serving import SpecedgeServer, server_config
    except ImportError as exc:  # BackendUnavailableError: the CLI's `error:` line and exit status 2
        raise BackendUnavailableError(f"specedge serve needs the serve extra ({exc.name} is missing): "
                                      f"{SERVE_INSTALL_HINT}") from None
    from ..runtime.generator import Generator

    if system_prompt is not None and prompt_cache is None:
        raise click.BadParameter("is only used with --prompt-cache", param_hint="--system-prompt")
    if any(not key.strip() for key in api_keys):
        raise click.BadParameter("must not be empty", param_hint="--api-key")
    keys = [key.strip() for key in api_keys] + _read_api_keys(api_key_file)
    if host not in LOOPBACK and not keys:
        click.secho(f"warning: serving on {host} without --api-key: anyone who can reach this port can use it",
                    fg="yellow", err=True)
    import logging

    server_log = logging.getLogger("specedge.server")
    if not server_log.handlers:  # once per process, however often the command runs (tests)
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     specedge: %(message)s"))  # uvicorn's look
        server_log.addHandler(handler)
    server_log.setLevel(log_level.upper())
    load = load_from(kw)
    generator = Generator.from_bundle(bundle, provider=load.provider, threads=load.threads,
                                      verify_checksums=load.verify_checksums, load_draft=not no_speculation,
                                      cache_slots=load.cache_slots,
                                      cache_memory=None if cache_memory is None else int(cache_memory * 1e6))
    if prompt_cache is not None:
        server_log.info(warm_prompt_cache(generator, prompt_cache, _read_system_prompt(system_prompt), exact=exact))
    app = create_app(generator, api_key=keys or None, queue_size=queue_size, max_body_bytes=max_body_bytes,
                     model_name=model_name, speculation=not no_speculation, warmup=not no_warmup,
                     cache_sharing=cache_sharing, max_tokens=max_tokens or None, exact=exact)
    SpecedgeServer(server_config(app, host=host, port=port, log_level=log_level, grace_s=shutdown_grace),
                   grace_s=shutdown_grace).run()


def _read_api_keys(path: Path | None) -> list[str]:
    if path is None:
        return []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"cannot read {path}: {exc}", param_hint="--api-key-file") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise click.BadParameter(f"{path} holds no key", param_hint="--api-key-file")
    return keys


def _read_system_prompt(value: str | None) -> str | None:
    if value is None or not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"cannot read {value[1:]}: {exc}", param_hint="--system-prompt") from None


_CACHE = "--prompt-cache"


def warm_prompt_cache(generator, path: Path, system_prompt: str | None, *, exact: bool = False) -> str:
    """Load ``path`` into a conversation slot, or compute and write it from ``system_prompt``.

    Returns a line for the log. A file that exists but cannot be used (another bundle or setting,
    truncated, corrupt, holding another prompt) is refused as a bad --prompt-cache value (the CLI's
    ``error: ...`` line and exit status 2), never overwritten: the path may be someone else's file.
    Without the file and without a system prompt, refused too. The work is
    runtime/prefill_ahead.warm_from_file; here its PromptCacheError becomes the CLI's refusal.
    """
    from ..errors import PromptCacheError
    from ..runtime.prefill_ahead import warm_from_file

    try:
        return warm_from_file(generator, path, system_prompt, exact=exact)
    except PromptCacheError as exc:
        raise click.BadParameter(str(exc), param_hint=_CACHE) from None
