"""Helpers shared by the task suites: a version-stable PRNG, JSONL I/O,
prompt normalisation, the math suite's number matcher, the code extractor and
the one code checker (``assemble_program`` + ``check_code``) that the code, mbpp
and humaneval suites share."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import warnings
import zlib
from pathlib import Path
from typing import Callable, Iterable, Sequence

from models.config import MAX_FILE_BYTES, check_regular, read_bytes

DATA_DIR = Path(__file__).resolve().parent.parent / "data"

_MASK64 = (1 << 64) - 1


class Rng:
    """Small splitmix64 generator.

    Used instead of :mod:`random` so that the committed held-out files are
    reproducible byte for byte on any Python version and platform.
    """

    def __init__(self, seed: int, stream: str = "") -> None:
        digest = hashlib.sha256(f"{int(seed)}:{stream}".encode()).digest()
        self._state = int.from_bytes(digest[:8], "little")

    def next64(self) -> int:
        self._state = (self._state + 0x9E3779B97F4A7C15) & _MASK64
        z = self._state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def randint(self, lo: int, hi: int) -> int:
        """Uniform integer in [lo, hi] (both inclusive)."""
        if hi < lo:
            raise ValueError(f"empty range [{lo}, {hi}]")
        return lo + self.next64() % (hi - lo + 1)

    def choice(self, seq: Sequence):
        if not seq:
            raise ValueError("choice from an empty sequence")
        return seq[self.next64() % len(seq)]

    def random(self) -> float:
        return (self.next64() >> 11) / float(1 << 53)

    def sample(self, seq: Sequence, k: int) -> list:
        pool = list(seq)
        out = []
        for _ in range(k):
            out.append(pool.pop(self.next64() % len(pool)))
        return out


# --------------------------------------------------------------------------
# files


def require_file(path) -> Path:
    """Return ``Path(path)`` if it is a regular file of at most ``MAX_FILE_BYTES``; a one-line
    FileNotFoundError if missing, ValueError if it is a directory, a FIFO, a device or too large
    (checked without opening it: a FIFO would block, a device stream forever)."""
    p = Path(path)
    if not os.path.lexists(p):
        raise FileNotFoundError(f"task data file not found: {p}")
    check_regular(p, "task data file", ValueError)
    return p


def read_data(path) -> bytes:
    """The bytes of a task data file (a ``.gz`` file decompressed), never more than
    ``MAX_FILE_BYTES`` of them (a gzip bomb is an error, not an allocation)."""
    p = require_file(path)
    data = read_bytes(p, "task data file", ValueError)
    if not p.name.endswith(".gz"):
        return data
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as g:
            out = g.read(MAX_FILE_BYTES + 1)
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"cannot read {p}: not a valid gzip file ({e})") from None
    if len(out) > MAX_FILE_BYTES:
        raise ValueError(f"task data file {p} decompresses to more than {MAX_FILE_BYTES} bytes")
    return out


def read_jsonl(path) -> list[dict]:
    """Read a .jsonl or .jsonl.gz file (one JSON object per non-blank line)."""
    p = Path(path)
    data = read_data(p)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"cannot read {p}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{p}:{n}: not valid JSON ({e})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{p}:{n}: expected a JSON object, got {type(rec).__name__}")
        out.append(rec)
    return out


# --------------------------------------------------------------------------
# the fields a suite's problems need, checked before anything is decoded

def _is_str(v) -> bool:
    return isinstance(v, str)


def _is_id(v) -> bool:
    return isinstance(v, (str, int)) and not isinstance(v, bool)


def _is_str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _is_number(v) -> bool:
    if isinstance(v, bool):
        return False
    return isinstance(v, (int, float, str)) and _to_number(str(v)) is not None


ID = (_is_id, "a string or an integer")
STR = (_is_str, "a string")
STR_LIST = (_is_str_list, "a list of strings")
TESTS = (lambda v: _is_str_list(v) and len(v) > 0, "a non-empty list of strings (with no test any code would pass)")
NUMBER = (_is_number, "a number (or a string holding one)")
OBJECT = (lambda v: isinstance(v, dict), "an object")
OPT_STR = (lambda v: v is None or isinstance(v, str), "a string or null")


def _json_type(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(v), type(v).__name__)


def check_fields(problems: Sequence[dict], fields: dict, source: str) -> None:
    """Every problem holds every field of ``fields`` (``{"target.tests": (test, description)}``,
    dotted paths into nested objects) with a value of the right kind; else a one-line ValueError
    naming ``source``, the problem and the field."""
    for n, prob in enumerate(problems, 1):
        pid = prob.get("id") if isinstance(prob, dict) else None
        who = f"problem {pid!r}" if _is_id(pid) else f"record {n}"
        for path, (ok, expected) in fields.items():
            v, have = prob, True
            for key in path.split("."):
                if not isinstance(v, dict) or key not in v:
                    have = False
                    break
                v = v[key]
            if not have:
                raise ValueError(f"{source}: {who} lacks the field {path!r}")
            if not ok(v):
                raise ValueError(f"{source}: {who}: field {path!r} must be {expected}, got {_json_type(v)}")


def read_results(path, fields: Sequence[str]) -> list[dict]:
    """The per-problem records of a ``bench.eval`` JSONL; ValueError unless every
    record has ``fields`` (in that order in the message)."""
    records = read_jsonl(path)
    if not records or any(not set(fields) <= set(r) for r in records):
        raise ValueError(f"not a bench.eval results file (needs {', '.join(fields)})")
    return records


def dumps_jsonl(records: Iterable[dict]) -> str:
    """Canonical JSONL text: sorted keys, ASCII, '\\n' line ends."""
    return "".join(json.dumps(r, sort_keys=True, ensure_ascii=True) + "\n" for r in records)


def write_jsonl(path, records: Iterable[dict]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w", encoding="ascii", newline="\n") as f:
        f.write(dumps_jsonl(records))


_NORM_RE = re.compile(r"[^a-z0-9]+")


def normalize_prompt(text: str) -> str:
    """Lower-case, drop punctuation, collapse whitespace (for disjointness)."""
    return " ".join(_NORM_RE.sub(" ", text.lower()).split())


# --------------------------------------------------------------------------
# few-shot formatting shared by the "Question: ... Answer:" suites

QA_SHOT_SEPARATOR = "\n\n"


def read_examples(path, k: int) -> list[dict]:
    """The first ``k`` records of a file of worked examples in a synthetic suite's data format
    (math/code ``--few-shot-data``); each needs a string ``prompt`` and ``answer`` (else a
    one-line ValueError)."""
    examples = read_jsonl(path)[:k]
    check_fields(examples, {"prompt": STR, "answer": STR}, f"few-shot data {path}")
    return examples


def shot_turns(task, problem: dict, shots: Sequence[dict]) -> list[dict]:
    """`task.format_prompt(problem, shots)` as chat messages, each shot a user turn (its question as the
    task formats a problem) and an assistant turn (its answer), the problem the last user turn, as
    lm-eval's --fewshot_as_multiturn renders them. Read off the task's own format: a shot's text is
    what it adds before the problem's prompt, its question part what `format_prompt(shot)` writes."""
    alone = task.format_prompt(problem, ())
    turns = []
    for s in shots:
        text, question = task.format_prompt(problem, [s]), task.format_prompt(s, ())
        if not (text.endswith(alone) and text.startswith(question)):
            raise ValueError(f"--task {task.NAME}: a few-shot example's text does not split into its question "
                             f"and its answer")
        turns += [{"role": "user", "content": question.strip()},
                  {"role": "assistant", "content": text[len(question):len(text) - len(alone)].strip()}]
    return turns + [{"role": "user", "content": alone.strip()}]


