"""`python -m engine.serve`'s command line: the server's flags (every decoding option of the CLI
gives the server's default), then uvicorn on the main thread and the decoding worker beside it."""
from __future__ import annotations

import argparse
import sys
import threading

from ..frontend import DTYPE_CHOICES, Parser, add_decoding_flags, add_plugin_flag, guarded, plugins_loaded
from ..errors import InputError
from ..methods import METHODS
from .routes import build_app
from .server import Server


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m engine.serve", description="an OpenAI-compatible HTTP server over the decoding engine")
    p.add_argument("--model", help="checkpoint directory; default: the shipped models/default")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model id clients send (default: the directory's name)")
    p.add_argument("--method", default="greedy", choices=list(METHODS),
                   help="default decoding method; requests may choose another")
    add_decoding_flags(p)
    add_plugin_flag(p)
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--threads", type=int, help="torch CPU threads of the worker (default: torch's; on a shared "
                                               "CPU 1 is often fastest)")
    p.add_argument("--chat-template", help="Jinja chat template (a file, or the template text) for a checkpoint "
                                           "without one, or to replace its own")
    p.add_argument("--max-batch", type=int, default=32, help="most requests decoded together (1: one at a time)")
    p.add_argument("--max-queue", type=int, default=256, help="most requests waiting; more are answered 429")
    p.add_argument("--batch-wait-ms", type=float, default=10.0,
                   help="when idle, wait this long after a request for others to decode with it")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument("--load-delay", type=float, default=0.0, help=argparse.SUPPRESS)   # tests: a slow load
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not plugins_loaded(argv):                 # a plugin's methods are the server's to offer
        return 2
    args = build_parser().parse_args(argv)
    return guarded(_main, args)


def _main(args) -> int:
    if args.max_batch < 1 or args.max_queue < 1:
        raise InputError("--max-batch and --max-queue must be >= 1")
    if not 0 <= args.batch_wait_ms <= 10_000:
        raise InputError("--batch-wait-ms must be in [0, 10000]")
    if args.threads is not None and args.threads < 1:
        raise InputError("--threads must be >= 1")
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        raise InputError("the server needs fastapi and uvicorn: pip install -e '.[serve]'") from None
    server = Server(args)
    http = uvicorn.Server(uvicorn.Config(build_app(server), host=args.host, port=args.port, log_level=args.log_level,
                                         access_log=args.access_log, timeout_graceful_shutdown=3))
    worker = threading.Thread(target=server.load_and_serve, args=(http,), name="psd-decoder", daemon=True)
    worker.start()
    print(f"serving {server.name} ({server.model_dir}) on http://{args.host}:{args.port} "
          f"(loading; GET /health answers 200 when ready)", file=sys.stderr, flush=True)
    http.run()
    server.scheduler.close()
    worker.join(timeout=10)
    if not http.started and server.exit_code == 0:
        return 1                                      # uvicorn could not bind (it logged why)
    return server.exit_code
