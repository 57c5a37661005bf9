"""`dllm-serve calibrate` without a cluster to measure."""

import subprocess
import sys


def _cli(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_calibrate_reports_an_unreachable_cluster(closed_url, tmp_path):
    run = _cli("calibrate", "--url", closed_url, "--duration", "1", "--out", str(tmp_path / "x.json"), "--quiet")
    assert run.returncode == 2 and "dllm-serve calibrate: error:" in run.stderr and "Traceback" not in run.stderr