def qa_prompt(question: str, answer_sep: str, few_shot: Iterable[dict] = ()) -> str:
    parts = [f"Question: {s['prompt']}\nAnswer:{answer_sep}{s['answer']}" for s in few_shot]
    parts.append(f"Question: {question}\nAnswer:{answer_sep}")
    return QA_SHOT_SEPARATOR.join(parts)


# --------------------------------------------------------------------------
# GSM8K-style number matching

_AFTER_HASHES = re.compile(r"####\s*(-?\$?\s*-?[0-9][0-9,]*(?:\.[0-9]+)?)")
_NUMBER = re.compile(r"-?\$?-?[0-9][0-9,]*(?:\.[0-9]+)?")


def _to_number(tok: str) -> float | None:
    tok = tok.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        return float(tok)
    except ValueError:
        return None


def extract_answer_number(text: str) -> float | None:
    """The answer a completion gives, as GSM8K's flexible match reads it.

    The number after the first ``####`` that is followed by a number; if
    there is none, the last number anywhere in the text.  Commas, ``$`` and a
    trailing ``.`` are stripped.  Returns None if the text has no number.
    """
    m = _AFTER_HASHES.search(text)
    if m:
        return _to_number(m.group(1))
    nums = _NUMBER.findall(text)
    for tok in reversed(nums):
        v = _to_number(tok)
        if v is not None:
            return v
    return None


def numbers_equal(pred: float | None, target) -> bool:
    if pred is None:
        return False
    t = _to_number(str(target))
    if t is None:
        return False
    return abs(pred - t) <= 1e-6 * max(1.0, abs(t))


# --------------------------------------------------------------------------
# code extraction

