"""`tpassctl goodput` through click's CliRunner."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from torchpass.goodput import model
from torchpass.goodput.model import build_inputs, evaluate
from torchpass.goodput.presets import PRESETS
from tpassctl.goodput_cmd import JSON_SCHEMA, goodput


def run(*args: str, cwd: Path | None = None):
    runner = CliRunner()
    if cwd is None:
        return runner.invoke(goodput, list(args), catch_exceptions=False)
    with runner.isolated_filesystem(temp_dir=cwd):
        return runner.invoke(goodput, list(args), catch_exceptions=False)


def run_json(*args: str) -> dict:
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_prints_a_comparison(name):
    # Its speed (the 2 s budget) is measured by bench/, not asserted here: a wall-clock
    # limit fails on a loaded 2-core machine (6.8 s seen while a benchmark ran beside it).
    result = run("--preset", name)
    assert result.exit_code == 0, result.output
    for label in ("checkpoint-restart", "checkpointless", "live migration"):
        assert label in result.stdout
    assert "goodput (useful / paid GPU-h)" in result.stdout
    assert "USD lost per month" in result.stdout


def test_json_matches_the_model_and_has_the_documented_shape():
    doc = run_json("--preset", "llama3-16k", "--runs", "300")
    assert doc["schema"] == JSON_SCHEMA
    assert doc["preset"] == "llama3-16k"
    assert set(doc) == {
        "schema", "preset", "inputs", "input_sources", "measured_source", "derived", "strategies", "plot", "warnings",
        "model_size", "model_size_source", "measured_not_applied", "breakeven",
    }
    assert (doc["model_size"], doc["breakeven"]) == (None, None)  # the size serves --measured only
    assert set(doc["strategies"]) == set(model.STRATEGIES)
    inputs, _ = build_inputs([("preset", PRESETS["llama3-16k"].values)])
    expected = evaluate(inputs)
    for name, entry in doc["strategies"].items():
        assert entry["goodput"] == pytest.approx(expected.strategies[name].goodput, rel=1e-12)
        assert entry["lost_usd_per_month"] == pytest.approx(expected.strategies[name].lost_usd_per_month, rel=1e-12)
        sim = entry["simulation"]
        assert sim["runs"] == 300
        assert set(sim["wall_hours"]) == {"mean", "p5", "p95"}
        assert abs(sim["wall_hours_rel_diff_vs_model"]) < 0.02
    # 54 * 24 / 419 = 3.093 h between failures.
    assert doc["derived"]["job_mtbf_hours"] == pytest.approx(3.093, abs=1e-3)
    assert doc["input_sources"]["gpus"] == "preset llama3-16k"


def test_no_simulate_leaves_simulation_null():
    doc = run_json("--preset", "pretrain-1k", "--no-simulate")
    assert all(entry["simulation"] is None for entry in doc["strategies"].values())


def test_precedence_preset_then_toml_then_flags(tmp_path):
    config = tmp_path / "job.toml"
    config.write_text("gpus = 2048\ngpus_per_node = 4\nspare_nodes = 12\nsoft_fraction = 0.6\n")
    doc = run_json("--preset", "llama3-16k", "--config", str(config), "--gpus", "4096", "--no-simulate")
    inputs = doc["inputs"]
    assert inputs["gpus"] == 4096  # flag over TOML over preset
    assert inputs["gpus_per_node"] == 4  # TOML over preset
    assert inputs["work_hours"] == 54 * 24  # preset over default
    assert inputs["cr_restart_s"] == 300  # default
    assert doc["input_sources"]["gpus"] == "--gpus"
    assert doc["input_sources"]["soft_fraction"] == f"config {config}"
    assert doc["input_sources"]["cr_restart_s"] == "default"


def test_failure_rate_flags_convert():
    # 2.4 failures a day on 100 GPUs: 0.1 per hour, so 1,000 GPU-hours per GPU.
    doc = run_json("--gpus", "100", "--job-failures-per-day", "2.4", "--no-simulate")
    assert doc["inputs"]["gpu_mtbf_hours"] == pytest.approx(1000.0)
    assert doc["derived"]["job_mtbf_hours"] == pytest.approx(10.0)


@pytest.mark.parametrize(
    "args, named",
    [
        (["--gpus", "-5"], "'--gpus'"),
        (["--gpus", "0"], "'--gpus'"),
        (["--gpus", "100000000000"], "'--gpus'"),
        (["--soft-fraction", "1.5"], "'--soft-fraction'"),
        (["--gpu-mtbf-hours", "0"], "'--gpu-mtbf-hours'"),
        (["--checkpoint-save-s", "0"], "'--checkpoint-save-s'"),
        (["--usd-per-gpu-hour", "-1"], "'--usd-per-gpu-hour'"),
        (["--spare-policy", "warm"], "'--spare-policy'"),
        (["--gpus", "32", "--blast-radius-gpus", "64"], "--blast-radius-gpus: blast_radius_gpus (64) exceeds gpus"),
        (["--spare-nodes", "0"], "--spare-nodes: spare_nodes (0) is too small"),
        (["--gpu-mtbf-hours", "5", "--node-mtbf-hours", "4"], "once, as one of --gpu-mtbf-hours"),
    ],
)
def test_bad_flags_are_named(args, named):
    result = run(*args, "--no-simulate")
    assert result.exit_code != 0
    assert named in result.output
    assert "Traceback" not in result.output


def test_toml_unknown_and_bad_values_are_named(tmp_path):
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("gpus = 64\nsofft_fraction = 0.2\n")
    result = run("--config", str(unknown))
    assert result.exit_code == 1
    assert f"config {unknown}: unknown key(s) sofft_fraction" in result.output

    bad = tmp_path / "bad.toml"
    bad.write_text('gpus = "lots"\n')
    result = run("--config", str(bad))
    assert result.exit_code == 1
    assert "gpus must be a number, got 'lots'" in result.output

    broken = tmp_path / "broken.toml"
    broken.write_text("gpus = \n")
    result = run("--config", str(broken))
    assert result.exit_code == 1
    assert "is not valid TOML" in result.output


def test_measured_file_sets_live_migration_times(tmp_path):
    results = tmp_path / "bench.json"
    results.write_text(json.dumps({
        "detection_latency_s": {"mean": 2.5, "p50": 2.0, "p95": 4.0, "n": 20},
        "migration_pause_s": {"p50": 6.5, "p95": 7.0, "model": "1B"},
        "steady_state_overhead": 0.001,
    }))
    doc = run_json("--preset", "pretrain-1k", "--measured", str(results), "--model-size", "1B", "--no-simulate")
    assert doc["inputs"]["lm_detect_s"] == 2.5  # mean preferred
    assert doc["inputs"]["lm_migrate_s"] == 6.5  # p50 when no mean
    assert doc["inputs"]["lm_overhead"] == 0.001
    assert doc["measured_source"] == str(results)
    # Flags still win over measured figures.
    doc = run_json("--measured", str(results), "--lm-migrate-s", "30", "--no-simulate")
    assert doc["inputs"]["lm_migrate_s"] == 30


def test_measured_relaunch_time_and_which_hard_failures_are_requeued(tmp_path):
    results = tmp_path / "hard_failure.json"
    results.write_text(json.dumps({"hard_failure_relaunch_s": {"mean": 31.5, "p50": 30.9, "n": 2}, "params": "1M"}))
    args = ("--measured", str(results), "--model-size", "1M", "--gpu-killed-fraction", "0", "--no-simulate")
    doc = run_json(*args)
    assert doc["inputs"]["lm_relaunch_s"] == 31.5
    lm = doc["strategies"]["live_migration"]
    assert lm["hard_failures_requeued_share"] == pytest.approx(1 / 128)  # the batch host of 128 nodes
    assert doc["strategies"]["checkpoint_restart"]["hard_failures_requeued_share"] == 1.0
    out = CliRunner().invoke(goodput, list(args)).output
    assert "hard failures under live migration: 100% a node lost outright, relaunched from the newest checkpoint " \
        "in 31.5 s" in out
    assert "the batch host's (0.78% of them) are still requeued" in out
    out = CliRunner().invoke(goodput, ["--spare-policy", "pool", "--no-simulate"]).output
    assert "every one is requeued, as under checkpoint-restart (a relaunch needs a hot spare" in out


def test_measured_auto_discovers_results_and_falls_back(tmp_path):
    runner = CliRunner()
    with runner.isolated_filesystem(temp_dir=tmp_path) as cwd:
        # Nothing to find: a clear note, the defaults stay, exit 0.
        result = runner.invoke(goodput, ["--measured", "--no-simulate"])
        assert result.exit_code == 0, result.output
        assert "--measured: no measured results in" in result.stderr
        assert "bench/results/*.json" in result.stderr
        # Another benchmark's results file is skipped; docs/benchmarks.md is read.
        Path(cwd, "bench/results").mkdir(parents=True)
        Path(cwd, "bench/results/other.json").write_text('{"throughput": 3}')
        Path(cwd, "docs").mkdir()
        Path(cwd, "docs/benchmarks.md").write_text(
            "# Benchmarks\n\n```json torchpass-measured\n"
            '{"detection_latency_s": {"p50": 1.5}, "migration_pause_s": {"p50": 9.0}, "params": "10M"}\n```\n'
        )
        auto = ["--measured", "--model-size", "10M", "--json", "--no-simulate"]
        doc = json.loads(runner.invoke(goodput, auto).stdout)
        assert (doc["inputs"]["lm_detect_s"], doc["inputs"]["lm_migrate_s"]) == (1.5, 9.0)
        assert doc["measured_source"].endswith("docs/benchmarks.md")
        # A results file with the keys wins over the doc.
        Path(cwd, "bench/results/migration.json").write_text(
            '{"detection_latency_s": 0.8, "migration_pause_s": {"mean": 4.0, "model": "10M"}}'
        )
        doc = json.loads(runner.invoke(goodput, auto).stdout)
        assert (doc["inputs"]["lm_detect_s"], doc["inputs"]["lm_migrate_s"]) == (0.8, 4.0)
        assert doc["measured_source"].endswith("migration.json")


def test_measured_merges_each_benchmarks_newest_figures(tmp_path):
    # bench_tpassd writes only detection, bench_migration the pause (and its own
    # detection): re-running one benchmark must not hide the other's figure.
    runner = CliRunner()
    with runner.isolated_filesystem(temp_dir=tmp_path) as cwd:
        res = Path(cwd, "bench/results")
        res.mkdir(parents=True)
        mig, det = res / "migration.json", res / "tpassd.json"
        mig.write_text('{"detection_latency_s": 0.9, "migration_pause_s": {"mean": 1.2, "n": 1, "model": "10M"}}')
        det.write_text('{"detection_latency_s": {"p50": 0.03}}')
        now = time.time()
        os.utime(mig, (now - 60, now - 60))  # tpassd.json is the newer file
        args = ["--measured", "--model-size", "10M", "--json", "--no-simulate"]
        doc = json.loads(runner.invoke(goodput, args).stdout)
        assert (doc["inputs"]["lm_detect_s"], doc["inputs"]["lm_migrate_s"]) == (0.03, 1.2)
        assert doc["input_sources"]["lm_detect_s"] == f"measured {det}"
        assert doc["input_sources"]["lm_migrate_s"] == f"measured {mig}"
        assert doc["measured_source"] == f"{det}, {mig}"


def test_bad_measured_figures_are_named(tmp_path):
    results = tmp_path / "r.json"
    results.write_text('{"migration_pause_s": {"p50": -3}}')
    result = run("--measured", str(results))
    assert result.exit_code == 1
    assert "migration_pause_s must be a finite number >= 0, got -3" in result.output
    results.write_text('{"unrelated": 1}')
    result = run("--measured", str(results))
    assert result.exit_code == 1
    assert "has none of the keys detection_latency_s" in result.output


def test_plot_writes_a_png(tmp_path):
    import matplotlib  # noqa: F401 - the [plot] extra, installed by `make test`: missing it must fail here
    out = tmp_path / "goodput.png"
    doc = run_json("--preset", "pretrain-1k", "--no-simulate", "--plot", str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert doc["plot"] == str(out)
    out2 = tmp_path / "usd.png"
    result = run("--no-simulate", "--plot", str(out2), "--plot-metric", "usd-lost-per-month")
    assert result.exit_code == 0, result.output
    assert out2.stat().st_size > 1000


def test_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    result = run("--no-simulate", "--plot", str(tmp_path / "x.png"))
    assert result.exit_code == 1
    assert "pip install 'torchpass[plot]'" in result.output


def test_list_presets():
    result = run("--list-presets")
    assert result.exit_code == 0
    for name in PRESETS:
        assert name in result.stdout
    listed = json.loads(run("--list-presets", "--json").stdout)
    assert listed["llama3-16k"]["values"]["gpus"] == 16_384


def test_unknown_preset_is_refused():
    result = run("--preset", "llama4")
    assert result.exit_code == 2
    assert "'--preset'" in result.output


def test_weibull_flag_reaches_the_simulator():
    doc = run_json("--preset", "pretrain-1k", "--weibull-shape", "0.7", "--runs", "200")
    sim = doc["strategies"]["checkpoint_restart"]["simulation"]
    assert sim["failure_process"] == "weibull(shape=0.7)"


# --measured --model-size: the migration pause of the model the user asks about
def _by_model_results(path: Path) -> Path:
    # As bench_migration writes it: the headline "mean" is the largest model's stall.
    path.write_text(json.dumps({
        "migration_pause_s": {"mean": 7.6, "n": 1, "model": "100M", "by_model": {"10M": 1.2, "100M": 7.6}},
        "detection_latency_s": {"mean": 0.66, "n": 2},
    }))
    return path


@pytest.mark.parametrize("size, pause, chosen", [
    ("10M", 1.2, "measured with the 10M model"),
    ("100m", 7.6, "measured with the 100M model"),
    ("30M", 1.2, "from the 10M model, the measured size nearest 30M"),  # 3x from 10M, 3.3x from 100M
    ("50M", 7.6, "from the 100M model, the measured size nearest 50M"),
])
def test_measured_pause_is_the_one_for_the_model_size(tmp_path, size, pause, chosen):
    results = _by_model_results(tmp_path / "migration.json")
    doc = run_json("--measured", str(results), "--model-size", size, "--no-simulate")
    assert doc["inputs"]["lm_migrate_s"] == pause
    assert doc["inputs"]["lm_detect_s"] == 0.66
    assert any(chosen in w for w in doc["warnings"]), doc["warnings"]


@pytest.mark.parametrize("size, model_is", [
    ("70B", "the model is 70B (--model-size)"),
    ("1000000", "the model is 1000000 (--model-size)"),
    (None, "no model size given (--model-size)"),
])
def test_measured_pause_outside_the_measured_sizes_is_not_applied(tmp_path, size, model_is):
    """A pause measured with 10M-100M models says nothing about a 70B model's (nor a 1M one's): it is
    kept at the earlier layer's value, and one line says which figure and why. Detection still applies."""
    results = _by_model_results(tmp_path / "migration.json")
    args = ["--measured", str(results), "--no-simulate"] + (["--model-size", size] if size else [])
    result = run(*args)
    assert result.exit_code == 0, result.output
    line = [ln for ln in result.stderr.splitlines() if "not applied" in ln]
    assert line == [f"--measured: not applied: lm_migrate_s (measured at 10M-100M); {model_is}, and these grow "
                    "with the model's size, so each keeps its preset/config/default value (give --model-size "
                    "inside a measured range, or measure at your size)"]
    doc = run_json(*args)
    assert doc["inputs"]["lm_migrate_s"] == 120.0 and doc["input_sources"]["lm_migrate_s"] == "default"
    assert doc["inputs"]["lm_detect_s"] == 0.66
    assert doc["measured_not_applied"] == {"lm_migrate_s": "10M-100M"}


