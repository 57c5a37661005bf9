"""The GPU script's CPU dry run: every section runs on tiny shapes and reports."""

import json

import run_all


def test_the_gpu_script_dry_run_passes_and_reports_every_section(tmp_path, capsys):
    """Every section but 'tests' (pytest of tests/gpu, which the suite runs itself)."""
    sections = [s for s in run_all.SECTIONS if s != "tests"]
    assert run_all.main(["--dry-run", "--out", str(tmp_path), "--only", ",".join(sections)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    sections = report["sections"]
    assert set(sections) == set(run_all.SECTIONS) - {"tests"} and not any("error" in s for s in sections.values())
    for arch in run_all.SHAPES:
        served = sections["serve"][arch]
        assert served["finished"] == ["length"] and served["long_finish"] == "length"
        assert served["pool_pages"] > 1 and served["step_peak_gib"] is not None  # sized by measuring
        assert 0 < served["compute_ratio"] <= 1 and served["tokens_per_s"] > 0
    assert set(sections["bench"]["engine"]["accuracy"]) >= {"fdfo", "sync"}
    assert sections["bench"]["forward"]["sdar"]["batch_1"]["project_ms_per_forward"] > 0
    table = capsys.readouterr().out
    assert "serve   SDARForCausalLM" in table and "bench   engine" in table
