"""The load generator runs from a small environment: importing it pulls in neither torch nor
the engine; nor does the capacity simulator, which decides with the engine's pure rules."""

import subprocess
import sys

import pytest

LOAD_GENERATOR = ["loadgen.cli", "loadgen.client", "loadgen.runner", "loadgen.arrivals", "loadgen.stats",
                  "loadgen.report", "loadgen.records", "loadgen.plot",
                  "loadgen.overload"]
CAPACITY = ["loadgen.capacity.simulator", "loadgen.capacity.calibration", "loadgen.capacity.step_cost",
            "loadgen.capacity.live_calibration", "loadgen.capacity.calibration_bench", "loadgen.capacity.cli"]


@pytest.mark.parametrize("modules", [LOAD_GENERATOR, CAPACITY], ids=["load-generator", "capacity"])
def test_imports_pull_in_neither_torch_nor_the_engine(modules):
    code = (f"import sys\nfor name in {modules!r}: __import__(name)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'replicas.engine', "
            "'replicas.scheduler', 'replicas.runner'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
