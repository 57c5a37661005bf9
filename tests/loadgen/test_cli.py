"""`dllm-serve loadgen` options: --help covers every one; bad input is a message and a non-zero exit."""


import pytest

from cli_help import assert_help_explains_every_option
from tools.cli import main


def test_help_explains_every_option(capsys):
    assert_help_explains_every_option(capsys, ("loadgen",), 20, ("exit status", "TTFB", "goodput"))


@pytest.mark.parametrize("argv, message", [
    (["--rate", "5"], "give a bound: --duration SECONDS or --requests N"),
    (["--sweep", "2,4"], "give a bound"),
    (["--rate", "5", "--requests", "3", "--url", "localhost:8000"], "--url must start with http://"),
    (["--rate", "5", "--requests", "3", "--records"], "--records goes with --json"),
    (["--rate", "5", "--requests", "3", "--plot", "/nonexistent/dir/out.png"], "does not exist"),
])
def test_bad_options_give_a_message_and_exit_2(capsys, argv, message):
    assert main(["loadgen", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dllm-serve loadgen: error: ") and message in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    ([], "one of the arguments --rate --sweep --trace is required"),
    (["--rate", "-1", "--duration", "2"], "argument --rate: must be positive"),
    (["--rate", "1", "--sweep", "1,2", "--duration", "2"], "not allowed with argument"),
    (["--sweep", "1,x", "--duration", "2"], "argument --sweep: expected a float"),
    (["--rate", "1", "--duration", "2", "--extra", "[1]"], "argument --extra: expected a JSON object"),
])
def test_argument_errors_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["loadgen", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("model", [[], ["--model", "tiny"]], ids=["listed-model", "given-model"])
def test_unreachable_url(capsys, closed_url, model):
    assert main(["loadgen", "--url", closed_url, "--rate", "5", "--requests", "2", "--quiet", *model]) == 2
    err = capsys.readouterr().err
    assert f"dllm-serve loadgen: error: cannot reach {closed_url}" in err and "Traceback" not in err


def test_bad_trace(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "prompt": "1234"}\n{"timestamp": "soon", "prompt": "x"}\n')
    assert main(["loadgen", "--trace", str(trace)]) == 2
    assert f"trace {trace}, line 2: 'timestamp' must be a number" in capsys.readouterr().err
    assert main(["loadgen", "--trace", str(trace), "--prompt", "x"]) == 2
    assert "--prompt and --trace exclude each other" in capsys.readouterr().err