def test_a_preset_names_its_model_size_for_measured(tmp_path):
    """llama3-16k trains Llama 3 405B: a small CPU model's relaunch, save and pause stay out of it
    unless the user says the model is inside the measured sizes."""
    results = tmp_path / "hard_failure.json"
    results.write_text(json.dumps({"hard_failure_relaunch_s": {"mean": 35.8}, "params": "10M",
                                   "gpu_killed": {"resumed_s": {"mean": 9.5}}}))
    doc = run_json("--preset", "llama3-16k", "--measured", str(results), "--no-simulate")
    assert (doc["model_size"], doc["model_size_source"]) == ("405B", "preset llama3-16k")
    assert (doc["inputs"]["lm_relaunch_s"], doc["inputs"]["lm_gpu_killed_s"]) == (200.0, 70.0)
    assert doc["measured_not_applied"] == {"lm_relaunch_s": "10M", "lm_gpu_killed_s": "10M"}
    doc = run_json("--preset", "llama3-16k", "--measured", str(results), "--model-size", "10M", "--no-simulate")
    assert (doc["inputs"]["lm_relaunch_s"], doc["inputs"]["lm_gpu_killed_s"]) == (35.8, 9.5)
    assert doc["input_sources"]["lm_gpu_killed_s"] == f"measured {results}"
    assert doc["model_size_source"] == "--model-size"


