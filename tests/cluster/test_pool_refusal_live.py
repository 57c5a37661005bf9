"""A KV-pool budget too small for one request stops `dllm-serve up` with one line naming the
sizes: the replica's start fails, no traceback, and nothing is left serving."""

import subprocess
import sys

from live_up import free_port


def test_a_budget_too_small_stops_up_with_one_line_naming_the_sizes(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tools.cli", "up", "--set", "replica.memory_utilization=0.0001",
                             "--set", "replica.max_model_len=512", "--set", f"port={free_port()}",
                             "--set", f"metrics_port={free_port()}"],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("dllm-serve: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "PoolSizingError" in errors[0] and "memory_utilization 0.0001" in errors[0]
    assert "max_model_len 512" in errors[0] and "raise replica.memory_utilization" in errors[0]
    assert "ready; Ctrl-C stops" not in result.stdout
