"""The server's state: the checkpoint's cheap parts (config, tokenizer, defaults) at once, the model
loaded in the worker thread, the scheduler chosen by --batching, and the limits a request is
checked against (request.py turns a request into `Spec`s)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from models import CheckpointError, ModelConfig, Tokenizer

from ..frontend import DEFAULT_MODEL_DIR, decoding_options, resolve_device, suggested_config, with_suggestions
from ..config import DecodeConfig
from ..errors import InputError
from ..uniform import check_batchable, for_model
from ..options import OPTIONS
from .protocol import MAX_N, Spec, one_line, size_problem
from .request import Limits, parse_request
from .worker import make_scheduler


class Server:
    """The checkpoint's cheap parts (config, tokenizer, defaults) at once; the model in the background."""

    def __init__(self, args: argparse.Namespace):
        if args.model is None:
            args.model = str(DEFAULT_MODEL_DIR)
        self.model_dir = Path(args.model)
        if not self.model_dir.is_dir():
            raise CheckpointError(f"model directory {self.model_dir} does not exist or is not a directory")
        self.mc = ModelConfig.from_dir(self.model_dir)
        self.uniform = self.mc.mask_token_id is None          # DiffusionGemma: docs/algorithms.md §9
        batching = getattr(args, "batching", None) or ("static" if self.uniform else "continuous")
        if self.uniform and batching == "continuous":      # refused before the server listens, never per request
            check_batchable(self.mc)
        self.tok = Tokenizer(self.model_dir)
        if args.chat_template is not None:
            self._set_chat_template(args.chat_template)
        self.name = args.served_model_name or self.model_dir.resolve().name
        self.args = args
        opts = decoding_options(args)
        problem = size_problem(opts, self.mc.max_length)
        if problem:
            raise InputError(f"{OPTIONS[problem[0]].flag}: {problem[1]}")
        method = args.method or ("eb" if self.uniform else "greedy")
        dc = suggested_config(lambda given: for_model(self.mc, DecodeConfig(method=method, **given)).validate(),
                              opts, self.mc.generation_defaults, self.model_dir)   # the checkpoint's, where no flag
        self.defaults = {"method": method, **with_suggestions(opts, self.mc.generation_defaults)}
        self._check_flags(dc)                                  # fails before it starts
        self.status, self.error = "loading", None
        self.max_choices = min(getattr(args, "max_choices", MAX_N), args.max_queue)
        self.scheduler = make_scheduler(batching, args.max_queue, args.max_batch,
                                        args.batch_wait_ms / 1000, getattr(args, "batch_by_length", False))
        self.created = int(time.time())
        self.exit_code = 0

    def _check_flags(self, dc: DecodeConfig) -> None:
        """What `engine.generate` refuses before it reads weights is refused before the server
        listens: the device, --cuda-graphs off CUDA, a bad --cost-profile. The decoder's other checks
        run when the default decoder is built on the loaded model, before /health answers 200."""
        import torch

        from models.parallel import current

        from ..cost import read_profile
        from ..graphs import graphed

        if current() is None:                 # (under tensor parallel each rank has its device)
            device = torch.device(resolve_device(self.args.device))
            if dc.cuda_graphs and device.type != "cuda":
                graphed(None, dc, device)       # raises its one-line refusal
        if dc.cost_profile is not None:
            read_profile(dc.cost_profile)

    def _set_chat_template(self, value: str) -> None:
        """--chat-template: a file, or the template text itself (compiled now: a broken one fails here)."""
        path = Path(value)
        if path.is_file():
            try:
                text, source = path.read_text(encoding="utf-8"), f"the chat template {path}"
            except (OSError, UnicodeDecodeError) as e:
                raise InputError(f"cannot read --chat-template {path}: {e}") from None
        elif "{{" in value or "{%" in value:
            text, source = value, "the --chat-template text"
        else:
            raise InputError(f"--chat-template {value!r} is neither a file nor a Jinja template")
        self.tok.set_chat_template(text, source)

    def load_and_serve(self, http) -> None:
        """The worker thread: load the model, warm it up, then decode batches until shutdown."""
        try:
            if self.args.load_delay:
                time.sleep(self.args.load_delay)
            import torch

            from models import load_model
            from models.parallel import current

            from ..config import DecodeConfig
            from ..distributed import decoder_class
            from ..frontend import set_threads
            from ..loop import Decoder

            set_threads(self.args.threads)          # and the C allocator (engine.frontend.tune_allocator)
            t0 = time.perf_counter()
            tp = current()                     # tensor parallel (torchrun): this rank's shard
            model = load_model(self.model_dir, dtype=self.args.dtype,
                               device=tp.device if tp else resolve_device(self.args.device), tp=tp)
            model.set_gemm(self.args.gemm)
            Decoder(model, DecodeConfig(**self.defaults))   # the server's default decoder: every check of
            # engine.generate (--compile's compiler, --cuda-graphs' options, ...) before /health says ok
            warm = DecodeConfig(gen_length=1, max_denoising_steps=1) if self.uniform else \
                DecodeConfig(gen_length=1, block_length=1)
            decoder_class()(model, warm).generate(
                [self.tok.encode("a") or [self.mc.eos_token_id]])
            self.model = model
            print(f"model {self.name} loaded on {model.device} in {time.perf_counter() - t0:.1f} s; ready",
                  file=sys.stderr, flush=True)
        except BaseException as e:     # noqa: BLE001 -- reported, then the server stops with status 2
            self.status, self.error = "failed", one_line(e)
            print(f"error: {self.error}", file=sys.stderr, flush=True)
            self.exit_code = 2
            http.should_exit = True
            return
        self.status = "ok"
        try:
            self.scheduler.run(model)         # one batch's failure is its requests' error; this is the worker's
        except BaseException as e:            # noqa: BLE001 -- no request may wait on a dead worker
            self.status, self.error = "failed", f"the decoding worker stopped: {one_line(e)}"
            print(f"error: {self.error}", file=sys.stderr, flush=True)
            self.scheduler.close()
            self.exit_code = 1
            http.should_exit = True

    # ------------------------------------------------------------------ parsing a request
    def limits(self) -> Limits:
        """What a request is checked against (engine/serve/request.py)."""
        return Limits(self.name, self.mc, self.tok, self.defaults, self.max_choices, self.scheduler.max_queue,
                      strict=bool(getattr(self.args, "strict", False)))

    def parse(self, body: dict, chat: bool) -> list[Spec]:
        """The Specs of a request (`request.parse_request` against this server's limits)."""
        return parse_request(body, chat, self.limits())
