"""`python -m engine.serve`'s command line: the server's flags (every decoding option of the CLI
gives the server's default), then uvicorn on the main thread and the decoding worker beside it."""
from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import os
import socket
import sys
import threading

from ..frontend import (DTYPE_CHOICES, DefaultsFormatter, Parser, add_decoding_flags, add_gemm_flag, add_plugin_flag,
                        add_threads_flag, checked_gemm, guarded, plugins_loaded, resolve_device)
from ..errors import InputError
from ..methods import METHODS
from .routes import build_app, head_timeout_protocol
from .server import Server

DECODER_THREAD = "psd-decoder"   # the thread that loads the model and decodes
MAX_BODY_BYTES = 4 << 20     # --max-body-bytes: a prompt at any model's length is far less; more is an attack
MAX_CHOICES = 64             # --max-choices: a request's prompts times n (two --max-batch's worth at its default)
READ_TIMEOUT = 30.0          # --read-timeout: seconds a client has to send a request's head, and then its body
BIND_ERRORS = {errno.EADDRINUSE: "the port is already in use",
               errno.EACCES: "permission denied (a port below 1024 needs privileges)",
               errno.EADDRNOTAVAIL: "the address is not one of this machine's"}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m engine.serve", description="an OpenAI-compatible HTTP server over the decoding engine",
               formatter_class=DefaultsFormatter)
    p.add_argument("--model", help="checkpoint directory; default: the shipped models/default")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (a non-loopback one without "
                                                        "--api-key prints a warning)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every path but /health (401 "
                                     "otherwise); default: the environment variable PSD_API_KEY, else none")
    p.add_argument("--strict", action="store_true",
                   help="refuse unknown request fields with 400 (default: ignore them, naming them in the "
                        "X-PSD-Ignored-Fields header and the log)")
    p.add_argument("--served-model-name", help="the model id clients send (default: the directory's name)")
    p.add_argument("--method", choices=list(METHODS),
                   help="default decoding method; requests may choose another (default: greedy; eb on a "
                        "uniform-noise model, diffusion_gemma, the only method it decodes)")
    add_decoding_flags(p)
    add_plugin_flag(p)
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES, help="model weights' dtype")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    add_gemm_flag(p)
    add_threads_flag(p, help="torch CPU threads of the worker (default: torch's; on a shared CPU 1 is often fastest)")
    p.add_argument("--chat-template", help="Jinja chat template (a file, or the template text) for a checkpoint "
                                           "without one, or to replace its own")
    p.add_argument("--max-batch", type=int, default=32,
                   help="most rows (choices: a request's prompts times n) decoded together, in all running "
                        "batches (1: one at a time)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="most choices waiting (a request's prompts times n); a request whose choices do not all "
                        "fit is answered 429")
    p.add_argument("--max-choices", type=int, default=MAX_CHOICES,
                   help="most choices (prompts times n) one request may ask for; more is a 400")
    p.add_argument("--read-timeout", type=float, default=READ_TIMEOUT,
                   help="seconds a client has to send a request's line and headers (from connecting or from its "
                        "previous answer), and then as many for its body; else the connection is closed (408 for "
                        "a body)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help=f"largest request body; a larger one is answered 413 without being read (default: "
                        f"{MAX_BODY_BYTES} = {MAX_BODY_BYTES >> 20} MiB)")
    p.add_argument("--batch-wait-ms", type=float, default=10.0,
                   help="--batching static: when idle, wait this long after a request for others to decode with it")
    p.add_argument("--batching", choices=("continuous", "static"),
                   help="continuous (default): requests join a running batch between two model calls and leave when "
                        "done; static (the default on a uniform-noise model, whose draws are the batch's): a batch "
                        "is decoded from start to end before the next one starts")
    p.add_argument("--batch-by-length", action="store_true",
                   help="continuous batching: one running batch per generation length (max_tokens rounded up "
                        "to a block) instead of one for every length: each call computes its rows' own lengths, "
                        "in smaller calls (docs/serve.md, 'One running batch per length'); static batches are of "
                        "one length already")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument("--load-delay", type=float, default=0.0, help=argparse.SUPPRESS)   # tests: a slow load
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not plugins_loaded(argv):                 # a plugin's methods are the server's to offer
        return 2
    args = build_parser().parse_args(argv)
    status = guarded(_main, args)
    if any(t.name == DECODER_THREAD and t.is_alive() for t in threading.enumerate()):
        # the server did not start while the model was still loading (inside torch's C++ code): an
        # interpreter ending under that thread aborts ("terminate called ..."), so leave at once
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def where(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound now (before the model is read): a bad --port or --host is one
    error line, never an abort from uvicorn. Like uvicorn: IPv6 when the host holds a colon."""
    if not 1 <= port <= 65535:
        raise InputError(f"--port {port} is not a TCP port (1 to 65535)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        info = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except (OSError, UnicodeError, ValueError) as e:     # gaierror is an OSError; a bad IDNA label a UnicodeError
        raise InputError(f"--host {host!r} cannot be resolved: {getattr(e, 'strerror', None) or e}") from None
    fam, kind, proto, _, address = info[0]
    sock = socket.socket(fam, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise InputError(f"cannot listen on {where(host, port)}: {BIND_ERRORS.get(e.errno, e.strerror or e)}") from None
    return sock


class _StartupErrors(logging.Filter):
    """uvicorn's own error lines while it starts are kept for our one `error:` line."""

    def __init__(self, http):
        super().__init__()
        self.http, self.messages = http, []

    def filter(self, record) -> bool:
        if self.http.started or record.levelno < logging.ERROR:
            return True
        self.messages.append(record.getMessage())
        return False


def http_server(config, on_exit):
    """uvicorn's server, calling `on_exit` (the scheduler's close) on the event loop at the first
    SIGINT or SIGTERM: waiting requests are answered 503 `shutting_down` and running ones at their
    next model call, while the loop still delivers answers (uvicorn then waits up to its graceful
    timeout for them). After uvicorn returns, its handlers are cancelled and nothing reaches a client."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        loop = None

        async def serve(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig, frame):
            if not self.should_exit and self.loop is not None:
                self.loop.call_soon_threadsafe(on_exit)
            super().handle_exit(sig, frame)

    return Server(config)


def check_flags(args) -> None:
    """The server's own flags, before anything is imported or bound."""
    if args.max_batch < 1 or args.max_queue < 1:
        raise InputError("--max-batch and --max-queue must be >= 1")
    if args.max_body_bytes < 1:
        raise InputError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if args.max_choices < 1:
        raise InputError(f"--max-choices must be >= 1, got {args.max_choices}")
    if not 0 < args.read_timeout <= 3600:
        raise InputError(f"--read-timeout must be in (0, 3600] seconds, got {args.read_timeout}")
    if not 0 <= args.batch_wait_ms <= 10_000:
        raise InputError("--batch-wait-ms must be in [0, 10000]")
    name = args.served_model_name
    if name is not None and (not name.strip() or not name.isprintable()):
        raise InputError(f"--served-model-name must be a printable, non-blank model id, got {name!r}")


def _main(args) -> int:
    check_flags(args)
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        raise InputError("the server needs fastapi and uvicorn: pip install 'psd-engine[serve]' (from a checkout: "
                         "pip install -e '.[serve]')") from None
    if args.api_key is None:
        args.api_key = os.environ.get("PSD_API_KEY") or None
    if args.api_key is not None and (not args.api_key.strip() or any(c.isspace() for c in args.api_key)):
        raise InputError("--api-key must be a non-empty key without spaces")
    from .. import distributed
    tp = distributed.setup(args.device)         # under torchrun: tensor parallel, rank 0 serves
    checked_gemm(args.gemm, tp.device if tp else resolve_device(args.device), args.dtype, tp is not None)
    if tp is not None and tp.rank != 0:         # the other ranks run its model calls, they bind nothing
        return distributed.serve_follower(Server(args).model_dir, args.dtype, args.device)
    sock = listen(args.host, args.port)
    if not args.api_key and not loopback(args.host):
        print(f"warning: listening on {args.host}, which is not a loopback address, without --api-key: anyone who "
              f"can reach this port can use the model", file=sys.stderr, flush=True)
    try:
        server = Server(args)
    except BaseException:
        sock.close()
        raise
    # the access log is the app's own (routes.RequestId: each line with its X-Request-Id)
    app = build_app(server)
    protocol = head_timeout_protocol(args.read_timeout, args.access_log, server.metrics)
    http = http_server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                      access_log=False, timeout_graceful_shutdown=3, http=protocol),
                       server.scheduler.close)
    startup = _StartupErrors(http)
    logging.getLogger("uvicorn.error").addFilter(startup)
    worker = threading.Thread(target=server.load_and_serve, args=(http,), name=DECODER_THREAD, daemon=True)
    worker.start()
    print(f"serving {server.name} ({server.model_dir}) on http://{where(args.host, args.port)} "
          f"(loading; GET /health answers 200 when ready)", file=sys.stderr, flush=True)
    failure = None
    try:
        http.run(sockets=[sock])
    except (OSError, SystemExit) as e:                # uvicorn could not serve on the socket
        if http.started:
            raise
        failure = e
    finally:
        server.scheduler.close()
        worker.join(timeout=10)
        sock.close()
        distributed.release()                   # followers (tensor parallel) stop with rank 0
    if not http.started and server.exit_code == 0:
        why = (failure.strerror if isinstance(failure, OSError) else None) or \
            next((m.strip().splitlines()[-1] for m in startup.messages if m.strip()), "uvicorn did not start")
        raise InputError(f"cannot serve on {where(args.host, args.port)}: {why}")
    return server.exit_code
