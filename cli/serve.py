"""``specedge serve``: parse options, load the bundle, run uvicorn. Nothing else."""

from __future__ import annotations

from pathlib import Path

import click

from ..engines.base import PROVIDERS
from ..server.limits import (DEFAULT_CACHE_SLOTS, DEFAULT_MAX_BODY_BYTES, DEFAULT_QUEUE_SIZE,
                             DEFAULT_SHUTDOWN_GRACE_S, MAX_SHUTDOWN_GRACE_S)
LOOPBACK = ("127.0.0.1", "::1", "localhost")


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. The default is loopback only; 0.0.0.0 exposes the server to the network.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="TCP port (0: any free port).")
@click.option("--api-key", envvar="SPECEDGE_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on /v1/* (also $SPECEDGE_API_KEY).")
@click.option("--model-name", default=None, help="The model id clients send (default: the bundle folder's name).")
@click.option("--queue-size", type=click.IntRange(min=0), default=DEFAULT_QUEUE_SIZE, show_default=True,
              help="Requests that may wait while one generates; the next gets 429.")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=DEFAULT_MAX_BODY_BYTES, show_default=True,
              help="Larger request bodies get 413.")
@click.option("--threads", type=int, default=0, show_default=True,
              help="Threads per ONNX Runtime session (0 = ORT default; at most this machine's CPU count).")
@click.option("--provider", type=click.Choice(PROVIDERS), default="cpu", show_default=True,
              help="Execution provider (cuda/tensorrt need onnxruntime-gpu; `specedge doctor` says which load).")
@click.option("--no-speculation", is_flag=True, help="Plain decoding for every request (the baseline); "
              "the draft model is not loaded.")
@click.option("--no-warmup", is_flag=True, help="Skip running every session once at startup.")
@click.option("--no-verify-checksums", is_flag=True, help="Skip sha256 checks of bundle files at load.")
@click.option("--shutdown-grace", type=click.FloatRange(0, MAX_SHUTDOWN_GRACE_S), default=DEFAULT_SHUTDOWN_GRACE_S,
              show_default=True,
              help="Seconds a running reply may go on after SIGTERM; then it ends with finish_reason 'length'. "
              "Queued and new requests get 503 at once.")
@click.option("--cache-slots", type=click.IntRange(1, 256), default=DEFAULT_CACHE_SLOTS, show_default=True,
              help="Conversations whose KV caches are kept between requests; a request continuing one prefills "
              "only its new tokens (least recently used evicted first).")
@click.option("--cache-memory", type=click.FloatRange(min=0, min_open=True), default=None,
              help="MB the conversation caches may take (default: --cache-slots alone decides).")
@click.option("--prompt-cache", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="File holding the K/V of a fixed prefix (--system-prompt): loaded at start when it exists "
              "(refused if saved for another bundle or setting), else computed and written, so a restart does "
              "not prefill the system prompt again.")
@click.option("--system-prompt", default=None,
              help="The fixed system prompt --prompt-cache holds ('@FILE' reads it from FILE). Needed to create "
              "the cache; when given with an existing cache, the cache must hold exactly this prompt.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True, help="uvicorn's and specedge's log level (info: one line per request).")
def serve(bundle: Path, host: str, port: int, api_key: str | None, model_name: str | None, queue_size: int,
          max_body_bytes: int, threads: int, provider: str, no_speculation: bool, no_warmup: bool,
          no_verify_checksums: bool, shutdown_grace: float, cache_slots: int, cache_memory: float | None,
          prompt_cache: Path | None, system_prompt: str | None, log_level: str) -> None:
    """Serve a bundle over an OpenAI-compatible API (chat and completions, streaming or not).

    \b
    One model, one generation at a time; requests wait in a FIFO queue.
      specedge serve bundles/smollm2 --port 8000
      curl http://127.0.0.1:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'
    Needs the serve extra: pip install 'specedge[serve]'.
    """
    try:
        from ..server.app import create_app
        from ..server.serving import SpecedgeServer, server_config
    except ImportError as exc:
        raise click.ClickException(f"specedge serve needs the serve extra ({exc.name} is missing): "
                                   "pip install 'specedge[serve]'") from None
    from ..runtime.generator import Generator

    if system_prompt is not None and prompt_cache is None:
        raise click.BadParameter("is only used with --prompt-cache", param_hint="--system-prompt")
    if api_key is not None and not api_key:
        raise click.BadParameter("must not be empty", param_hint="--api-key")
    if host not in LOOPBACK and api_key is None:
        click.secho(f"warning: serving on {host} without --api-key: anyone who can reach this port can use it",
                    fg="yellow", err=True)
    import logging

    server_log = logging.getLogger("specedge.server")
    if not server_log.handlers:  # once per process, however often the command runs (tests)
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     specedge: %(message)s"))  # uvicorn's look
        server_log.addHandler(handler)
    server_log.setLevel(log_level.upper())
    generator = Generator.from_bundle(bundle, provider=provider, threads=threads,
                                      verify_checksums=not no_verify_checksums, load_draft=not no_speculation,
                                      cache_slots=cache_slots,
                                      cache_memory=None if cache_memory is None else int(cache_memory * 1e6))
    if prompt_cache is not None:
        server_log.info(warm_prompt_cache(generator, prompt_cache, _read_system_prompt(system_prompt)))
    app = create_app(generator, api_key=api_key, queue_size=queue_size, max_body_bytes=max_body_bytes,
                     model_name=model_name, speculation=not no_speculation, warmup=not no_warmup)
    SpecedgeServer(server_config(app, host=host, port=port, log_level=log_level, grace_s=shutdown_grace),
                   grace_s=shutdown_grace).run()


def _read_system_prompt(value: str | None) -> str | None:
    if value is None or not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"cannot read {value[1:]}: {exc}", param_hint="--system-prompt") from None


def warm_prompt_cache(generator, path: Path, system_prompt: str | None) -> str:
    """Load ``path`` into a conversation slot, or compute and write it from ``system_prompt``.

    Returns a line for the log. A file that exists but cannot be used (another bundle or setting,
    truncated, corrupt, holding another prompt) is refused with a ClickException, never overwritten:
    the path may be someone else's file. Without the file and without a system prompt, refused too.
    """
    from ..errors import PromptCacheError

    messages = None if system_prompt is None else [{"role": "system", "content": system_prompt}]
    try:
        if path.exists():
            loaded = generator.load_prompt_cache(path)
            if messages is not None:
                want = generator.codec.encode_chat(messages, add_generation_prompt=False)
                if loaded["token_ids"] != want:
                    raise click.ClickException(f"prompt cache {path} holds another prompt than --system-prompt; "
                                               "delete it to rebuild it, or give another path")
            return f"prompt cache {path}: loaded {loaded['tokens']} tokens"
        if messages is None:
            raise click.ClickException(f"prompt cache {path} does not exist; pass --system-prompt to create it")
        saved = generator.save_prompt_cache(path, messages=messages)
        return f"prompt cache {path}: computed and saved {saved['tokens']} tokens ({saved['bytes'] / 1e6:.1f} MB)"
    except PromptCacheError as exc:
        raise click.ClickException(str(exc)) from None
