"""MBPP-like suite: one-sentence tasks -> a small Python function.

Each problem asks for one function with a 1-3 line body from one of ~45
families (arithmetic on an argument, string ops, list ops, conditionals) with
randomised function names, argument names, constants and phrasing::

    prompt: "Write a function add_7(x) that returns x plus 7."
    answer: "def add_7(x):\\n    return x + 7"
    target: {"entry_point": "add_7",
             "tests": ["assert add_7(3) == 10", "assert add_7(-2) == 5", ...]}

Every problem has 3 asserts whose expected values come from a Python
implementation of the family, and the inputs are chosen so the asserts cover
both branches of conditionals / both truth values of predicates.

Hard limits (checked on every generated problem): prompt <= 160 characters,
answer <= 120 characters, plain ASCII.

Prompt format (``format_prompt``)::

    Question: <prompt>\\nAnswer:\\n<answer>

i.e. the model is given ``"Question: ...\\nAnswer:\\n"`` and completes it with
the function; the training text is ``format_prompt(p) + p["answer"]``.

Checker (``score``): ``common.extract_code`` pulls the function out of the
completion (first top-level ``def`` and the blocks after it, stopping at the
first non-indented line that is not another def/class/import; see
docs/tasks.md), then the extracted code followed by the 3 asserts runs in the
sandbox through ``common.check_code`` (the checker mbpp and humaneval share);
the problem is solved iff that run passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from .common import (DATA_DIR, ID, OBJECT, STR, TESTS, Rng, assemble_program, code_suite,
                     extract_code, normalize_prompt, qa_prompt, read_examples, read_jsonl)

NAME = "code"
TEST_SEED = 2002
TEST_N = 300
TEST_FILE = DATA_DIR / "code_test.jsonl"
FEW_SHOT_SEED = 7
MAX_PROMPT_CHARS = 160
MAX_ANSWER_CHARS = 120
ANSWER_SEP = "\n"
TIMEOUT_S = 5.0
STOP_SEQUENCES = ("\nQuestion:", "\n\n")
RUNS_CODE = True           # score runs generated code in bench.sandbox
# what a problem needs to be decoded and scored (checked on every row before decoding)
FIELDS = {"id": ID, "prompt": STR, "target": OBJECT, "target.entry_point": STR, "target.tests": TESTS}

_INT_ARGS = ["x", "n", "a", "num", "val"]
_INT2_ARGS = [("a", "b"), ("x", "y"), ("m", "n"), ("p", "q")]
_STR_ARGS = ["s", "text", "word", "w"]
_STR2_ARGS = [("a", "b"), ("s", "t"), ("first", "second")]
_LIST_ARGS = ["xs", "nums", "items", "lst", "values", "arr"]

_WORDS = [
    "cat", "dog", "apple", "banana", "hello", "world", "python", "code", "data",
    "tree", "river", "stone", "moon", "sun", "book", "green", "table", "music",
    "happy", "light", "paper", "pizza", "robot", "tiger", "zebra", "lemon",
    "ocean", "cloud", "bread", "mango", "train", "plant", "house", "water",
    "smile", "night", "sugar", "queen", "yellow", "garden", "bottle", "rain",
]
_LETTERS = "aeilnorst"
_SUFFIXES = ["!", "?", "s", "ed", "ing", "er", "_x", "..."]

_PHRASES = [
    "Write a function {sig} that returns {desc}.",
    "Write a Python function {sig} that returns {desc}.",
    "Define a function {sig} that returns {desc}.",
    "Create a function {sig} which returns {desc}.",
]


@dataclass(frozen=True)
class Family:
    key: str
    kind: str  # int | int2 | str | str2 | list
    names: tuple[str, ...]  # name patterns, may use {k}/{c}/{j}
    desc: str  # may use {x} {a} {b} and constants
    body: str  # body lines, indented 4 spaces after the first
    impl: Callable[..., Any]  # impl(consts, *args) -> expected value
    consts: Callable[[Rng], dict] = lambda r: {}
    inputs: Callable[[Rng, dict], tuple] | None = None
    cover: Callable[[list[tuple[tuple, Any]], dict], bool] | None = None


# ---- input generators -------------------------------------------------------

def _ints(lo, hi):
    return lambda r, c: (r.randint(lo, hi),)


def _int2(lo, hi):
    return lambda r, c: (r.randint(lo, hi), r.randint(lo, hi))


def _word(r: Rng) -> str:
    return r.choice(_WORDS)


def _mixed_case(r: Rng) -> tuple:
    w = _word(r)
    return ("".join(ch.upper() if r.random() < 0.5 else ch for ch in w),)


def _list(lo=0, hi=20, min_len=1, max_len=5):
    return lambda r, c: ([r.randint(lo, hi) for _ in range(r.randint(min_len, max_len))],)


def _word_pair(r, c):
    return (_word(r), _word(r))


def _starts_input(r: Rng, c: dict) -> tuple:
    if r.random() < 0.5:
        cands = [w for w in _WORDS if w.startswith(c["c"])]
        if cands:
            return (r.choice(cands),)
    return (_word(r),)


def _count_input(r: Rng, c: dict) -> tuple:
    if r.random() < 0.6:
        cands = [w for w in _WORDS if c["c"] in w]
        if cands:
            return (r.choice(cands),)
    return (_word(r),)


# ---- coverage predicates ------------------------------------------------------

def _both_bools(cases, c):
    return {out for _, out in cases} == {True, False}


def _both_orders(cases, c):
    return any(a > b for (a, b), _ in cases) and any(a < b for (a, b), _ in cases)


def _both_signs(cases, c):
    return any(x < 0 for (x,), _ in cases) and any(x > 0 for (x,), _ in cases)


def _both_sides(cases, c):
    return any(x > c["k"] for (x,), _ in cases) and any(x < c["k"] for (x,), _ in cases)


def _k(lo, hi):
    return lambda r: {"k": r.randint(lo, hi)}


def _letter(r):
    return {"c": r.choice(_LETTERS)}


F = Family
FAMILIES: tuple[Family, ...] = (
    # arithmetic on one argument
    F("add_k", "int", ("add_{k}", "plus_{k}", "add{k}", "inc_by_{k}"), "{x} plus {k}",
      "return {x} + {k}", lambda c, x: x + c["k"], _k(1, 20), _ints(-10, 40)),
    F("sub_k", "int", ("sub_{k}", "minus_{k}", "subtract_{k}"), "{x} minus {k}",
      "return {x} - {k}", lambda c, x: x - c["k"], _k(1, 20), _ints(-10, 40)),
    F("mul_k", "int", ("times_{k}", "mul_{k}", "multiply_by_{k}"), "{x} times {k}",
      "return {x} * {k}", lambda c, x: x * c["k"], _k(2, 12), _ints(-10, 30)),
    F("k_minus", "int", ("from_{k}", "rsub_{k}", "take_from_{k}"), "{k} minus {x}",
      "return {k} - {x}", lambda c, x: c["k"] - x, _k(5, 50), _ints(-10, 40)),
    F("square", "int", ("square", "sq", "square_num", "squared"), "{x} squared",
      "return {x} * {x}", lambda c, x: x * x, inputs=_ints(-12, 20)),
    F("cube", "int", ("cube", "cubed", "cube_num"), "the cube of {x}",
      "return {x} * {x} * {x}", lambda c, x: x * x * x, inputs=_ints(-6, 9)),
    F("linear", "int", ("lin_{j}_{k}", "affine_{j}_{k}", "f_{j}_{k}"), "{x} times {j} plus {k}",
      "return {x} * {j} + {k}", lambda c, x: x * c["j"] + c["k"],
      lambda r: {"j": r.randint(2, 9), "k": r.randint(1, 20)}, _ints(-10, 20)),
    F("mod_k", "int", ("mod_{k}", "rem_{k}", "remainder_{k}"),
      "the remainder of {x} divided by {k}", "return {x} % {k}",
      lambda c, x: x % c["k"], _k(2, 9), _ints(0, 60)),
    F("div_k", "int", ("div_{k}", "floor_div_{k}", "divide_{k}"),
      "{x} divided by {k}, rounded down", "return {x} // {k}",
      lambda c, x: x // c["k"], _k(2, 9), _ints(0, 90)),
    F("double", "int", ("double", "twice", "doubled"), "{x} times 2",
      "return {x} * 2", lambda c, x: x * 2, inputs=_ints(-20, 50)),
    F("half_floor", "int", ("half", "halve", "half_down"), "{x} divided by 2, rounded down",
      "return {x} // 2", lambda c, x: x // 2, inputs=_ints(0, 99)),
    # arithmetic on two arguments
    F("add2", "int2", ("add", "add_two", "sum_two", "plus"), "the sum of {a} and {b}",
      "return {a} + {b}", lambda c, a, b: a + b, inputs=_int2(-10, 50)),
    F("mul2", "int2", ("mul", "product", "times", "multiply"), "the product of {a} and {b}",
      "return {a} * {b}", lambda c, a, b: a * b, inputs=_int2(-9, 20)),
    F("sub2", "int2", ("diff", "subtract", "minus"), "{a} minus {b}",
      "return {a} - {b}", lambda c, a, b: a - b, inputs=_int2(-10, 50)),
    F("avg2_floor", "int2", ("mean_floor", "avg_down", "midpoint"),
      "the sum of {a} and {b} divided by 2, rounded down", "return ({a} + {b}) // 2",
      lambda c, a, b: (a + b) // 2, inputs=_int2(0, 60)),
    # strings
    F("reverse", "str", ("reverse", "rev", "reverse_str", "flip"), "the string {x} reversed",
      "return {x}[::-1]", lambda c, s: s[::-1], inputs=lambda r, c: (_word(r),)),
    F("upper", "str", ("upper", "to_upper", "shout", "caps"), "{x} in upper case",
      "return {x}.upper()", lambda c, s: s.upper(), inputs=lambda r, c: (_word(r),)),
    F("lower", "str", ("lower", "to_lower", "quiet", "small"), "{x} in lower case",
      "return {x}.lower()", lambda c, s: s.lower(), inputs=lambda r, c: _mixed_case(r)),
    F("count_char", "str", ("count_{c}", "num_{c}", "how_many_{c}"),
      "the number of times '{c}' appears in {x}", "return {x}.count('{c}')",
      lambda c, s: s.count(c["c"]), _letter, _count_input),
    F("concat", "str2", ("concat", "join_two", "glue", "combine"),
      "{a} and {b} joined together", "return {a} + {b}",
      lambda c, a, b: a + b, inputs=_word_pair),
    F("concat_space", "str2", ("join_space", "with_space", "pair_words"),
      "{a} and {b} joined with a space between them", "return {a} + ' ' + {b}",
      lambda c, a, b: a + " " + b, inputs=_word_pair),
    F("suffix", "str", ("add_suffix", "with_suffix", "suffixed", "append_end"),
      "{x} followed by '{suf}'", "return {x} + '{suf}'",
      lambda c, s: s + c["suf"], lambda r: {"suf": r.choice(_SUFFIXES)},
      lambda r, c: (_word(r),)),
    F("first_char", "str", ("first_char", "head_char", "initial", "first_letter"),
      "the first character of {x}", "return {x}[0]", lambda c, s: s[0],
      inputs=lambda r, c: (_word(r),)),
    F("last_char", "str", ("last_char", "end_char", "final_letter", "last_letter"),
      "the last character of {x}", "return {x}[-1]", lambda c, s: s[-1],
      inputs=lambda r, c: (_word(r),)),
    F("str_len", "str", ("str_len", "length", "size", "count_chars"),
      "the length of {x}", "return len({x})", lambda c, s: len(s),
      inputs=lambda r, c: (_word(r),)),
    F("repeat", "str", ("repeat_{k}", "times_str_{k}", "copies_{k}"),
      "{x} repeated {k} times", "return {x} * {k}", lambda c, s: s * c["k"],
      _k(2, 4), lambda r, c: (_word(r),)),
    F("starts_with", "str", ("starts_with_{c}", "begins_{c}", "starts_{c}"),
      "True if {x} starts with '{c}', else False", "return {x}.startswith('{c}')",
      lambda c, s: s.startswith(c["c"]), lambda r: {"c": _word(r)[0]}, _starts_input,
      _both_bools),
    F("first_two", "str", ("first_two", "prefix2", "head2"),
      "the first two characters of {x}", "return {x}[:2]", lambda c, s: s[:2],
      inputs=lambda r, c: (_word(r),)),
    # lists
    F("list_sum", "list", ("list_sum", "total", "sum_list", "add_all"),
      "the sum of the numbers in {x}", "return sum({x})", lambda c, xs: sum(xs),
      inputs=_list(0, 20, 0, 5)),
    F("list_max", "list", ("list_max", "largest", "biggest", "max_item"),
      "the largest number in {x}", "return max({x})", lambda c, xs: max(xs),
      inputs=_list(-5, 30)),
    F("list_min", "list", ("list_min", "smallest", "least", "min_item"),
      "the smallest number in {x}", "return min({x})", lambda c, xs: min(xs),
      inputs=_list(-5, 30)),
    F("evens", "list", ("evens", "keep_even", "only_even", "even_items"),
      "a list of the even numbers in {x}", "return [{v} for {v} in {x} if {v} % 2 == 0]",
      lambda c, xs: [v for v in xs if v % 2 == 0], inputs=_list(0, 20, 1, 5)),
    F("odds", "list", ("odds", "keep_odd", "only_odd", "odd_items"),
      "a list of the odd numbers in {x}", "return [{v} for {v} in {x} if {v} % 2 == 1]",
      lambda c, xs: [v for v in xs if v % 2 == 1], inputs=_list(0, 20, 1, 5)),
    F("list_len", "list", ("count_items", "list_len", "num_items", "how_many"),
      "the number of items in {x}", "return len({x})", lambda c, xs: len(xs),
      inputs=_list(0, 9, 0, 6)),
    F("first", "list", ("first", "head", "first_item", "front"),
      "the first element of {x}", "return {x}[0]", lambda c, xs: xs[0],
      inputs=_list(0, 30)),
    F("last", "list", ("last", "last_item", "back", "final_item"),
      "the last element of {x}", "return {x}[-1]", lambda c, xs: xs[-1],
      inputs=_list(0, 30)),
    F("add_each", "list", ("add_{k}_each", "shift_{k}", "bump_{k}"),
      "a list with {k} added to each number in {x}", "return [{v} + {k} for {v} in {x}]",
      lambda c, xs: [v + c["k"] for v in xs], _k(1, 10), _list(0, 20, 0, 4)),
    F("double_each", "list", ("double_each", "doubled_list", "twice_each"),
      "a list with each number in {x} doubled", "return [{v} * 2 for {v} in {x}]",
      lambda c, xs: [v * 2 for v in xs], inputs=_list(-5, 20, 0, 4)),
    F("count_gt", "list", ("count_over_{k}", "num_above_{k}", "count_gt_{k}"),
      "how many numbers in {x} are greater than {k}",
      "return len([{v} for {v} in {x} if {v} > {k}])",
      lambda c, xs: len([v for v in xs if v > c["k"]]), _k(3, 15), _list(0, 20, 1, 5)),
    F("sort_list", "list", ("sort_list", "sorted_copy", "in_order"),
      "{x} sorted in increasing order", "return sorted({x})", lambda c, xs: sorted(xs),
      inputs=_list(0, 30, 2, 5)),
    F("reverse_list", "list", ("reverse_list", "rev_list", "backwards"),
      "{x} in reverse order", "return {x}[::-1]", lambda c, xs: xs[::-1],
      inputs=_list(0, 30, 1, 5)),
    # conditionals
    F("max2", "int2", ("max_of", "bigger", "max_two", "larger"), "the larger of {a} and {b}",
      "if {a} > {b}:\n        return {a}\n    return {b}", lambda c, a, b: max(a, b),
      inputs=_int2(-10, 40), cover=_both_orders),
    F("min2", "int2", ("min_of", "smaller", "min_two", "lesser"), "the smaller of {a} and {b}",
      "if {a} < {b}:\n        return {a}\n    return {b}", lambda c, a, b: min(a, b),
      inputs=_int2(-10, 40), cover=_both_orders),
    F("absval", "int", ("absolute", "abs_val", "my_abs", "magnitude"),
      "the absolute value of {x}", "if {x} < 0:\n        return -{x}\n    return {x}",
      lambda c, x: abs(x), inputs=_ints(-30, 30), cover=_both_signs),
    F("is_even", "int", ("is_even", "even", "check_even"), "True if {x} is even, else False",
      "return {x} % 2 == 0", lambda c, x: x % 2 == 0, inputs=_ints(0, 60), cover=_both_bools),
    F("is_odd", "int", ("is_odd", "odd", "check_odd"), "True if {x} is odd, else False",
      "return {x} % 2 == 1", lambda c, x: x % 2 == 1, inputs=_ints(0, 60), cover=_both_bools),
    F("is_positive", "int", ("is_positive", "positive", "above_zero"),
      "True if {x} is greater than 0, else False", "return {x} > 0",
      lambda c, x: x > 0, inputs=_ints(-20, 20), cover=_both_bools),
    F("divisible", "int", ("div_by_{k}", "is_mult_of_{k}", "divides_{k}"),
      "True if {x} is divisible by {k}, else False", "return {x} % {k} == 0",
      lambda c, x: x % c["k"] == 0, _k(2, 9),
      lambda r, c: (c["k"] * r.randint(0, 9) + (0 if r.random() < 0.5 else r.randint(1, c["k"] - 1)),),
      _both_bools),
    F("clamp", "int", ("cap_{k}", "clamp_{k}", "at_most_{k}"), "{x}, but at most {k}",
      "if {x} > {k}:\n        return {k}\n    return {x}", lambda c, x: min(x, c["k"]),
      _k(5, 30), _ints(0, 40), _both_sides),
    F("equal2", "int2", ("same", "equal", "is_equal"), "True if {a} equals {b}, else False",
      "return {a} == {b}", lambda c, a, b: a == b,
      inputs=lambda r, c: (lambda v: (v, v if r.random() < 0.5 else r.randint(0, 9)))(r.randint(0, 9)),
      cover=_both_bools),
)
del F


# Equivalent bodies a training answer may use instead of the family's reference
# ``body`` (same placeholders; ``{v}`` is the loop variable).  Real code has many
# right ways to write a function, and that is what makes parallel decoding lose
# on MBPP-like tasks: positions that agree with each other only within one way
# of writing it (operand order in ``a + b`` / ``b + a``, the loop variable used
# twice in a comprehension, an ``if`` statement against a conditional
# expression) are independent guesses when committed in the same model call.
# The held-out file and the few-shot examples keep the reference body; training
# problems draw one of ``(body,) + ALTERNATIVES[key]`` and a loop variable
# uniformly, from a separate random stream (so the reference stream, and with it
# the held-out file, is unchanged).  Every alternative must pass the same
# asserts as the reference (tests/test_tasks.py checks each one).
ALTERNATIVES: dict[str, tuple[str, ...]] = {
    "add_k": ("return {k} + {x}",),
    "mul_k": ("return {k} * {x}",),
    "square": ("return {x} ** 2",),
    "cube": ("return {x} ** 3",),
    "linear": ("return {j} * {x} + {k}", "return {k} + {x} * {j}"),
    "double": ("return 2 * {x}", "return {x} + {x}"),
    "add2": ("return {b} + {a}",),
    "mul2": ("return {b} * {a}",),
    "avg2_floor": ("return ({b} + {a}) // 2",),
    "reverse": ("return ''.join(reversed({x}))",),
    "concat_space": ("return ' '.join([{a}, {b}])",),
    "first_char": ("return {x}[:1]",),
    "last_char": ("return {x}[len({x}) - 1]",),
    "repeat": ("return {k} * {x}",),
    "starts_with": ("return {x}[:1] == '{c}'",),
    "evens": ("return list(filter(lambda {v}: {v} % 2 == 0, {x}))",),
    "odds": ("return list(filter(lambda {v}: {v} % 2 == 1, {x}))",),
    "last": ("return {x}[len({x}) - 1]",),
    "add_each": ("return [{k} + {v} for {v} in {x}]", "return list(map(lambda {v}: {v} + {k}, {x}))"),
    "double_each": ("return [2 * {v} for {v} in {x}]", "return [{v} + {v} for {v} in {x}]"),
    "count_gt": ("return sum(1 for {v} in {x} if {v} > {k})",),
    "reverse_list": ("return list(reversed({x}))",),
    "max2": ("return {a} if {a} > {b} else {b}", "return max({a}, {b})"),
    "min2": ("return {a} if {a} < {b} else {b}", "return min({a}, {b})"),
    "absval": ("return -{x} if {x} < 0 else {x}", "return abs({x})"),
    "is_positive": ("return 0 < {x}",),
    "clamp": ("return {k} if {x} > {k} else {x}", "return min({x}, {k})"),
    "equal2": ("return {b} == {a}",),
}
_LOOP_VARS = ("v", "x", "e", "n", "i", "item", "num", "val")
REFERENCE_LOOP_VAR = "v"


def _arg_names(r: Rng, kind: str) -> tuple[str, ...]:
    if kind == "int":
        return (r.choice(_INT_ARGS),)
    if kind == "int2":
        return r.choice(_INT2_ARGS)
    if kind == "str":
        return (r.choice(_STR_ARGS),)
    if kind == "str2":
        return r.choice(_STR2_ARGS)
    if kind == "list":
        return (r.choice(_LIST_ARGS),)
    raise ValueError(kind)


def _make_one(r: Rng, vr: Rng | None = None) -> dict:
    """One problem from ``r``.  With ``vr`` (training), the answer uses a body
    and loop variable drawn from ``vr`` (see ``ALTERNATIVES``) and the record
    also holds the reference answer (``reference``) and the body index
    (``variant``, 0 = reference); without it the answer is the reference."""
    for _ in range(1000):
        fam = r.choice(FAMILIES)
        consts = fam.consts(r)
        fname = r.choice(fam.names).format(**consts)
        args = _arg_names(r, fam.kind)
        names = {"x": args[0], "a": args[0], "b": args[-1]}
        desc = fam.desc.format(**names, **consts)
        sig = f"{fname}({', '.join(args)})"
        prompt = r.choice(_PHRASES).format(sig=sig, desc=desc)

        def function(body: str, loop_var: str) -> str:
            return f"def {sig}:\n    " + body.format(**names, **consts, v=loop_var)

        reference = function(fam.body, REFERENCE_LOOP_VAR)
        answer, variant = reference, 0
        if vr is not None:
            bodies = (fam.body,) + ALTERNATIVES.get(fam.key, ())
            variant = vr.randint(0, len(bodies) - 1)
            answer = function(bodies[variant], vr.choice([v for v in _LOOP_VARS if v not in args]))

        cases = None
        for _try in range(200):
            ins = [fam.inputs(r, consts) for _ in range(3)]
            if len({repr(i) for i in ins}) < 3:
                continue
            outs = [fam.impl(consts, *i) for i in ins]
            cs = list(zip(ins, outs))
            if len({repr(o) for o in outs}) < 2:
                continue
            if fam.cover is not None and not fam.cover(cs, consts):
                continue
            cases = cs
            break
        if cases is None:
            continue
        tests = [f"assert {fname}({', '.join(repr(a) for a in i)}) == {o!r}" for i, o in cases]
        if (len(prompt) <= MAX_PROMPT_CHARS and len(reference) <= MAX_ANSWER_CHARS
                and prompt.isascii() and reference.isascii()
                and all(t.isascii() for t in tests)):
            if len(answer) > MAX_ANSWER_CHARS:
                answer, variant = reference, 0
            rec = {"prompt": prompt, "answer": answer,
                   "target": {"entry_point": fname, "tests": tests},
                   "family": fam.key}
            if vr is not None:
                rec.update(reference=reference, variant=variant)
            return rec
    raise RuntimeError("code generator failed to produce a valid problem")  # pragma: no cover


def _stream(seed: int, stream: str, variants: bool = False):
    r = Rng(seed, f"code/{stream}")
    vr = Rng(seed, f"code/{stream}/variants") if variants else None
    while True:
        yield _make_one(r, vr)


def _code_key(answer: str) -> str:
    return " ".join(answer.split())


def generate(n: int, seed: int) -> list[dict]:
    """``n`` problems with distinct normalised prompts and distinct reference
    functions, deterministic in ``seed``."""
    out, seen_p, seen_a = [], set(), set()
    for rec in _stream(seed, "eval"):
        if len(out) >= n:
            break
        kp, ka = normalize_prompt(rec["prompt"]), _code_key(rec["answer"])
        if kp in seen_p or ka in seen_a:
            continue
        seen_p.add(kp)
        seen_a.add(ka)
        out.append({"id": f"code-{seed}-{len(out):05d}", **rec})
    return out


def heldout_keys(path: str | Path | None = None) -> tuple[set[str], set[str]]:
    """(normalised prompts, whitespace-normalised reference functions) of the
    held-out file."""
    probs = read_jsonl(path or TEST_FILE)
    return ({normalize_prompt(p["prompt"]) for p in probs},
            {_code_key(p["answer"]) for p in probs})


def generate_train(n: int, seed: int, exclude_path: str | Path | None = None,
                   variants: bool = True) -> list[dict]:
    """``n`` training problems disjoint from the held-out file: a problem is
    skipped if its normalised prompt *or* its reference function (same name,
    arguments and body, whatever the phrasing) occurs there.  Duplicates
    within the training set are allowed.

    With ``variants`` (the default) each answer is one of the family's
    equivalent bodies with a random loop variable (``ALTERNATIVES``); the
    record's ``reference`` holds the reference answer.  ``variants=False``
    gives reference answers only (the few-shot examples use it)."""
    bad_p, bad_a = heldout_keys(exclude_path)
    out = []
    for rec in _stream(seed, "train", variants):
        if len(out) >= n:
            break
        functions = {rec["answer"], rec.get("reference", rec["answer"])}
        if normalize_prompt(rec["prompt"]) in bad_p or any(_code_key(f) in bad_a for f in functions):
            continue
        out.append({"id": f"code-train-{seed}-{len(out):07d}", **rec})
    return out


def load(path: str | Path | None = None, limit: int | None = None) -> list[dict]:
    """The held-out problems (``bench/data/code_test.jsonl`` by default)."""
    probs = read_jsonl(path or TEST_FILE)
    return probs[:limit] if limit is not None else probs


def few_shot(k: int = 3, path: str | Path | None = None, heldout: str | Path | None = None) -> list[dict]:
    """``k`` examples: the first ``k`` of ``path``, a file in the held-out file's format
    (``--few-shot-data``), else fixed generated ones disjoint from ``heldout`` (the evaluated
    file; default the held-out file).  bench.eval refuses a shot that is an evaluated problem."""
    if k <= 0:
        return []
    if path is not None:
        return read_examples(path, k)
    return generate_train(k, FEW_SHOT_SEED, heldout, variants=False)


# --------------------------------------------------------------------------
# prompt + checker


def format_prompt(problem: dict, few_shot: Iterable[dict] = ()) -> str:
    """``Question: <prompt>\\nAnswer:\\n`` preceded by any few-shot pairs."""
    return qa_prompt(problem["prompt"], ANSWER_SEP, few_shot)


def build_program(completion: str, problem: dict) -> str | None:
    """The program the sandbox runs for ``completion``, or None if no
    function definition can be extracted."""
    target = problem["target"]
    return assemble_program(extract_code(completion, target["entry_point"]), target["tests"])


score, score_batch, check = code_suite(build_program, FIELDS, TIMEOUT_S)