_FENCE = re.compile(r"```[ \t]*[A-Za-z0-9_+-]*[ \t]*\n(.*?)(?:```|\Z)", re.S)
_BLOCK_START = re.compile(r"(def |async def |class |@|import |from )")
_IMPORT = re.compile(r"(import |from \S+ import )")
_DEF_NAME = re.compile(r"(?:async\s+)?def\s+([A-Za-z_][A-Za-z0-9_]*)\s*\(")


def _compiles(src: str) -> bool:
    try:
        with warnings.catch_warnings():      # e.g. invalid escape sequences in MBPP references: not our
            warnings.simplefilter("ignore")  # concern, and must not turn into errors under -W error
            compile(src, "<extracted>", "exec")
        return True
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False


def _block_name(block: list[str]) -> str | None:
    """Name defined by a top-level def block (after any decorators)."""
    for x in block:
        if x and x[0] not in " \t":
            mm = _DEF_NAME.match(x)
            if mm:
                return mm.group(1)
    return None


def extract_code(completion: str, entry_point: str | None = None) -> str | None:
    """Pull the function definition(s) out of a model completion.

    Rule (documented in docs/tasks.md):

    1. ``\\r\\n`` -> ``\\n``; if the text contains a ``` fence, only the
       first fenced block is used.
    2. Find the first line that starts (column 0) with ``def ``; no such line
       -> ``None`` (the completion scores False).
    3. Keep the top-level ``import``/``from`` lines that appear before it.
    4. From that ``def`` on, keep whole top-level blocks that start with
       ``def``/``async def``/``class``/``@``/``import``/``from``; a block is
       its first line plus every following line that is blank or indented.
       Top-level ``#`` comment lines are skipped.  Stop at the first other
       non-blank top-level line (junk such as ``Question: ...``, ``print(``,
       ``assert``, prose).
    5. If the result does not compile, drop trailing blocks (keeping at least
       the block that defines ``entry_point``, or the first block) until it
       does; if even that does not compile it is returned as is and fails in
       the sandbox.
    """
    text = completion.replace("\r\n", "\n").replace("\r", "\n")
    m = _FENCE.search(text)
    if m:
        text = m.group(1)
    lines = text.split("\n")
    start = next((i for i, ln in enumerate(lines)
                  if ln.startswith("def ") or ln.startswith("async def ")), None)
    if start is None:
        return None
    imports = [ln.rstrip() for ln in lines[:start] if _IMPORT.match(ln)]
    blocks = _top_level_blocks(lines, start)
    keep = 1
    if entry_point:
        for k, b in enumerate(blocks):
            if _block_name(b) == entry_point:
                keep = k + 1
                break
    for n in range(len(blocks), keep - 1, -1):
        src = _render(imports, blocks[:n])
        if _compiles(src):
            return src
    return _render(imports, blocks[:keep])


def _top_level_blocks(lines: list[str], start: int) -> list[list[str]]:
    """Rule 4 of `extract_code`: the whole top-level blocks from line `start` on (decorators joined
    to their def/class, trailing blank lines dropped), up to the first other top-level line."""
    blocks: list[list[str]] = []
    i = start
    while i < len(lines):
        ln = lines[i]
        if not ln.strip() or ln.startswith("#"):
            i += 1
            continue
        if ln[0] in " \t":  # stray indented line between blocks: junk
            break
        if not _BLOCK_START.match(ln):
            break
        block = [ln]
        i += 1
        # decorators continue onto the next top-level def/class line
        while block[-1].startswith("@") and i < len(lines) and _BLOCK_START.match(lines[i]):
            block.append(lines[i])
            i += 1
        while i < len(lines) and (not lines[i].strip() or lines[i][0] in " \t"):
            block.append(lines[i])
            i += 1
        while block and not block[-1].strip():
            block.pop()
        blocks.append(block)
    return blocks


def _render(imports: list[str], bs: list[list[str]]) -> str:
    """The import lines, then the blocks separated by a blank line."""
    head = "\n".join(imports)
    body = "\n\n".join("\n".join(b) for b in bs)
    return (head + "\n" + body if head else body) + "\n"


def truncate_at(text: str, stops: Iterable[str]) -> str:
    """Cut ``text`` at the earliest occurrence of any stop string."""
    cut = len(text)
    for s in stops:
        j = text.find(s)
        if j != -1:
            cut = min(cut, j)
    return text[:cut]


# --------------------------------------------------------------------------
# the code checker (code, mbpp, humaneval)


def assemble_program(code: str | None, tests: Sequence[str], imports: str = "", setup: str = "") -> str | None:
    """The program the sandbox runs: ``imports``, ``code``, a blank line,
    ``setup``, then the ``tests`` one per line (None if there is no code)."""
    if code is None:
        return None
    head = imports + "\n" if imports else ""
    mid = setup + "\n" if setup else ""
    return head + code + "\n\n" + mid + "\n".join(tests) + "\n"