@pytest.mark.parametrize("figure", [
    {"gpu_killed": 8.0},
    {"gpu_killed": {"mean": 8.0, "n": 2}},
    {"gpu_killed": {"resumed_s": 8.0, "lost_s": 9.0}},
    {"summary": {"gpu_killed": {"resumed_s": 8.0, "lost_s": 9.0}}},  # a side of bench_hard_failure
])
def test_measured_gpu_killed_recovery(tmp_path, figure):
    results = tmp_path / "hard_failure.json"
    results.write_text(json.dumps({"params": "10M", **figure}))
    doc = run_json("--measured", str(results), "--model-size", "10M", "--no-simulate")
    assert doc["inputs"]["lm_gpu_killed_s"] == 8.0


def test_measured_model_size_with_discovered_results(tmp_path, monkeypatch):
    res = tmp_path / "bench/results"
    res.mkdir(parents=True)
    _by_model_results(res / "migration.json")
    newer = res / "tpassd.json"  # detection only: the pause still comes from migration.json
    newer.write_text('{"detection_latency_s": {"p50": 0.03}}')
    now = time.time()
    os.utime(res / "migration.json", (now - 60, now - 60))
    monkeypatch.chdir(tmp_path)  # --measured with no FILE looks under the current directory
    doc = run_json("--measured", "--model-size", "10M", "--no-simulate")
    assert (doc["inputs"]["lm_detect_s"], doc["inputs"]["lm_migrate_s"]) == (0.03, 1.2)
    assert doc["input_sources"]["lm_migrate_s"] == f"measured {res / 'migration.json'}"
    assert any("10M model" in w for w in doc["warnings"])


