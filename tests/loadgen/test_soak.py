"""`bench soak`'s reading of a cluster at rest and of its replicas' memory."""

from loadgen.soak import memory_report, rest_problems

AT_REST = """# TYPE dllm_running_requests gauge
dllm_running_requests{replica="a"} 0.0
dllm_running_requests{replica="b"} 0.0
# TYPE dllm_step_queue_length gauge
dllm_step_queue_length{replica="a"} 0.0
# TYPE dllm_free_pages gauge
dllm_free_pages{replica="a"} 512.0
dllm_free_pages{replica="b"} 510.0
# TYPE dllm_total_pages gauge
dllm_total_pages{replica="a"} 512.0
dllm_total_pages{replica="b"} 512.0
# TYPE dllm_admission_outstanding gauge
dllm_admission_outstanding 0.0
"""


def test_rest_problems_names_what_each_replica_still_holds():
    assert rest_problems(AT_REST) == {"pages held b": 2.0}
    busy = AT_REST.replace('dllm_running_requests{replica="a"} 0.0', 'dllm_running_requests{replica="a"} 3.0')
    busy = busy.replace("dllm_admission_outstanding 0.0", "dllm_admission_outstanding 40.0")
    assert rest_problems(busy) == {"running requests a": 3.0, "admission charge": 40.0, "pages held b": 2.0}
    assert rest_problems(AT_REST.replace("510.0", "512.0")) == {}


def test_memory_report_compares_the_end_with_the_first_minute():
    mib = 1 << 20
    samples = [(t, {7: (100 + t / 10) * mib, 8: None}) for t in range(0, 600, 30)]
    report = memory_report(samples, {7: "engine", 8: "ingress"}, {"whole": {"200": 5}}, 600)
    assert list(report["processes"]) == ["engine 7"]  # 8 never read (gone)
    replica = report["processes"]["engine 7"]
    assert replica["after_first_minute_mib"] == 106.0 and replica["end_mib"] == 157.0
    assert replica["end_over_first_minute"] == round(157 / 106, 4) and report["samples"] == 20
    assert replica["by_minute_mib"] == [103.0 + 6 * minute for minute in range(10)]  # the last reading of each
    assert replica["second_half_growth_mib_per_hour"] == 360.0 and report["growing"] == ["engine 7"]


def test_a_cache_that_fills_then_stays_is_not_growth_and_short_runs_are_not_judged():
    mib = 1 << 20
    samples = [(t, {7: (100 + min(t, 240) / 10) * mib, 8: (200 + t / 10) * mib}) for t in range(0, 900, 10)]
    report = memory_report(samples, {7: "metrics", 8: "ingress"}, {}, 900)
    assert report["processes"]["metrics 7"]["second_half_growth_mib_per_hour"] == 0.0
    assert report["growing"] == ["ingress 8"]  # 360 MiB an hour against 5 % of 290 MiB
    short = memory_report([(t, rss) for t, rss in samples if t < 300], {7: "metrics", 8: "ingress"}, {}, 300)
    assert short["growing"] == [] and short["processes"]["ingress 8"]["second_half_growth_mib_per_hour"] == 360.0