def check_code(completions: Sequence[str], problems: Sequence[dict],
               build_program: Callable[[str, dict], str | None], timeout_s: float,
               isolation: str | None = None) -> list[bool]:
    """The one code checker: ``build_program(completion, problem)`` (the suite's
    extraction + ``assemble_program``) for every pair, all programs in one
    ``run_python_batch`` call, solved iff the sandbox says ``passed``; a
    completion with no extractable code (None) fails without running. ``isolation``: the
    sandbox's level (None: namespace isolation or ``SandboxUnavailable``; ``"fallback"``: the
    reduced level a user opted in to, bench.eval --unsafe-sandbox)."""
    from .. import sandbox

    progs = [build_program(c, p) for c, p in zip(completions, problems, strict=True)]
    idx = [i for i, prog in enumerate(progs) if prog is not None]
    out = [False] * len(progs)
    if idx:
        kw = {} if isolation is None else {"isolation": isolation}
        for i, res in zip(idx, sandbox.run_python_batch([progs[i] for i in idx], timeout_s=timeout_s, **kw),
                          strict=True):
            out[i] = res.ok
    return out


def code_suite(build_program: Callable[[str, dict], str | None], fields: dict, timeout_s: float):
    """A code suite's checker, from its ``build_program`` and ``FIELDS``: ``(score, score_batch,
    check)``, the module functions bench.eval calls (each suite module binds them)."""

    def score(completion: str, problem: dict, timeout_s: float = timeout_s, *, isolation: str | None = None) -> bool:
        """True iff the program built from ``completion`` passes all of the problem's tests."""
        return check_code([completion], [problem], build_program, timeout_s, isolation)[0]

    def score_batch(completions: Sequence[str], problems: Sequence[dict], timeout_s: float = timeout_s, *,
                    isolation: str | None = None) -> list[bool]:
        """Same verdicts as ``score`` for each pair, in one sandbox call."""
        return check_code(completions, problems, build_program, timeout_s, isolation)

    def check(problems: Sequence[dict], source: str) -> None:
        """A one-line ValueError unless every problem has the suite's fields (bench.eval calls it on
        all rows before decoding anything)."""
        check_fields(problems, fields, source)

    return score, score_batch, check


# --------------------------------------------------------------------------
# does the task fit the model's window?


def window_error(task, problems: Sequence[dict], shots: int, examples: Callable[[int], list],
                 encode: Callable[[dict, list], list], window: int, gen_length: int, block_length: int,
                 gen_flag: str = "--gen-length ") -> str | None:
    """None if every prompt of ``problems`` (with the ``shots`` examples
    ``examples(shots)`` gives, as ``encode(problem, examples)`` makes its ids) plus ``gen_length`` fits the
    ``window``; else a one-line
    message naming the longest prompt and the setting that fits these problems:
    the most shots that fit with ``gen_length``, else zero shots and the longest
    generation (a multiple of ``block_length``) that fits. ``gen_flag`` is how the message
    writes the generation length (a method spec's own: ``gen_length=``).

    Prompts grow with the number of shots (a suite's k examples are the first k of its k + 1), so
    the most shots that fit are found by bisection, first on one problem (a cheap upper bound),
    then on all: a few encodings per problem whatever ``shots`` is."""
    if not problems:
        return None
    room = window - gen_length
    built: dict[int, list] = {}

    def length(p: dict, k: int) -> int:
        if k not in built:
            built[k] = examples(k) if k else []
        return len(encode(p, built[k]))

    def longest(k: int) -> tuple[int, str]:
        return max((length(p, k), p["id"]) for p in problems)

    def most(lo: int, hi: int, fits) -> int:
        """The largest k in [lo, hi] with fits(k) (fits(lo) holds, fits is monotone), by bisection."""
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    first = length(problems[0], shots)
    what = f"{shots}-shot prompts" if shots else "prompts"
    if first <= room:
        n, pid = longest(shots)
        if n <= room:
            return None
        size = f"up to {n} tokens ({pid})"
    else:
        size = f"{first} tokens or more ({problems[0]['id']})"
    msg = (f"--task {task.NAME} does not fit the model's {window}-token window: the {what} of these "
           f"{len(problems)} problems take {size}, plus {gen_flag}{gen_length}; ")
    n0, pid0 = longest(0)
    if shots and n0 <= room:
        bound = most(0, shots - 1, lambda k: length(problems[0], k) <= room)
        return msg + f"use --few-shot {most(0, bound, lambda k: longest(k)[0] <= room)}, which fits"
    gen = (window - n0) // block_length * block_length
    if gen >= block_length:
        return msg + ("use --few-shot 0 " if shots else "use ") + f"{gen_flag}{gen}, which fits"
    return msg + (f"no setting fits: the longest 0-shot prompt ({pid0}) alone takes {n0} tokens; "
                  "use a model with a longer window")
