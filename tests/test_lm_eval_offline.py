"""The offline lm-eval tasks (bench/lm_eval_tasks/: gsm8k_local, mbpp_local) and the one-line error
for a standard task whose data set is on the hub (docs/lm_eval.md, "Offline tasks").

The YAMLs must be lm-eval's standard gsm8k / mbpp definitions except for where the data comes from
(checked key by key against the installed lm-eval's own files), their prompts must equal
bench.eval's for the same problems, and `python -m bench.lm_eval --tasks gsm8k_local` must run end
to end on the shipped model with the hub switched off. The end-to-end runs take about a minute on a
loaded 2-core machine (two subprocesses, each importing lm-eval and loading the model).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

for _var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")

lm_eval = pytest.importorskip("lm_eval")

from bench import lm_eval as adapter  # noqa: E402
from bench.tasks import gsm8k, mbpp  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
HARNESS_TASKS = Path(lm_eval.__file__).resolve().parent / "tasks"
# where a local task may differ from the standard one: the data source (and, for MBPP, the metric's runner)
DATA_KEYS = {"task", "tag", "dataset_path", "dataset_name", "custom_dataset"}


def _yaml(path: Path) -> dict:
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(path, resolve_func=False)


@pytest.fixture(scope="module")
def local_tasks():
    tm = adapter.task_manager(include_defaults=False)
    return tm.load(["gsm8k_local", "mbpp_local"])["tasks"]


def test_yamls_are_the_standard_tasks_but_for_the_data():
    ours = _yaml(adapter.TASKS_DIR / "gsm8k_local.yaml")
    std = _yaml(HARNESS_TASKS / "gsm8k" / "gsm8k.yaml")
    assert ours["task"] == "gsm8k_local" and ours["dataset_path"] == "json"
    for key in set(std) | set(ours):
        if key in DATA_KEYS or key == "fewshot_config":
            continue
        assert ours.get(key) == std.get(key), key
    assert ours["fewshot_config"] == {"sampler": "first_n"}      # the 5 shots in file order, as bench.eval
    ours = _yaml(adapter.TASKS_DIR / "mbpp_local.yaml")
    std = _yaml(HARNESS_TASKS / "mbpp" / "mbpp.yaml")
    for key in set(std) | set(ours):
        if key in DATA_KEYS or key in ("metric_list", "fewshot_config"):
            continue
        assert ours.get(key) == std.get(key), key
    assert [{k: v for k, v in m.items() if k != "metric"} for m in ours["metric_list"]] == \
        [{k: v for k, v in m.items() if k != "metric"} for m in std["metric_list"]]
    assert ours["fewshot_config"]["sampler"] == std["fewshot_config"]["sampler"] == "first_n"


def test_local_tasks_read_the_shipped_data_with_bench_evals_prompts(local_tasks):
    g, m = local_tasks["gsm8k_local"], local_tasks["mbpp_local"]
    docs = list(g.test_docs())
    assert len(docs) == 1314 == len(gsm8k.load())                 # the shots (first 5) are never evaluated
    assert g.fewshot_context(docs[0], 5) == gsm8k.format_prompt(gsm8k.load(limit=1)[0], gsm8k.few_shot(5))
    assert g.fewshot_context(docs[7], 0) == gsm8k.format_prompt(gsm8k.load()[7])
    mdocs = list(m.test_docs())
    assert [d["task_id"] for d in mdocs] == list(range(11, 511))
    assert m.fewshot_context(mdocs[0], 3) == mbpp.format_prompt(mbpp.load(limit=1)[0], mbpp.few_shot(3))
    # the hub's mbpp `full` splits, by task id
    splits = {k: sorted(r["task_id"] for r in v) for k, v in m.dataset.items()}
    assert {k: (v[0], v[-1], len(v)) for k, v in splits.items()} == {
        "prompt": (1, 10, 10), "test": (11, 510, 500), "validation": (511, 600, 90), "train": (601, 974, 374)}


def test_mbpp_pass_at_1_runs_the_asserts(local_tasks):
    m = local_tasks["mbpp_local"]
    doc = next(iter(m.test_docs()))
    tests = m.doc_to_target(doc)
    assert tests == "\n".join(doc["test_list"])
    (metric,) = [fn for fn in m._metric_fn_list.values()]
    assert metric(references=[tests], predictions=[doc["code"]]) == 1.0       # the reference solution
    assert metric(references=[tests], predictions=["def remove_Occ(s, ch):\n    return s"]) == 0.0


def test_local_tasks_beside_a_users_include_path(tmp_path):
    from lm_eval.tasks import TaskManager

    (tmp_path / "mine.yaml").write_text("task: my_local_task\ndataset_path: json\noutput_type: generate_until\n"
                                        "test_split: test\ndoc_to_text: x\ndoc_to_target: y\n", encoding="utf-8")
    with adapter._OfflineTasks():
        tm = TaskManager(include_path=str(tmp_path), include_defaults=False)
    assert {"gsm8k_local", "mbpp_local", "my_local_task"} <= set(tm.all_tasks)
    assert "gsm8k_local" not in TaskManager(include_defaults=False).all_tasks       # restored afterwards


# ---------------------------------------------------------------------- the CLI, offline
def _cli(args, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "bench.lm_eval", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_gsm8k_local_runs_offline_end_to_end(tmp_path):
    res = _cli(["--model", "psd", "--model_args", "method=psd,threshold=0.7,depth=2,cache=dual,block_length=16",
                "--tasks", "gsm8k_local", "--limit", "2", "--num_fewshot", "0", "--gen_kwargs", "max_gen_toks=16",
                "--device", "cpu", "--output_path", str(tmp_path / "out")], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "gsm8k_local" in res.stdout and "exact_match" in res.stdout
    assert "| gsm8k_local | generate_until | 2 |" in res.stdout
    (results,) = (tmp_path / "out").rglob("results_*.json")
    out = json.loads(results.read_text(encoding="utf-8"))
    metrics = out["results"]["gsm8k_local"]
    assert 0.0 <= metrics["exact_match,strict-match"] <= 1.0 and 0.0 <= metrics["exact_match,flexible-extract"] <= 1.0
    assert out["config"]["psd"]["stats"]["gsm8k_local"]["generate_until"]["requests"] == 2


@pytest.mark.parametrize("task, suggestion", [("gsm8k", "use --tasks gsm8k_local"),
                                              ("mbpp", "use --tasks mbpp_local")])
@pytest.mark.slow
def test_standard_task_offline_is_one_error_line(task, suggestion, tmp_path):
    res = _cli(["--model", "psd", "--tasks", task, "--limit", "1", "--device", "cpu"], tmp_path)
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.stderr[-3000:]
    assert errors[0].startswith(f"error: task {task} needs its data from the Hugging Face hub")
    assert "HF_DATASETS_OFFLINE=1" in errors[0] and suggestion in errors[0]
    assert "Traceback" not in res.stderr


def test_hub_id_model_arg_is_the_hint():
    from models import CheckpointError

    with pytest.raises(CheckpointError, match="^model= GSAI-ML/LLaDA-8B-Instruct is not a local directory; it "
                                              "looks like a Hugging Face hub id"):
        adapter.PsdLM(model="GSAI-ML/LLaDA-8B-Instruct")
