"""bench.profile_call: where one model call's time goes (docs/gpu.md read its H200 table)."""
import json

import pytest

from bench import profile_call


def test_profile_tiny_call_on_cpu(capsys):
    rc = profile_call.main(["--shape", "tiny", "--prefix", "64", "--block-length", "8", "--rows", "1", "3",
                            "--reps", "2", "--threads", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    res = json.loads(out.strip().splitlines()[-1])
    assert [r["rows"] for r in res["rows"]] == [1, 3] and res["shape"] == "tiny" and res["cache"] == "dual"
    for r in res["rows"]:
        assert r["event_ms"] > 0 and r["host_ms"] > 0 and r["kernel_ms"] > 0 and r["launches"] >= 10
        assert r["graph_ms"] is None and "CUDA" in r["graph_error"]         # no graph without a GPU
        assert 0 < r["roofline_ms"] < r["event_ms"]
    assert "| rows | event ms | host ms | kernel ms | launches | graph ms | roofline ms |" in out
    assert "kernels by device time, 3 rows" in out


def test_roofline_grows_with_rows(capsys):
    profile_call.main(["--shape", "tiny", "--cache", "none", "--prefix", "32", "--block-length", "8",
                       "--rows", "1", "8", "--reps", "1", "--threads", "1"])
    r1, r8 = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert r8["roofline_ms"] > r1["roofline_ms"]


@pytest.mark.parametrize("argv, msg", [
    (["--rows", "0"], "--rows must be >= 1"),
    (["--prefix", "0"], "--prefix must be >= 1"),
    (["--card", "b200"], "unknown card"),
])
def test_bad_input_is_one_line(capsys, argv, msg):
    assert profile_call.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and msg in err[0]
