"""bench.code_breakdown: per-method code accuracy split by families with several right answers."""
import json

from bench import code_breakdown as cb
from bench.tasks import code as ct


def _records(tmp_path, verdicts):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps({"id": i, "method": m, "completion": "", "correct": c}) + "\n"
                            for m, i, c in verdicts))
    return path


def test_split_counts_follow_the_families(tmp_path, capsys):
    probs = ct.load()
    several = [p["id"] for p in probs if p["family"] in ct.ALTERNATIVES][:3]
    single = [p["id"] for p in probs if p["family"] not in ct.ALTERNATIVES][:2]
    verdicts = [("greedy", i, True) for i in several + single]
    verdicts += [("topk", several[0], True), ("topk", several[1], False), ("topk", several[2], False),
                 ("topk", single[0], True), ("topk", single[1], True)]
    assert cb.main([str(_records(tmp_path, verdicts))]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    rows = {r["method"]: r for r in json.loads(out[-1])["rows"]}
    assert rows["greedy"]["accuracy"] == 1.0 and rows["greedy"]["several"] == 3 and rows["greedy"]["single"] == 2
    assert rows["topk"]["several_accuracy"] == 1 / 3 and rows["topk"]["single_accuracy"] == 1.0
    assert rows["topk"]["accuracy"] == 3 / 5
    assert "| topk | 5 | 60.0% | 33.3% of 3 | 100.0% of 2 |" in out


def test_unknown_ids_and_bad_files_are_one_line_errors(tmp_path, capsys):
    assert cb.main([str(_records(tmp_path, [("greedy", "math-1001-00000", True)]))]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "not in the problems file" in err and "\n" not in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"x": 1}\n')
    assert cb.main([str(bad)]) == 2
    assert cb.main([str(tmp_path / "missing.jsonl")]) == 2
