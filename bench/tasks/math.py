"""GSM8K-like suite: seeded multi-step arithmetic word problems.

Every problem takes 2-4 steps of +, -, *, or an exact integer /; all numbers
in the story and every intermediate result are integers in 0..999.  The
reference answer writes each step as an equation and ends with ``#### N``::

    prompt: "Tom has 12 apples. He buys 5 more and gives 3 to Ann. How many
             apples does Tom have now?"
    answer: "Tom has 12 + 5 = 17 apples. Then 17 - 3 = 14. #### 14"

Hard limits (checked on every generated problem): prompt <= 220 characters,
answer <= 110 characters, plain ASCII.

Prompt format (``format_prompt``)::

    Question: <prompt>\\nAnswer: <answer>

i.e. the model is given ``"Question: ...\\nAnswer: "`` (note the trailing
space) and should complete it with the answer; few-shot examples are full
question/answer pairs separated by a blank line.  The training text for a
problem is exactly ``format_prompt(p) + p["answer"]``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Iterable, Sequence

from .common import (DATA_DIR, ID, NUMBER, STR, Rng, check_fields, extract_answer_number, normalize_prompt,
                     numbers_equal, qa_prompt, read_examples, read_jsonl)

NAME = "math"
TEST_SEED = 1001
TEST_N = 300
TEST_FILE = DATA_DIR / "math_test.jsonl"
FEW_SHOT_SEED = 7
MAX_PROMPT_CHARS = 220
MAX_ANSWER_CHARS = 110
ANSWER_SEP = " "  # between "Answer:" and the answer text
# Where a decoder may cut a completion: reference answers are one line, so
# everything after the first newline is junk (the checker ignores it anyway).
STOP_SEQUENCES = ("\n",)
FIELDS = {"id": ID, "prompt": STR, "target": NUMBER}   # what a problem needs (checked before decoding)

# --------------------------------------------------------------------------
# vocabulary

_PEOPLE = [
    ("Tom", "He"), ("Ann", "She"), ("Sam", "He"), ("Mia", "She"), ("Ben", "He"),
    ("Lily", "She"), ("Max", "He"), ("Emma", "She"), ("Leo", "He"), ("Zoe", "She"),
    ("Jack", "He"), ("Nina", "She"), ("Omar", "He"), ("Rosa", "She"), ("Ivan", "He"),
    ("Lucy", "She"), ("Raj", "He"), ("Kate", "She"), ("Noah", "He"), ("Sara", "She"),
    ("Eli", "He"), ("Ava", "She"), ("Dan", "He"), ("Maya", "She"), ("Paul", "He"),
    ("Jane", "She"), ("Carl", "He"), ("Ella", "She"), ("Hugo", "He"), ("Iris", "She"),
]
_THINGS = [
    "apples", "marbles", "stickers", "pencils", "cards", "books", "shells",
    "stamps", "candies", "toys", "beads", "balloons", "cookies", "oranges",
    "crayons", "coins", "buttons", "rocks", "lemons", "blocks", "pens", "eggs",
]
_ITEMS = [  # (singular, plural) for shopping stories
    ("toy", "toys"), ("book", "books"), ("pen", "pens"), ("cup", "cups"),
    ("hat", "hats"), ("ball", "balls"), ("kite", "kites"), ("card", "cards"),
    ("mug", "mugs"), ("lamp", "lamps"), ("bag", "bags"), ("cake", "cakes"),
]
_PLANTS = [("tomato plants", "tomatoes"), ("pepper plants", "peppers"),
           ("apple trees", "apples"), ("bean plants", "beans"),
           ("lemon trees", "lemons"), ("melon plants", "melons")]
_BAKED = ["cookies", "muffins", "rolls", "buns", "cupcakes", "pies"]
_BILLS = [10, 20, 50, 100]


class _Person:
    def __init__(self, name: str, pron: str) -> None:
        self.name, self.He = name, pron
        self.he = pron.lower()
        self.his = "his" if pron == "He" else "her"


def _people(r: Rng, k: int) -> list[_Person]:
    return [_Person(n, p) for n, p in r.sample(_PEOPLE, k)]


def _ok(*vals: int) -> bool:
    return all(0 <= v <= 999 for v in vals)


# --------------------------------------------------------------------------
# templates: each returns (prompt, [step sentences], result) or None (retry)

Problem = tuple[str, list[str], int]


def _t_buy_give(r: Rng):
    a, b = _people(r, 2)
    obj = r.choice(_THINGS)
    x, y = r.randint(5, 60), r.randint(2, 40)
    s1 = x + y
    z = r.randint(1, s1)
    s2 = s1 - z
    q = (f"{a.name} has {x} {obj}. {a.He} buys {y} more and gives {z} to {b.name}. "
         f"How many {obj} does {a.name} have now?")
    return q, [f"{a.name} has {x} + {y} = {s1} {obj}.", f"Then {s1} - {z} = {s2}."], s2


def _t_boxes_give(r: Rng):
    (a,) = _people(r, 1)
    obj = r.choice(_THINGS)
    x, y = r.randint(2, 12), r.randint(2, 12)
    s1 = x * y
    z = r.randint(1, s1 - 1)
    s2 = s1 - z
    q = (f"{a.name} has {x} boxes of {obj}. Each box holds {y} {obj}. "
         f"{a.He} gives away {z} {obj}. How many {obj} are left?")
    return q, [f"{x} * {y} = {s1} {obj}.", f"Then {s1} - {z} = {s2}."], s2


def _t_share(r: Rng):
    (a,) = _people(r, 1)
    obj = r.choice(_THINGS)
    x, y = r.randint(2, 12), r.randint(2, 12)
    s1 = x * y
    divs = [d for d in range(2, 10) if s1 % d == 0]
    if not divs:
        return None
    d = r.choice(divs)
    s2 = s1 // d
    q = (f"{a.name} has {x} bags with {y} {obj} in each bag. {a.He} shares them "
         f"equally among {d} friends. How many {obj} does each friend get?")
    return q, [f"{x} * {y} = {s1} {obj}.", f"Each friend gets {s1} / {d} = {s2}."], s2


def _t_wage(r: Rng):
    (a,) = _people(r, 1)
    _, item = r.choice(_ITEMS)
    x, y = r.randint(5, 25), r.randint(2, 9)
    s1 = x * y
    z = r.randint(1, s1)
    s2 = s1 - z
    q = (f"{a.name} earns ${x} per hour. {a.He} works {y} hours and spends ${z} on "
         f"{item}. How many dollars does {a.name} have left?")
    return q, [f"{a.name} earns {x} * {y} = {s1} dollars.", f"Then {s1} - {z} = {s2}."], s2


def _t_reading(r: Rng):
    (a,) = _people(r, 1)
    x, y = r.randint(5, 40), r.randint(2, 9)
    s1 = x * y
    total = r.randint(s1, min(999, s1 + 200))
    s2 = total - s1
    q = (f"A book has {total} pages. {a.name} reads {x} pages a day for {y} days. "
         f"How many pages are left to read?")
    return q, [f"{a.name} reads {x} * {y} = {s1} pages.", f"Then {total} - {s1} = {s2}."], s2


def _t_days_times(r: Rng):
    (a,) = _people(r, 1)
    obj = r.choice(_THINGS)
    x, y, k = r.randint(2, 40), r.randint(2, 40), r.randint(2, 5)
    s1 = x + y
    s2 = s1 * k
    if not _ok(s2):
        return None
    q = (f"{a.name} collects {x} {obj} on Monday and {y} on Tuesday. On Wednesday "
         f"{a.he} collects {k} times as many as on both days together. How many "
         f"{obj} does {a.he} collect on Wednesday?")
    return q, [f"{x} + {y} = {s1}.", f"Then {s1} * {k} = {s2}."], s2


def _t_chairs(r: Rng):
    x, y = r.randint(3, 15), r.randint(4, 20)
    s1 = x * y
    if not _ok(s1):
        return None
    z = r.randint(1, s1 - 1)
    w = r.randint(1, 40)
    s2 = s1 - z
    s3 = s2 + w
    if not _ok(s3):
        return None
    q = (f"A hall has {x} rows of {y} chairs. Workers remove {z} chairs and then add "
         f"{w} chairs. How many chairs are in the hall now?")
    return q, [f"{x} * {y} = {s1} chairs.", f"{s1} - {z} = {s2}.", f"{s2} + {w} = {s3}."], s3


def _t_together(r: Rng):
    a, b = _people(r, 2)
    obj = r.choice(_THINGS)
    x, y = r.randint(3, 80), r.randint(2, 50)
    s1 = x + y
    s2 = x + s1
    q = (f"{a.name} has {x} {obj}. {b.name} has {y} more {obj} than {a.name}. "
         f"How many {obj} do they have in total?")
    return q, [f"{b.name} has {x} + {y} = {s1} {obj}.", f"Together {x} + {s1} = {s2}."], s2


def _t_change(r: Rng):
    (a,) = _people(r, 1)
    _, items = r.choice(_ITEMS)
    price, n = r.randint(2, 15), r.randint(2, 6)
    s1 = price * n
    bills = [b for b in _BILLS if b >= s1]
    if not bills:
        return None
    bill = r.choice(bills)
    s2 = bill - s1
    q = (f"{a.name} buys {n} {items} that cost ${price} each. {a.He} pays with a "
         f"${bill} bill. How much change does {a.he} get in dollars?")
    return q, [f"{n} * {price} = {s1} dollars.", f"Change is {bill} - {s1} = {s2}."], s2


def _t_bake_pack(r: Rng):
    (a,) = _people(r, 1)
    food = r.choice(_BAKED)
    x, y = r.randint(2, 6), r.randint(4, 12)
    s1 = x * y
    d = r.randint(2, 6)
    # choose how many are sold so that the rest divides evenly into boxes
    base = s1 % d
    choices = [c for c in range(base, s1, d) if c >= 1]
    if not choices:
        return None
    c = r.choice(choices)
    s2 = s1 - c
    s3 = s2 // d
    if s3 < 1:
        return None
    q = (f"{a.name} bakes {x} trays of {y} {food}. {a.He} sells {c} {food} and packs "
         f"the rest into boxes of {d}. How many boxes does {a.he} fill?")
    return q, [f"{x} * {y} = {s1} {food}.", f"{s1} - {c} = {s2}.", f"{s2} / {d} = {s3}."], s3


def _t_garden(r: Rng):
    (a,) = _people(r, 1)
    plants, fruit = r.choice(_PLANTS)
    x, y = r.randint(2, 6), r.randint(2, 8)
    s1 = x * y
    c = r.randint(1, s1 - 1)
    s2 = s1 - c
    d = r.randint(2, 9)
    s3 = s2 * d
    if not _ok(s3):
        return None
    q = (f"{a.name} plants {x} rows of {y} {plants}. {c} of them die. Each one left "
         f"gives {d} {fruit}. How many {fruit} does {a.name} get?")
    return q, [f"{x} * {y} = {s1}.", f"{s1} - {c} = {s2}.", f"{s2} * {d} = {s3}."], s3


def _t_savings(r: Rng):
    (a,) = _people(r, 1)
    item, _ = r.choice(_ITEMS)
    x, y = r.randint(3, 30), r.randint(2, 10)
    s1 = x * y
    z = r.randint(1, s1)
    s2 = s1 - z
    q = (f"{a.name} saves ${x} each week for {y} weeks. Then {a.he} buys a {item} for "
         f"${z}. How much money does {a.he} have left?")
    return q, [f"{a.name} saves {x} * {y} = {s1} dollars.", f"Then {s1} - {z} = {s2}."], s2


def _t_times_fewer(r: Rng):
    a, b, c = _people(r, 3)
    obj = r.choice(_THINGS)
    x, k = r.randint(3, 60), r.randint(2, 6)
    s1 = x * k
    if not _ok(s1):
        return None
    z = r.randint(1, s1)
    s2 = s1 - z
    q = (f"{a.name} has {x} {obj}. {b.name} has {k} times as many. {c.name} has {z} "
         f"fewer than {b.name}. How many {obj} does {c.name} have?")
    return q, [f"{b.name} has {x} * {k} = {s1}.", f"{c.name} has {s1} - {z} = {s2}."], s2


def _t_bus(r: Rng):
    x = r.randint(10, 60)
    b = r.randint(1, x)
    s1 = x - b
    c = r.randint(1, 30)
    s2 = s1 + c
    d = r.randint(1, s2)
    s3 = s2 - d
    q = (f"A bus has {x} people. At the first stop {b} get off and {c} get on. At the "
         f"next stop {d} get off. How many people are on the bus now?")
    return q, [f"{x} - {b} = {s1}.", f"{s1} + {c} = {s2}.", f"{s2} - {d} = {s3}."], s3


def _t_running(r: Rng):
    (a,) = _people(r, 1)
    x, y, z = r.randint(2, 15), r.randint(2, 7), r.randint(1, 20)
    s1 = x * y
    s2 = s1 + z
    q = (f"{a.name} runs {x} km every day for {y} days. On the last day {a.he} runs "
         f"{z} km more. How many km does {a.name} run in total?")
    return q, [f"{x} * {y} = {s1} km.", f"{s1} + {z} = {s2}."], s2


def _t_split_add(r: Rng):
    (a,) = _people(r, 1)
    obj = r.choice(_THINGS)
    g, per = r.randint(2, 9), r.randint(2, 20)
    x = g * per
    z = r.randint(1, 15)
    s2 = per + z
    q = (f"{a.name} has {x} {obj} and splits them equally into {g} groups. Then each "
         f"group gets {z} more. How many {obj} are in each group?")
    return q, [f"{x} / {g} = {per}.", f"{per} + {z} = {s2}."], s2


def _t_half(r: Rng):
    a, b = _people(r, 2)
    obj = r.choice(_THINGS)
    x = 2 * r.randint(3, 50)
    s1 = x // 2
    s2 = x - s1
    y = r.randint(1, 30)
    s3 = s2 + y
    q = (f"{a.name} has {x} {obj}. {a.He} gives half of them to {b.name} and then "
         f"buys {y} more. How many {obj} does {a.name} have now?")
    return q, [f"{x} / 2 = {s1}.", f"{x} - {s1} = {s2}.", f"{s2} + {y} = {s3}."], s3


def _t_recipe(r: Rng):
    (a,) = _people(r, 1)
    x, y = r.randint(2, 6), r.randint(2, 9)
    s1 = x * y
    z = r.randint(2, s1 - 1)
    s2 = s1 - z
    q = (f"One cake needs {x} eggs. {a.name} wants to bake {y} cakes and has {z} eggs. "
         f"How many more eggs does {a.he} need?")
    return q, [f"{y} * {x} = {s1} eggs.", f"{s1} - {z} = {s2}."], s2


def _t_third(r: Rng):
    a, b = _people(r, 2)
    obj = r.choice(_THINGS)
    x = 3 * r.randint(2, 40)
    s1 = x // 3
    s2 = x - s1
    q = (f"{a.name} has {x} {obj}. {a.He} gives a third of them to {b.name}. "
         f"How many {obj} does {a.name} have left?")
    return q, [f"{x} / 3 = {s1}.", f"{x} - {s1} = {s2}."], s2


def _t_ages(r: Rng):
    a, b = _people(r, 2)
    x, y, z = r.randint(3, 50), r.randint(1, 30), r.randint(1, 20)
    s1 = x + y
    s2 = s1 + z
    q = (f"{a.name} is {x} years old. {b.name} is {y} years older than {a.name}. "
         f"How old will {b.name} be in {z} years?")
    return q, [f"{b.name} is {x} + {y} = {s1}.", f"In {z} years {s1} + {z} = {s2}."], s2


def _t_two_packs(r: Rng):
    (a,) = _people(r, 1)
    x, y, u, v = r.randint(2, 6), r.randint(3, 12), r.randint(2, 6), r.randint(3, 12)
    s1, s2 = x * y, u * v
    s3 = s1 + s2
    e = r.randint(1, s3 - 1)
    s4 = s3 - e
    q = (f"{a.name} buys {x} packs of {y} pens and {u} packs of {v} pencils. {a.He} "
         f"gives away {e} of them. How many pens and pencils are left?")
    return q, [f"{x} * {y} = {s1}.", f"{u} * {v} = {s2}.", f"{s1} + {s2} = {s3}.",
               f"{s3} - {e} = {s4}."], s4


def _t_shop(r: Rng):
    obj = r.choice(_THINGS)
    x = r.randint(30, 200)
    b = r.randint(1, x // 2)
    s1 = x - b
    c = r.randint(1, s1)
    s2 = s1 - c
    d, e = r.randint(2, 8), r.randint(5, 20)
    s3 = d * e
    s4 = s2 + s3
    if not _ok(s4):
        return None
    q = (f"A shop has {x} {obj}. It sells {b} in the morning and {c} in the afternoon. "
         f"Then it gets {d} boxes with {e} {obj} each. How many {obj} does it have now?")
    return q, [f"{x} - {b} = {s1}.", f"{s1} - {c} = {s2}.", f"{d} * {e} = {s3}.",
               f"{s2} + {s3} = {s4}."], s4


def _t_cost_total(r: Rng):
    (a,) = _people(r, 1)
    (i1, p1), (i2, p2) = r.sample(_ITEMS, 2)
    x, y, u, v = r.randint(2, 9), r.randint(2, 20), r.randint(2, 9), r.randint(2, 20)
    s1, s2 = x * y, u * v
    s3 = s1 + s2
    q = (f"{a.name} buys {x} {p1} at ${y} each and {u} {p2} at ${v} each. "
         f"How many dollars does {a.he} spend?")
    return q, [f"{x} * {y} = {s1}.", f"{u} * {v} = {s2}.", f"{s1} + {s2} = {s3}."], s3


def _t_trip(r: Rng):
    x, y, u, v = r.randint(20, 90), r.randint(2, 5), r.randint(20, 90), r.randint(1, 4)
    s1, s2 = x * y, u * v
    s3 = s1 + s2
    if not _ok(s3):
        return None
    q = (f"A car drives {x} km each hour for {y} hours, then {u} km each hour for {v} "
         f"hours. How many km does it drive in total?")
    return q, [f"{x} * {y} = {s1} km.", f"{u} * {v} = {s2} km.", f"{s1} + {s2} = {s3}."], s3


def _t_class_groups(r: Rng):
    x, y = r.randint(15, 30), r.randint(2, 6)
    s1 = x * y
    d = r.randint(2, 6)
    base = s1 % d
    choices = [c for c in range(base, min(s1, 40), d) if c >= 1]
    if not choices:
        return None
    c = r.choice(choices)
    s2 = s1 - c
    s3 = s2 // d
    q = (f"There are {x} students in each of {y} classes. {c} students are absent. The "
         f"rest work in groups of {d}. How many groups are there?")
    return q, [f"{x} * {y} = {s1}.", f"{s1} - {c} = {s2}.", f"{s2} / {d} = {s3}."], s3


def _t_buy_share_friends(r: Rng):
    (a,) = _people(r, 1)
    obj = r.choice(_THINGS)
    x = r.randint(0, 30)
    p, per = r.randint(2, 6), r.randint(4, 12)
    s1 = p * per
    s2 = x + s1
    k, f = r.randint(1, 5), r.randint(2, 6)
    s3 = k * f
    if s3 > s2:
        return None
    s4 = s2 - s3
    q = (f"{a.name} has {x} {obj}. {a.He} buys {p} packs of {per} {obj} and gives {k} "
         f"{obj} to each of {f} friends. How many {obj} does {a.he} have now?")
    return q, [f"{p} * {per} = {s1}.", f"{x} + {s1} = {s2}.", f"{k} * {f} = {s3}.",
               f"{s2} - {s3} = {s4}."], s4


def _t_weekly_pages(r: Rng):
    (a,) = _people(r, 1)
    x, y, w = r.randint(2, 20), r.randint(5, 40), r.randint(2, 4)
    s1 = x * 5
    s2 = s1 + y
    s3 = s2 * w
    if not _ok(s3):
        return None
    q = (f"{a.name} reads {x} pages each weekday and {y} pages on the weekend. How "
         f"many pages does {a.he} read in {w} weeks?")
    return q, [f"{x} * 5 = {s1}.", f"{s1} + {y} = {s2} a week.", f"{s2} * {w} = {s3}."], s3


def _t_lost_found(r: Rng):
    a, b = _people(r, 2)
    obj = r.choice(_THINGS)
    x = r.randint(10, 80)
    y = r.randint(1, x)
    s1 = x - y
    k = r.randint(2, 4)
    s2 = s1 * k
    if not _ok(s2) or s1 == 0:
        return None
    q = (f"{a.name} had {x} {obj} but lost {y}. {b.name} has {k} times as many {obj} "
         f"as {a.name} has now. How many {obj} does {b.name} have?")
    return q, [f"{a.name} has {x} - {y} = {s1}.", f"{b.name} has {s1} * {k} = {s2}."], s2


TEMPLATES: tuple[Callable[[Rng], Problem | None], ...] = (
    _t_buy_give, _t_boxes_give, _t_share, _t_wage, _t_reading, _t_days_times,
    _t_chairs, _t_together, _t_change, _t_bake_pack, _t_garden, _t_savings,
    _t_times_fewer, _t_bus, _t_running, _t_split_add, _t_half, _t_recipe,
    _t_third, _t_ages, _t_two_packs, _t_shop, _t_cost_total, _t_trip,
    _t_class_groups, _t_buy_share_friends, _t_weekly_pages, _t_lost_found,
)


# --------------------------------------------------------------------------
# generation


def _make_one(r: Rng) -> tuple[str, str, int]:
    for _ in range(1000):
        tpl = r.choice(TEMPLATES)
        out = tpl(r)
        if out is None:
            continue
        prompt, steps, result = out
        answer = " ".join(steps) + f" #### {result}"
        if (len(prompt) <= MAX_PROMPT_CHARS and len(answer) <= MAX_ANSWER_CHARS
                and prompt.isascii() and answer.isascii() and _ok(result)):
            return prompt, answer, result
    raise RuntimeError("math generator failed to produce a valid problem")  # pragma: no cover


def _stream(seed: int, stream: str):
    r = Rng(seed, f"math/{stream}")
    while True:
        yield _make_one(r)


def _record(pid: str, prompt: str, answer: str, result: int) -> dict:
    return {"id": pid, "prompt": prompt, "answer": answer, "target": str(result)}


def generate(n: int, seed: int) -> list[dict]:
    """``n`` distinct problems (distinct normalised prompts), deterministic in ``seed``."""
    out, seen = [], set()
    for prompt, answer, result in _stream(seed, "eval"):
        if len(out) >= n:
            break
        key = normalize_prompt(prompt)
        if key in seen:
            continue
        seen.add(key)
        out.append(_record(f"math-{seed}-{len(out):05d}", prompt, answer, result))
    return out


def heldout_prompts(path: str | Path | None = None) -> set[str]:
    """Normalised prompts of the held-out file (what training must avoid)."""
    return {normalize_prompt(p["prompt"]) for p in read_jsonl(path or TEST_FILE)}


def generate_train(n: int, seed: int, exclude_path: str | Path | None = None) -> list[dict]:
    """``n`` training problems, none of whose normalised prompt is in the
    held-out file (``bench/data/math_test.jsonl`` unless ``exclude_path``).
    Duplicates within the training set are allowed."""
    banned = heldout_prompts(exclude_path)
    out = []
    for prompt, answer, result in _stream(seed, "train"):
        if len(out) >= n:
            break
        if normalize_prompt(prompt) in banned:
            continue
        out.append(_record(f"math-train-{seed}-{len(out):07d}", prompt, answer, result))
    return out


DRILL_MAX_EQUATIONS = 4


def generate_drill(n: int, seed: int, exclude_path: str | Path | None = None) -> list[dict]:
    """``n`` arithmetic drills for training: the ``a op b = c`` steps of fresh training problems
    (so exactly the suite's distribution of operands and operations), pooled, shuffled across
    problems and dealt 3-4 per drill (4 fill a 64-token answer).  The prompt lists the expressions, the answer works them::

        prompt: "Compute: 47 + 38, 96 / 8, 12 * 5."
        answer: "47 + 38 = 85. 96 / 8 = 12. 12 * 5 = 60."

    A worked solution carries 2-4 equations among many copied words; a drill is nearly all
    arithmetic, which is what a small model fails to learn from the word problems alone.
    Deterministic in ``seed``; the source problems avoid the held-out file like
    ``generate_train``."""
    if n <= 0:
        return []
    r = Rng(seed, "math/drill")
    eqs: list[tuple[str, str, str, str]] = []             # (a, op, b, c); the pool covers 4 per drill
    k = 0
    while len(eqs) < DRILL_MAX_EQUATIONS * n:
        for p in generate_train(max(8, n), seed * 31 + k, exclude_path):
            eqs += _EQUATION.findall(p["answer"])
        k += 1
    for j in range(len(eqs) - 1, 0, -1):                    # Fisher-Yates with the suite's own Rng
        t = r.randint(0, j)
        eqs[j], eqs[t] = eqs[t], eqs[j]
    out, i = [], 0
    while len(out) < n:
        m = r.randint(DRILL_MAX_EQUATIONS - 1, DRILL_MAX_EQUATIONS)
        chunk = eqs[i:i + m]
        i += m
        prompt = "Compute: " + ", ".join(f"{a} {op} {b}" for a, op, b, _ in chunk) + "."
        answer = " ".join(f"{a} {op} {b} = {c}." for a, op, b, c in chunk)
        out.append({"id": f"math-drill-{seed}-{len(out):07d}", "prompt": prompt, "answer": answer,
                    "target": chunk[-1][3]})
    return out


def load(path: str | Path | None = None, limit: int | None = None) -> list[dict]:
    """The held-out problems (``bench/data/math_test.jsonl`` by default)."""
    probs = read_jsonl(path or TEST_FILE)
    return probs[:limit] if limit is not None else probs


def few_shot(k: int = 3, path: str | Path | None = None, heldout: str | Path | None = None) -> list[dict]:
    """``k`` worked examples: the first ``k`` of ``path``, a file in the held-out file's format
    (``--few-shot-data``), else fixed generated ones disjoint from ``heldout`` (the evaluated
    file; default the held-out file).  bench.eval refuses a shot that is an evaluated problem."""
    if k <= 0:
        return []
    return read_examples(path, k) if path is not None else generate_train(k, FEW_SHOT_SEED, heldout)


# --------------------------------------------------------------------------
# prompt + checker


def format_prompt(problem: dict, few_shot: Iterable[dict] = ()) -> str:
    """``Question: <prompt>\\nAnswer: `` preceded by any few-shot pairs."""
    return qa_prompt(problem["prompt"], ANSWER_SEP, few_shot)


def score(completion: str, problem: dict) -> bool:
    """GSM8K flexible match: the number after ``####`` if there is one, else
    the last number in the completion; ``,``/``$``/trailing ``.`` stripped;
    compared numerically with ``problem["target"]``."""
    return numbers_equal(extract_answer_number(completion), problem["target"])


def score_batch(completions: Sequence[str], problems: Sequence[dict]) -> list[bool]:
    return [score(c, p) for c, p in zip(completions, problems, strict=True)]


def check(problems: Sequence[dict], source: str) -> None:
    """A one-line ValueError unless every problem has the fields ``FIELDS`` names (bench.eval
    calls it on all rows before decoding anything)."""
    check_fields(problems, FIELDS, source)


_EQUATION = re.compile(r"(-?\d+) ([-+*/]) (-?\d+) = (-?\d+)")


def equation_check(completion: str) -> tuple[int, int]:
    """(correct, total) over the ``a op b = c`` equations the completion writes, each judged on
    its own operands: a diagnostic that separates "cannot do the arithmetic" from "wrong plan"
    (a worked solution can be all-correct arithmetic and still answer the wrong question)."""
    ok = total = 0
    for a, op, b, c in _EQUATION.findall(completion.split("\n", 1)[0]):
        a, b, c = int(a), int(b), int(c)
        total += 1
        if op == "/":
            ok += b != 0 and a == b * c
        else:
            ok += {"+": a + b, "-": a - b, "*": a * b}[op] == c
    return ok, total
