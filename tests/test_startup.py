"""bench.startup: the command line's start-up time, measured from outside (README states it)."""
import pytest

from bench import startup


def test_times_the_help_and_the_torch_floor(capsys):
    assert startup.main(["--rounds", "1", "--commands", "help", "import torch"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("| /")]
    assert len(rows) == 2 and all(float(r.split("|")[3]) > 0 for r in rows)


@pytest.mark.parametrize("argv, msg", [(["--rounds", "0"], "--rounds must be"),
                                       (["--repo", "/nonexistent"], "not a psd-engine checkout")])
def test_bad_input_is_one_line(capsys, argv, msg):
    assert startup.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0]
