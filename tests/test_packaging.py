"""Packaging (docs/packaging.md): the wheel carries the shipped model, the benchmark data and the
offline lm-eval tasks, and declares the console scripts; installed (not editable) into a fresh
virtual environment, `psd-generate` runs from a directory outside the checkout on the packaged
model, the console scripts' usage lines name them, `psd-eval` and the bench commands write their
outputs under the current directory (never into the venv), and a missing extra (psd-serve's
fastapi/uvicorn, bench.lm_eval's lm-eval) is one line naming the wheel user's install. Also: the
`--model` hint for a hub id, and the Python text helper (`engine.load` / `engine.generate_text`)
from another working directory.

The wheel is built from a copy of the working tree (never in the checkout: no build/ or
egg-info there), without build isolation, and installed with --no-deps into a venv that sees
the system site-packages (torch is not reinstalled); the tests check that `engine` then comes
from the venv, not the checkout. About a minute on a loaded 2-core machine, most of it the
decode of the installed psd-generate.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HUB_ID = "GSAI-ML/LLaDA-8B-Instruct"
PROMPT = "Question: What is 2 + 3?\nAnswer: "
SCRIPTS = {"psd-generate": "engine.cli:main", "psd-serve": "engine.serve.cli:main", "psd-eval": "bench.eval:main"}


def _clean_env(**extra) -> dict:
    """The environment without anything that would put the checkout on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(PYTHONNOUSERSITE="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", **extra)
    return env


