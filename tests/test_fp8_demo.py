"""The GRPO demo with fp8 rollouts and truncated importance sampling (TIS) on the CPU, its CLI flags, and the
benchmark that compares it with a bf16 engine (benchmarks/fp8_demo.py)."""
import importlib.util
import json
import math
from pathlib import Path

import pytest

import trainer_adapters.demo as demo
from rollout_engine.cli import main as cli_main

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "fp8_demo.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("fp8_demo_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def spied(monkeypatch):
    """The arguments run_demo hands the Engine and hybrid_step (both still run)."""
    seen = {"engine": [], "step": []}

    def engine(*args, **kwargs):
        seen["engine"].append(kwargs)
        return real_engine(*args, **kwargs)

    def step(*args, **kwargs):
        seen["step"].append(kwargs)
        return real_step(*args, **kwargs)

    real_engine, real_step = demo.Engine, demo.hybrid_step
    monkeypatch.setattr(demo, "Engine", engine)
    monkeypatch.setattr(demo, "hybrid_step", step)
    return seen


def test_demo_trains_from_fp8_rollouts_with_tis(tmp_path, spied):
    log = demo.run_demo(tmp_path, steps=3, prompts_per_step=20, n=4, device="cpu", eval_every=3, progress=False,
                        quantization="fp8", tis_cap=2.0, engine_dtype="bfloat16")
    assert spied["engine"][0]["quantization"] == "fp8" and spied["engine"][0]["dtype"] == "bfloat16"
    assert [kw["tis_cap"] for kw in spied["step"]] == [2.0] * 3
    on_disk = json.loads((tmp_path / "demo_log.json").read_text())
    for record in (log, on_disk):
        assert (record["quantization"], record["tis_cap"], record["engine_dtype"]) == ("fp8", 2.0, "bfloat16")
    rewards = [s["reward"] for s in log["steps"]]
    assert len(rewards) == 3 and all(math.isfinite(r) and 0 <= r <= 1 for r in rewards)
    assert all(math.isfinite(s["loss"]) for s in log["steps"])


def test_demo_defaults_record_the_plain_engine(tmp_path):
    """Without the new arguments: the engine's own dtype (float32 on the CPU), no quantization, no TIS."""
    log = demo.run_demo(tmp_path, steps=1, prompts_per_step=10, n=2, device="cpu", progress=False)
    assert (log["quantization"], log["tis_cap"], log["engine_dtype"]) == (None, None, "float32")


def test_cli_demo_passes_quantization_tis_cap_and_dtype(tmp_path, spied, capsys):
    assert cli_main(["demo", "--out", str(tmp_path), "--steps", "2", "--device", "cpu", "--dtype", "bfloat16",
                     "--quantization", "fp8", "--tis-cap", "1.5"]) == 0
    assert spied["engine"][0]["quantization"] == "fp8" and spied["engine"][0]["dtype"] == "bfloat16"
    assert [kw["tis_cap"] for kw in spied["step"]] == [1.5, 1.5]
    log = json.loads((tmp_path / "demo_log.json").read_text())
    assert (log["quantization"], log["tis_cap"], log["engine_dtype"]) == ("fp8", 1.5, "bfloat16")
    assert "greedy accuracy" in capsys.readouterr().out


def test_cli_demo_refuses_an_unknown_quantization_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["demo", "--out", str(tmp_path), "--steps", "1", "--device", "cpu", "--quantization", "fp4"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "quantization='fp4'" in err and "Traceback" not in err


def test_steps_to_threshold_counts_whole_windows():
    bench = load_benchmark()
    rewards = [0.0, 0.0, 1.0, 1.0, 1.0]
    assert bench.running_mean(rewards, 2) == [0.0, 0.5, 1.0, 1.0]  # steps 2..5
    assert bench.steps_to_threshold(rewards, 2, 0.5) == 3
    assert bench.steps_to_threshold(rewards, 2, 0.75) == 4
    assert bench.steps_to_threshold(rewards, 2, 1.5) is None


def test_a_run_that_never_reaches_the_threshold_counts_at_the_last_step_in_the_capped_mean():
    """The mean over seeds is undefined when a seed stalls (bf16's do too); the capped mean stays defined."""
    bench = load_benchmark()
    runs = [{"steps_to_threshold": s, "engine_dtype": "bfloat16", "quantization": None, "tis_cap": None,
             "rewards": [0.5] * 20, "final_greedy_accuracy": 1.0, "step_seconds": 0.1} for s in (10, None, 30)]
    row = bench.summary_row("bf16", runs, window=10, last_step=150)
    assert row["steps_to_threshold"] is None and row["reached"] == "2/3" and row["per_seed"] == "10 - 30"
    assert row["steps_capped"] == (10 + 150 + 30) / 3


def test_benchmark_quick_writes_its_table_json_and_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    bench = load_benchmark()
    bench.main(["--quick", "--device", "cpu"])
    result = json.loads((tmp_path / "fp8_demo_quick.json").read_text())
    assert [r["config"] for r in result["rows"]] == ["bf16", "fp8+TIS", "fp8"]
    runs = {r["config"]: r for r in result["runs"]}
    assert (runs["fp8+TIS"]["quantization"], runs["fp8+TIS"]["tis_cap"]) == ("fp8", 2.0)
    assert (runs["bf16"]["quantization"], runs["bf16"]["engine_dtype"]) == (None, "bfloat16")
    assert all(len(r["rewards"]) == result["steps"] for r in result["runs"])
    reference = bench.running_mean(runs["bf16"]["rewards"], result["window"])[-1]
    assert result["threshold"] == pytest.approx(0.9 * reference)
    # The reference reaches 90% of its own final running mean by its last step at the latest.
    assert runs["bf16"]["steps_to_threshold"] <= result["steps"]
    assert (tmp_path / "fp8_demo_quick.png").stat().st_size > 0
    table = [line.split()[0] for line in capsys.readouterr().out.rstrip().splitlines()[-4:]]
    assert table == ["config", "bf16", "fp8+TIS", "fp8"]  # the table comes last
