"""Benchmark results keep every run: `save` replaces <name>.json and appends the run to history/<name>.jsonl,
and benchmarks/collect.py brings a device call's folder in without losing or doubling a run."""
import importlib.util
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def history(folder, name):
    return [json.loads(line) for line in (folder / "history" / f"{name}.jsonl").read_text().splitlines()]


def test_a_second_run_with_the_same_arguments_keeps_the_first_in_the_history(tmp_path, monkeypatch):
    common = load("common")
    monkeypatch.setattr(sys, "argv", ["rollout.py", "--top-p", "0.9"])
    common.save("rollout_top-p-0.9", [{"tokens_per_s": 1.0}], out_dir=tmp_path)
    common.save("rollout_top-p-0.9", [{"tokens_per_s": 2.0}], out_dir=tmp_path)
    latest = json.loads((tmp_path / "rollout_top-p-0.9.json").read_text())
    runs = history(tmp_path, "rollout_top-p-0.9")
    assert latest["rows"] == [{"tokens_per_s": 2.0}] and latest["argv"] == ["--top-p", "0.9"] and latest["time"]
    assert [r["rows"][0]["tokens_per_s"] for r in runs] == [1.0, 2.0]
    assert runs[1] == latest


def test_collect_adds_each_run_once(tmp_path, monkeypatch):
    common, collect = load("common"), load("collect")
    results, call1, call2 = tmp_path / "results", tmp_path / "call1", tmp_path / "call2"
    results.mkdir()
    monkeypatch.setattr(sys, "argv", ["rollout.py"])
    common.save("rollout", [{"run": 0}], out_dir=results)  # a run already in the repository
    common.save("rollout", [{"run": 1}], out_dir=call1)
    common.save("rollout", [{"run": 2}], out_dir=call2)
    (call1 / "rollout.png").write_bytes(b"png")

    assert collect.collect(call1, results) == {"rollout.json": 1, "rollout.png": 1, "history/rollout.jsonl": 1}
    assert collect.collect(call1, results)["history/rollout.jsonl"] == 0  # collected twice: nothing doubled
    collect.collect(call2, results)
    assert [r["rows"][0]["run"] for r in history(results, "rollout")] == [0, 1, 2]
    assert json.loads((results / "rollout.json").read_text())["rows"] == [{"run": 2}]
    assert (results / "rollout.png").read_bytes() == b"png"


def test_sleep_wake_writes_under_its_own_name_whatever_the_models(tmp_path, monkeypatch):
    """The script's result name comes from its arguments, not from the last model it ran (a loop variable took the
    name over, so every run wrote llama-3.1-8b.json and a --kv-gb run had no file of its own)."""
    sleep_wake = load("sleep_wake")
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sleep_wake, "pinned_copy_bandwidth", lambda: 1.0)
    monkeypatch.setattr(sleep_wake, "run_shape", lambda model, *args: (
        [{"model": model, "step": "sleep", "seconds": 0.01}], {"model": model}))
    for argv, name in ((["sleep_wake.py"], "sleep_wake"), (["sleep_wake.py", "--kv-gb", "20"], "sleep_wake_kv-gb-20.0")):
        monkeypatch.setattr(sys, "argv", argv)
        sleep_wake.main()
        record = json.loads((tmp_path / f"{name}.json").read_text())
        assert [r["model"] for r in record["rows"]] == ["qwen3-1.7b", "llama-3.1-8b"]
    assert not (tmp_path / "llama-3.1-8b.json").exists()