def _run(cmd, cwd, timeout=300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=kw.pop("env", None) or _clean_env(), capture_output=True, text=True,
                          timeout=timeout, **kw)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "results")
    for name in ("psd_kernels", "engine", "models", "bench"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("setup.py", "README.md", "MANIFEST.in"):
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    res = _run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "--no-index",
                "-q", "-w", str(out)], cwd=src)
    assert res.returncode == 0, res.stderr[-3000:]
    (whl,) = out.glob("psd_engine-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    env_dir = tmp_path_factory.mktemp("venv")
    res = _run([sys.executable, "-m", "venv", "--system-site-packages", str(env_dir)], cwd=env_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    py = env_dir / "bin" / "python"
    res = _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", str(wheel)],
               cwd=env_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    return env_dir


def test_wheel_carries_model_data_tasks_and_scripts(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (eps,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = z.read(eps).decode()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = z.read(meta).decode()
        weights = z.getinfo("models/default/model.safetensors").file_size
    shipped = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "models" / "default").iterdir() if p.is_file())
    assert shipped and set(shipped) <= names, sorted(set(shipped) - names)
    assert weights == (REPO / "models" / "default" / "model.safetensors").stat().st_size
    for f in ("bench/lm_eval_tasks/gsm8k_local.yaml", "bench/lm_eval_tasks/mbpp_local.yaml",
              "bench/lm_eval_tasks/utils.py", "bench/data/gsm8k/test.jsonl", "bench/data/mbpp/mbpp.jsonl",
              "engine/text.py", "engine/serve/cli.py", "bench/tasks/gsm8k.py"):
        assert f in names, f
    assert "[console_scripts]" in entry_points
    for script, target in SCRIPTS.items():
        assert f"{script} = {target}" in entry_points
    for bounded in ("torch<3,>=2.4", "numpy<3,>=1.24", "tokenizers<1,>=0.15", "jinja2<4,>=3.1"):
        name, spec = bounded.split("<", 1)
        assert any(line.startswith(f"Requires-Dist: {name}") and "<" in line for line in metadata.splitlines()), bounded


@pytest.mark.slow
def test_installed_psd_generate_runs_from_anywhere(venv, tmp_path):
    py, bin_dir = venv / "bin" / "python", venv / "bin"
    where = _run([str(py), "-c", "import engine, models, bench, sys; print(engine.__file__); print(models.__file__); "
                  "print(any(p.rstrip('/') == %r for p in sys.path))" % str(REPO)], cwd=tmp_path)
    assert where.returncode == 0, where.stderr[-2000:]
    engine_file, models_file, repo_on_path = where.stdout.split("\n")[:3]
    assert engine_file.startswith(str(venv)) and models_file.startswith(str(venv)), where.stdout
    assert repo_on_path == "False"
    for script in SCRIPTS:
        assert (bin_dir / script).is_file(), script

    res = _run([str(bin_dir / "psd-generate"), PROMPT, "--gen-length", "16", "--block-length", "16", "--device", "cpu",
                "--json"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["model"].startswith(str(venv)) and out["model"].endswith("models/default")   # the packaged model
    assert out["tokens"] >= 1 and out["calls"] >= 1 and isinstance(out["text"], str) and out["text"].strip()
    assert "Traceback" not in res.stderr

    res = _run([str(bin_dir / "psd-generate"), PROMPT, "--model", HUB_ID], cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("error:") == 1 and "hub id" in res.stderr


@pytest.mark.slow
def test_console_scripts_name_themselves_in_their_usage(venv, tmp_path):
    for script in SCRIPTS:
        res = _run([str(venv / "bin" / script), "--help"], cwd=tmp_path)
        assert res.returncode == 0, (script, res.stderr[-3000:])
        assert res.stdout.startswith(f"usage: {script} ") and "--model" in res.stdout, res.stdout[:300]
        assert "python -m" not in res.stdout.split("\n\n", 1)[0]          # the usage paragraph


@pytest.mark.slow
def test_outputs_land_in_the_current_directory(venv, tmp_path):
    """psd-eval's default run directory and the microbenchmarks' CSVs: under the directory the
    command runs in, not in the installed package (site-packages/runs/ before)."""
    res = _run([str(venv / "bin" / "psd-eval"), "--task", "math", "--limit", "1", "--methods", "greedy",
                "--gen-length", "8", "--block-length", "8", "--quiet"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    (results,) = tmp_path.glob("runs/eval-math-*/results.jsonl")
    assert Path(json.loads(res.stdout.strip().splitlines()[-1])["results_file"]).resolve() == results.resolve()
    assert len(results.read_text().splitlines()) == 1
    # the microbenchmarks are plain commands: no pytest in a plain install (their pytest-benchmark view
    # imported it at module level: ModuleNotFoundError)
    res = _run([str(venv / "bin" / "python"), "-m", "bench.bench_draft", "--rows", "1", "--nodes", "8", "--op",
                "rank_positions"], cwd=tmp_path, env=_clean_env(PYTHONPATH=str(_missing(tmp_path, "pytest"))))
    assert res.returncode == 0, res.stderr[-3000:]
    assert list(tmp_path.glob("runs/bench/bench_draft_*.csv"))
    assert not list(venv.rglob("runs")), "an output was written inside the installed package"


def _missing(tmp_path, *names) -> Path:
    """A directory that, first on PYTHONPATH, makes the packages `names` missing, as without their extra."""
    for name in names:
        (tmp_path / "missing" / name).mkdir(parents=True)
        (tmp_path / "missing" / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n")
    return tmp_path / "missing"


@pytest.mark.parametrize("command, extra", [(["psd-serve"], "serve"), (["python", "-m", "bench.lm_eval", "--help"],
                                                                        "lm_eval")])
def test_a_missing_extra_is_one_line_naming_the_wheel_install(command, extra, venv, tmp_path):
    env = _clean_env(PYTHONPATH=str(_missing(tmp_path, "fastapi", "uvicorn", "lm_eval")))
    res = _run([str(venv / "bin" / command[0]), *command[1:]], cwd=tmp_path, env=env)
    assert res.returncode == 2, res.stderr[-3000:]
    (line,) = res.stderr.splitlines()
    assert line.startswith("error: ") and f"pip install 'psd-engine[{extra}]'" in line, line



@pytest.mark.parametrize("command", [["psd-generate", "hi"], ["psd-serve"], ["psd-eval", "--limit", "1"],
                                     ["python", "-m", "engine.generate", "hi"], ["python", "-m", "bench.eval"],
                                     ["python", "-m", "models.random_checkpoint", "ck"]])
def test_a_missing_torch_is_one_line_saying_what_to_install(command, venv, tmp_path):
    """A `pip install --no-deps` without torch: one error line and exit 2, not a traceback from inside the package
    (models/_torch.py); a program that imports the package gets a ModuleNotFoundError saying the same."""
    env = _clean_env(PYTHONPATH=str(_missing(tmp_path, "torch")))
    res = _run([str(venv / "bin" / command[0]), *command[1:]], cwd=tmp_path, env=env)
    assert res.returncode == 2, res.stderr[-3000:]
    (line,) = res.stderr.splitlines()
    assert line.startswith("error: psd-engine needs PyTorch") and "pip install torch" in line, line


def test_a_missing_torch_is_an_import_error_for_an_importing_program(venv, tmp_path):
    env = _clean_env(PYTHONPATH=str(_missing(tmp_path, "torch")))
    code = ("try:\n    import engine\nexcept ModuleNotFoundError as e:\n    print(e.name, '|', e)\n")
    res = _run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("torch | psd-engine needs PyTorch"), res.stdout

# ---------------------------------------------------------------------- --model that looks like a hub id
HINT = (f"error: --model {HUB_ID} is not a local directory; it looks like a Hugging Face hub id — this engine loads "
        f"weights from local paths only: download it first (e.g. huggingface-cli download {HUB_ID} --local-dir DIR) "
        f"and pass --model DIR\n")


@pytest.mark.parametrize("module, args", [("engine.generate", ["some prompt"]), ("bench.eval", ["--limit", "1"]),
                                          ("engine.serve", []),
                                          ("engine.calibrate", ["--prompts", "p.jsonl", "--out", "g.json"])])
def test_hub_id_model_is_one_hint_line(module, args, tmp_path):
    if module == "engine.serve":
        pytest.importorskip("fastapi")
    res = _run([sys.executable, "-m", module, "--model", HUB_ID, *args], cwd=tmp_path,
               env=_clean_env(PYTHONPATH=str(REPO)))
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr == HINT


def test_hub_id_hint_spares_local_paths(tmp_path, monkeypatch):
    from engine.frontend import hub_id_hint

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpts").mkdir()
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert hub_id_hint(HUB_ID) is not None and hub_id_hint("Qwen/Qwen2.5-0.5B") is not None
    assert hub_id_hint("org/model") is None               # exists here
    assert hub_id_hint("ckpts/llada") is None             # a typo under a local directory: the usual error
    for local in ("./x/y", "/abs/path", "x", "a/b/c", "~/m", None):
        assert hub_id_hint(local) is None, local
    assert hub_id_hint(HUB_ID, flag="model=").startswith(f"model= {HUB_ID} is not a local directory")


# ---------------------------------------------------------------------- the Python text helper
def test_text_helper_from_another_directory(tmp_path, monkeypatch):
    import engine
    from engine import InputError
    from models import CheckpointError

    monkeypatch.chdir(tmp_path)                          # nothing of the checkout is relative to here
    lm = engine.load(device="cpu")
    assert lm.model_dir == REPO / "models" / "default"
    opts = dict(gen_length=8, block_length=8)
    one = lm.generate(PROMPT, **opts)
    assert isinstance(one, str)
    both = lm.generate([PROMPT, PROMPT], method="confidence", threshold=0.9, **opts)
    assert isinstance(both, list) and len(both) == 2 and both[0] == both[1]
    # the same text as the token-level API with the checkpoint's tokenizer
    from models import Tokenizer

    tok = Tokenizer(REPO / "models" / "default")
    ref = engine.generate(lm.model, [tok.encode(PROMPT)], method="greedy", **opts)[0]
    assert one == tok.decode(ref.token_ids)
    (res,) = lm.results([PROMPT], **opts)
    assert res.text == one and res.calls >= 1
    assert lm.generate([], **opts) == []
    with pytest.raises(InputError, match="prompt 1 is empty"):
        lm.generate([PROMPT, "  "], **opts)
    tokenless = engine.TextModel(lm.model, type("Tokenless", (), {"encode": lambda self, t: []})())
    with pytest.raises(InputError, match=r"prompt 0: the prompt \(3 characters\) encodes to no token"):
        tokenless.generate(["zzz"], **opts)
    with pytest.raises(InputError, match="prompt 0 is a bytes"):
        lm.generate([b"x"], **opts)
    with pytest.raises(InputError, match="unknown decoding option|bogus"):
        lm.generate(PROMPT, bogus=1)
    with pytest.raises(CheckpointError, match=f"model_dir {HUB_ID} is not a local directory; it looks like a "
                                              f"Hugging Face hub id"):
        engine.load(HUB_ID)
    with pytest.raises(CheckpointError, match="does not exist"):
        engine.load(tmp_path / "missing")