def test_measured_model_size_without_per_model_figures_says_so(tmp_path):
    results = tmp_path / "r.json"
    results.write_text('{"migration_pause_s": {"mean": 4.0, "model": "100M"}}')
    doc = run_json("--measured", str(results), "--model-size", "100M", "--no-simulate")
    assert doc["inputs"]["lm_migrate_s"] == 4.0
    doc = run_json("--measured", str(results), "--model-size", "7B", "--no-simulate")
    assert doc["inputs"]["lm_migrate_s"] == 120.0 and doc["measured_not_applied"] == {"lm_migrate_s": "100M"}
    results.write_text('{"migration_pause_s": {"mean": 4.0}}')  # no size at all: never applied
    doc = run_json("--measured", str(results), "--model-size", "100M", "--no-simulate")
    assert doc["measured_not_applied"] == {"lm_migrate_s": "an unstated model size"}


def test_measured_checkpoint_blocking_is_the_one_for_the_model_size(tmp_path):
    # As bench_app_checkpoint writes it: torchpass.checkpoint's blocking time per model size.
    results = tmp_path / "app_checkpoint.json"
    results.write_text(json.dumps({"checkpoint_blocking_s": {
        "p50": 0.157, "model": "100M", "by_model": {"10M": 0.022, "100M": 0.157},
        "torch_save_by_model": {"10M": 0.287, "100M": 2.825}}}))
    doc = run_json("--measured", str(results), "--model-size", "10M", "--no-simulate")
    assert doc["inputs"]["lm_checkpoint_save_s"] == 0.022
    assert doc["input_sources"]["lm_checkpoint_save_s"] == f"measured {results}"
    assert any("torchpass.checkpoint save blocking 0.022 s measured with the 10M model" in w
               for w in doc["warnings"]), doc["warnings"]
    big = run_json("--measured", str(results), "--model-size", "100M", "--no-simulate")
    assert big["inputs"]["lm_checkpoint_save_s"] == 0.157
    assert big["inputs"]["checkpoint_save_s"] == 30.0  # checkpoint-restart's own save is the user's


def test_model_size_is_checked(tmp_path):
    results = _by_model_results(tmp_path / "migration.json")
    result = run("--model-size", "10M")
    assert result.exit_code == 2
    assert "use it with --measured" in result.output
    result = run("--measured", str(results), "--model-size", "huge")
    assert result.exit_code == 1
    assert "model size 'huge' is not a parameter count" in result.output
    results.write_text('{"migration_pause_s": {"mean": 4.0, "by_model": {"tiny": 1.0}}}')
    result = run("--measured", str(results), "--model-size", "10M")
    assert result.exit_code == 1
    assert "model size 'tiny'" in result.output


def test_nearest_size_prefers_the_larger_on_a_tie():
    from torchpass.goodput.measured import model_params, nearest_size

    assert model_params("1.3B") == 1.3e9
    assert nearest_size("10M", ["1M", "100M"]) == "100M"  # 10x either way: the longer pause
    assert nearest_size("2M", ["1M", "100M"]) == "1M"
