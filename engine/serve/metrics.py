"""What `GET /metrics` reports: counters, gauges and histograms in the Prometheus text format
0.0.4 (docs/serve.md, "Metrics"). The HTTP side counts requests and answers here; the gauges and
the model-call counter are read from the scheduler when the text is rendered."""
from __future__ import annotations

import threading


class Histogram:
    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.count = tuple(buckets), [0] * len(buckets), 0.0, 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}",
                      f"{name}_count {self.count}"]


SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """What GET /metrics reports (Prometheus text format 0.0.4), counted on the HTTP side."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = self.completion_tokens = self.decoded_tokens = self.sequence_calls = 0
        self.choices = 0
        self.latency, self.ttft = Histogram(SECONDS), Histogram(SECONDS)
        self.batch = Histogram((1, 2, 4, 8, 16, 32, 64, 128, 256))

    def request(self, path: str, status: int, seconds: float | None = None) -> None:
        with self.lock:
            key = (path if path in ("/v1/completions", "/v1/chat/completions") else "other", status)
            self.requests[key] = self.requests.get(key, 0) + 1
            if seconds is not None:
                self.latency.observe(seconds)

    def first_token(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(seconds)

    def answered(self, prompt_tokens: int, results: list, answers: list, jobs: list) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.choices += len(results)
            for res, answer, job in zip(results, answers, jobs):
                self.completion_tokens += answer.completion_tokens
                self.decoded_tokens += res.tokens
                self.sequence_calls += res.calls
                self.batch.observe(job.batch_size)

    def render(self, sch) -> str:
        """The /metrics text; the gauges and the model-call counter read from the scheduler `sch`."""
        stats = getattr(sch, "stats", {}) or {}
        with self.lock:
            families = [
                ("psd_requests_total", "counter", "HTTP requests answered, by endpoint and status",
                 [f'psd_requests_total{{endpoint="{e}",status="{s}"}} {c}'
                  for (e, s), c in sorted(self.requests.items())]),
                ("psd_choices_total", "counter", "choices decoded (one per prompt and sample)",
                 [f"psd_choices_total {self.choices}"]),
                ("psd_prompt_tokens_total", "counter", "prompt tokens of answered requests",
                 [f"psd_prompt_tokens_total {self.prompt_tokens}"]),
                ("psd_completion_tokens_total", "counter", "tokens returned (after max_tokens and stop cuts)",
                 [f"psd_completion_tokens_total {self.completion_tokens}"]),
                ("psd_generated_tokens_total", "counter", "tokens the engine decoded (gen length up to a stop token)",
                 [f"psd_generated_tokens_total {self.decoded_tokens}"]),
                ("psd_model_calls_total", "counter", "model forward calls of the decoding worker",
                 [f"psd_model_calls_total {stats.get('calls', self.sequence_calls)}"]),
                ("psd_sequence_calls_total", "counter", "model calls summed over the sequences in them",
                 [f"psd_sequence_calls_total {self.sequence_calls}"]),
                ("psd_tokens_per_forward", "gauge", "generated tokens / sequence calls since the start (TPF)",
                 [f"psd_tokens_per_forward {self.decoded_tokens / max(self.sequence_calls, 1):.6f}"]),
                ("psd_queue_length", "gauge", "requests with a choice waiting for the decoding worker",
                 [f"psd_queue_length {sch.queued()}"]),
                ("psd_running_batch_size", "gauge", "rows (choices) in the running batches now",
                 [f"psd_running_batch_size {getattr(sch, 'running', 0)}"]),
                ("psd_batch_size", "histogram", "the batch size each choice was decoded in", self.batch.lines("psd_batch_size")),
                ("psd_request_latency_seconds", "histogram", "request arrival to the last byte of the answer",
                 self.latency.lines("psd_request_latency_seconds")),
                ("psd_time_to_first_token_seconds", "histogram", "request arrival to the first final token",
                 self.ttft.lines("psd_time_to_first_token_seconds")),
            ]
        out = []
        for name, kind, what, lines in families:
            out += [f"# HELP {name} {what}", f"# TYPE {name} {kind}", *lines]
        return "\n".join(out) + "\n"
