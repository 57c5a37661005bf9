"""The load generator runs from a small environment: importing it pulls in neither torch nor
the engine; nor does the capacity simulator, which decides with the engine's pure rules, nor
do the command line's modules, which import the engine's benches only when one runs."""

import subprocess
import sys

import pytest

LOAD_GENERATOR = ["loadgen.cli", "loadgen.client", "loadgen.loops", "loadgen.arrivals", "loadgen.stats",
                  "loadgen.report", "loadgen.records", "loadgen.plot",
                  "loadgen.overload", "loadgen.soak", "loadgen.commands"]
CAPACITY = ["tools.capacity.simulator", "tools.capacity.calibration", "tools.capacity.step_cost",
            "tools.capacity.live_calibration", "tools.capacity.calibration_bench", "tools.capacity.cli"]
COMMAND_LINE = ["tools.cli", "tools.commands", "tools.bench.cli", "tools.bench.detokenize", "tools.tiny_training.cli",
                "loadgen.commands", "cluster.cli"]


@pytest.mark.parametrize("modules", [LOAD_GENERATOR, CAPACITY, COMMAND_LINE],
                         ids=["load-generator", "capacity", "command-line"])
def test_imports_pull_in_neither_torch_nor_the_engine(modules):
    code = (f"import sys\nfor name in {modules!r}: __import__(name)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m in ('replicas.engine', "
            "'replicas.scheduler', 'replicas.runner')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


@pytest.mark.parametrize("argv", [
    ["loadgen", "--help"], ["calibrate", "--help"], ["simulate", "--help"], ["bench", "overload", "--help"],
    ["bench", "calibration", "--help"],
    ["-v", "loadgen", "--url", "http://127.0.0.1:9", "--rate", "1", "--duration", "0.1", "--quiet"],
], ids=["loadgen", "calibrate", "simulate", "bench overload", "bench calibration", "a loadgen run"])
def test_client_commands_of_the_cli_import_neither_torch_nor_the_engine(argv):
    """`dllm-serve loadgen` and the other client commands run on a machine without torch."""
    code = (f"import sys\nfrom tools.cli import main\ntry:\n    code = main({argv!r})\nexcept SystemExit as exit_:\n"
            f"    code = exit_.code\nprint(code, sorted(m for m in sys.modules if m.split('.')[0] in ('torch', "
            f"'algorithms') or m in ('replicas.engine', 'replicas.scheduler', 'replicas.runner')))")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    exit_code, loaded = ran.stdout.strip().splitlines()[-1].split(" ", 1)  # after the help text, if any
    assert loaded == "[]", ran.stdout + ran.stderr
    assert exit_code in ("0", "2"), ran.stdout + ran.stderr  # help, or an unreachable URL


def test_the_whole_cli_still_lists_every_command(capsys):
    from tools.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    listed = capsys.readouterr().out
    for command in ("generate", "train-tiny", "eval-tiny", "up", "status", "render", "bench", "calibrate",
                    "simulate", "loadgen"):
        assert command in listed
