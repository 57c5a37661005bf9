"""Step-aware admission: cost, predicted completion, Retry-After, derived SLO, several
ingresses, release."""

import gc
import math

import pytest

from cluster.admission import REFUSAL_LOG_EVERY_S, AdmissionController
from cluster.config import SLO_FLOOR_S, SLO_MULTIPLE, AdmissionSettings
from replicas.cost_model import DrainModel
from replicas.request_cost import SLO_HEADROOM

# the tiny model on this machine, roughly: 7 ms per step plus 2 ms per row, 16 rows
C0, C1, MAX_BATCH = 0.007, 0.002, 16
FULL_RATE = MAX_BATCH / (C0 + C1 * MAX_BATCH)


def controller(slo_latency_s=10.0, min_replicas=2, clock=None, **settings):
    extra = {} if clock is None else {"clock": clock}
    return AdmissionController(AdmissionSettings(**settings), slo_latency_s, min_replicas, **extra)


_HELD = []  # admissions' charges, held as a streaming request holds its own (a dropped one releases itself)


def admit(adm, cost):
    decision = adm.try_admit(cost)
    _HELD.append(decision)
    return decision


def replica(debt=0.0, live=0, measured_rows=MAX_BATCH, stats_time=100.0, age_s=0.1, **extra):
    """One replica's routing stats as the metrics actor hands them to the ingress."""
    model = DrainModel(C0, C1, MAX_BATCH, measured_rows)
    return {"step_debt": debt, "live_requests": live, "stats_time": stats_time, "age_s": age_s,
            **model.as_stats(), "drain_row_steps_per_s": model.rate(), **extra}


def test_fixed_debt_bound_before_any_report():
    adm = controller(max_step_debt_per_replica=1000)  # 2 replicas expected, none reported: 2000
    first, second = admit(adm, 1500), admit(adm, 500)  # held: a dropped charge releases itself
    assert first.admitted and second.admitted
    assert adm.work_ahead() == 2000
    refused = admit(adm, 100)
    assert not refused.admitted
    # 100 row-steps over the bound at 2 x 500 row-steps/s (the prior) -> at least 1 s
    assert refused.retry_after_s == 1
    first.charge.progress(600)
    assert admit(adm, 100).admitted


def test_a_fixed_bound_still_refuses_what_would_miss_the_requests_own_deadline():
    adm = controller(max_step_debt_per_replica=1000, min_replicas=1)
    adm.update_view({"a": replica(debt=100, live=5)})
    predicted = adm.predicted_s(20)
    assert adm.try_admit(20).admitted  # far below the bound
    late = adm.try_admit(20, slo_s=predicted / 2)
    assert not late.admitted and late.retry_after_s >= 1
    assert adm.try_admit(20, slo_s=predicted * 2).admitted


def test_light_load_admits_what_a_worst_case_charge_would_refuse():
    """12 requests in flight (a closed loop of 12 clients): charging the worst case
    (8 blocks x 16 steps) against the rate measured at the current batch x SLO would refuse;
    the prediction charges measured steps and drains at the batch the queue runs at."""
    adm = controller(slo_latency_s=5.0, min_replicas=1)
    mean_cost = 8 * 2.3
    adm.update_view({"a": replica(debt=12 * mean_cost, live=12, steps_per_block={"2": 70, "3": 30})})
    cost = adm.cost(max_tokens=128, block_length=16, worst_case_steps_per_block=16)
    assert cost == 19  # 8 blocks x the mean measured 2.3 steps, rounded up; not the worst case of 16
    rate_at_one_row = 1 / (C0 + C1)  # what a replica measured between two light-load arrivals
    worst_case_outstanding = 12 * 8 * 16
    assert worst_case_outstanding > rate_at_one_row * 5.0  # a worst-case charge refuses here
    rate = 13 / (C0 + C1 * 13)
    expected = (12 * mean_cost + cost) / rate + cost * (C0 + C1 * 13)
    assert adm.predicted_s(cost) == pytest.approx(expected) and expected < 5.0
    assert admit(adm, cost).admitted


@pytest.mark.parametrize("headroom", [SLO_HEADROOM, 1.0])
@pytest.mark.parametrize("debt", [0.0, 500.0, 1000.0, 1500.0, 1900.0, 2000.0, 2100.0, 3000.0, 10_000.0])
def test_admits_exactly_while_the_prediction_meets_the_slo_with_its_headroom(debt, headroom):
    adm = controller(slo_latency_s=5.0, min_replicas=1, slo_headroom=headroom)
    adm.update_view({"a": replica(debt=debt, live=40)})
    predicted = (debt + 20) / FULL_RATE + 20 * (C0 + C1 * MAX_BATCH)
    assert adm.predicted_s(20) == pytest.approx(predicted)
    assert admit(adm, 20).admitted == (debt == 0 or predicted <= 5.0 * headroom)


def test_refusal_when_the_queue_ahead_exceeds_the_slo_and_retry_after_is_the_excess():
    adm = controller(slo_latency_s=5.0, min_replicas=1)
    adm.update_view({"a": replica(debt=5000, live=200)})
    predicted = 5020 / FULL_RATE + 20 * (C0 + C1 * MAX_BATCH)
    refused = admit(adm, 20)
    assert not refused.admitted and refused.retry_after_s == math.ceil(predicted - 5.0 * SLO_HEADROOM)
    assert adm.quick_refusal() is not None  # even one block is refused, and nothing is charged
    assert adm.outstanding == 0
    # after Retry-After seconds at the full-batch rate, the same request is admitted
    drained = 5000 - FULL_RATE * refused.retry_after_s
    adm.update_view({"a": replica(debt=drained, live=200, stats_time=100.0 + refused.retry_after_s)})
    assert adm.quick_refusal() is None and admit(adm, 20).admitted


def test_predictions_learn_from_what_answers_took():
    """Answers that take 1.5x their prediction make the prediction 1.5x (within the limits),
    so a request at 80% of the target is refused; answers predicted without a queue teach
    nothing; faster answers bring it back, and below 1 the predictions stand."""
    now = [1000.0]
    adm = controller(slo_latency_s=5.0, min_replicas=1, clock=lambda: now[0])
    adm.update_view({"a": replica(debt=1000, live=60, stats_time=now[0])})
    predicted = adm.predicted_s(20)
    assert 2.0 < predicted < 4.0 and admit(adm, 20).admitted and adm.prediction_bias == 1.0

    def answers(count, took_ratio, cost=20):
        for _ in range(count):
            decision = adm.try_admit(cost)
            assert decision.admitted and decision.predicted_s == pytest.approx(adm.predicted_s(cost), rel=0.05)
            now[0] += decision.predicted_s * took_ratio
            decision.charge.answered()

    quick = controller(slo_latency_s=5.0, min_replicas=1, clock=lambda: now[0])
    quick.update_view({"a": replica(debt=5, live=1, stats_time=now[0])})
    decision = quick.try_admit(20)
    now[0] += decision.predicted_s * 3  # no queue: the path and the batch's hold dominate
    decision.charge.answered()
    assert quick.prediction_bias == 1.0

    adm.update_view({"a": replica(debt=200, live=60, stats_time=now[0])})
    answers(300, 1.5)
    assert adm.prediction_bias == pytest.approx(1.5, rel=0.02)
    adm.update_view({"a": replica(debt=1000, live=60, stats_time=now[0])})
    assert adm.predicted_s(20) * 1.5 > 5.0 * SLO_HEADROOM and not admit(adm, 20).admitted
    adm.update_view({"a": replica(debt=200, live=60, stats_time=now[0])})
    answers(300, 10.0)  # one answer counts as at most 2x slower, and the correction stays within 2x
    assert adm.prediction_bias == pytest.approx(2.0, rel=0.01)
    answers(600, 1.0)
    assert adm.prediction_bias == pytest.approx(1.0, abs=0.01)
    answers(600, 0.7)  # answers earlier than predicted: learned, but admission admits no more
    assert adm.prediction_bias == pytest.approx(0.7, rel=0.02) and adm.correction == 1.0
    adm.update_view({"a": replica(debt=1600, live=60, stats_time=now[0])})
    at_target = adm.predicted_s(20)
    assert (at_target * 0.7 <= 5.0 * SLO_HEADROOM < at_target) and not admit(adm, 20).admitted


def test_rate_is_never_extrapolated_past_the_largest_measured_batch():
    """A light-load fit (one row per step) cannot see c1: 16 rows would look 16x faster."""
    adm = controller(slo_latency_s=5.0, min_replicas=1)
    adm.update_view({"a": replica(debt=600, live=16, measured_rows=1)})
    one_row = 1 / (C0 + C1)
    assert adm.predicted_s(20) == pytest.approx(620 * (1 / one_row) + 20 * (C0 + C1 * MAX_BATCH))


def test_two_replicas_drain_together_and_stale_reports_are_ignored():
    adm = controller(slo_latency_s=5.0)
    adm.update_view({"a": replica(debt=2000, live=20), "b": replica(debt=1000, live=20),
                     "stale": replica(debt=1e9, live=1000, age_s=60.0)})
    assert set(adm.view) == {"a", "b"} and adm.work_ahead() == 3000
    assert adm.predicted_s(20) == pytest.approx(3020 / (2 * FULL_RATE) + 20 * (C0 + C1 * MAX_BATCH))


def test_unmeasured_replica_drains_at_the_prior():
    adm = controller(slo_latency_s=5.0, min_replicas=1, initial_row_steps_per_s=200.0)
    adm.update_view({"a": {"step_debt": 100.0, "live_requests": 2, "stats_time": 1.0, "age_s": 0.0}})
    assert adm.predicted_s(10) == pytest.approx(110 / 200 + 10 / 200)


def test_a_prompts_pages_cost_what_the_replicas_measured_a_page_to_cost():
    """A page costs c2 seconds, in row-steps at the drain rate of the batch the queue runs
    at; before any replica measured c2 (or with no report) a prompt costs nothing."""
    adm = controller(slo_latency_s=5.0, min_replicas=1)
    assert adm.prompt_cost(10) == 0.0
    adm.update_view({"a": replica(live=15, c2=0.0005)})  # 15 live + this one: a full batch
    assert adm.prompt_cost(10) == pytest.approx(10 * 0.0005 * FULL_RATE)
    assert adm.prompt_cost(0) == 0.0


def test_idle_cluster_admits_even_an_oversized_request():
    adm = controller(max_step_debt_per_replica=10)
    assert admit(adm, 10_000).admitted
    assert not admit(adm, 1).admitted
    predicted = controller(slo_latency_s=1.0)
    assert admit(predicted, 10_000).admitted
    assert not admit(predicted, 1).admitted


def test_cost_uses_mean_or_quantile_of_measured_steps():
    adm = controller(cost_quantile=0.9)
    assert adm.cost(max_tokens=64, block_length=16, worst_case_steps_per_block=17) == 68  # nothing measured yet
    adm.update_view({"a": {"steps_per_block": {"2": 80, "5": 15, "9": 5}, "age_s": 0}})
    assert adm.cost(max_tokens=64, block_length=16, worst_case_steps_per_block=17) == 20  # p90 = 5 steps
    assert adm.cost(max_tokens=49, block_length=16, worst_case_steps_per_block=3) == 12  # 4 blocks, capped at 3
    mean = controller()
    mean.update_view({"a": {"steps_per_block": {"2": 80, "5": 15, "9": 5}, "age_s": 0}})
    assert mean.cost(max_tokens=64, block_length=16, worst_case_steps_per_block=17) == 12  # 4 x 2.8, rounded up


def test_derived_default_slo():
    adm = controller(slo_latency_s=None)
    assert adm.slo_latency_s == SLO_FLOOR_S  # no replica has measured yet: known before any report
    adm.update_view({"a": replica(longest_request_s=2.5), "b": replica(longest_request_s=3.0), "c": replica()})
    assert adm.slo_latency_s == SLO_FLOOR_S  # twice the longest request is less than a user accepts
    adm.update_view({"a": replica(longest_request_s=2.5), "b": replica(longest_request_s=7.0), "c": replica()})
    assert adm.slo_latency_s == SLO_MULTIPLE * 7.0
    explicit = controller(slo_latency_s=5.0)
    explicit.update_view({"a": replica(longest_request_s=30.0)})
    assert explicit.slo_latency_s == 5.0


def test_own_admissions_count_until_a_report_includes_them():
    now = [100.0]
    adm = controller(slo_latency_s=5.0, min_replicas=1, clock=lambda: now[0])
    adm.update_view({"a": replica(debt=100, live=5, stats_time=100.0)})
    now[0] = 100.2
    assert admit(adm, 20).admitted
    assert adm.work_ahead() == 120  # reported + admitted since the report
    adm.update_view({"a": replica(debt=120, live=6, stats_time=100.5)})
    assert adm.work_ahead() == 120  # the report counts it now: not twice


def test_two_ingresses_fill_the_headroom_once_between_two_reports():
    """Two controllers share one replica view. Between two reports each counts its own
    admissions twice (as if the other had admitted as much), so together they fill the
    headroom once; the next report counts both, and neither admits again until the
    replica drains."""
    now = [100.0]
    clock = lambda: now[0]  # noqa: E731
    view = {"a": replica(debt=1000, live=50, stats_time=100.0)}
    ingresses = [controller(slo_latency_s=5.0, min_replicas=1, clock=clock) for _ in range(2)]
    for adm in ingresses:
        adm.update_view(view)
        adm.ingress_replicas = 2

    def fill(adm) -> int:
        admitted = 0
        while admit(adm, 20).admitted:
            admitted += 1
            now[0] += 0.001
        return admitted

    alone = (5.0 * SLO_HEADROOM - 20 * (C0 + C1 * MAX_BATCH)) * FULL_RATE - 1000  # room in row-steps
    first, second = fill(ingresses[0]), fill(ingresses[1])
    assert first == second == math.floor((alone + 20) / 40)  # 1000 + 2 x own admissions + 20 within the SLO
    capacity_bound = 1000 + alone  # what one ingress alone keeps within the SLO
    over = 1000 + 20 * (first + second) - capacity_bound
    assert over <= 20  # together at most one request beyond what one ingress alone admits
    # the next report counts everything admitted: both refuse, nothing counted twice
    now[0] += 0.5
    view = {"a": replica(debt=1000 + 20 * (first + second), live=50 + first + second, stats_time=now[0])}
    for adm in ingresses:
        adm.update_view(view)
        assert adm.work_ahead() == view["a"]["step_debt"]
        assert not admit(adm, 20).admitted


def test_disabled_admission_admits_everything():
    adm = controller(enabled=False, max_step_debt_per_replica=1)
    assert all(admit(adm, 100).admitted for _ in range(10))
    adm = controller(enabled=False, slo_latency_s=0.001)
    adm.update_view({"a": replica(debt=1e6)})
    assert all(admit(adm, 100).admitted for _ in range(10)) and adm.quick_refusal() is None


def test_charge_releases_progressively_and_once():
    adm = controller(max_step_debt_per_replica=1000)
    charge = admit(adm, 100).charge
    charge.progress(30)
    assert adm.outstanding == 70
    charge.progress(250)  # never more than the cost
    assert adm.outstanding == 0
    charge.close()
    assert adm.outstanding == 0


def test_unstreamed_charge_is_released_when_dropped():
    adm = controller(max_step_debt_per_replica=1000)
    charge = adm.try_admit(100).charge
    del charge
    gc.collect()
    assert adm.outstanding == 0
    adm.update_view({"a": replica(debt=0, stats_time=0.0)})
    adm.try_admit(100)  # admitted after the report, then dropped: it stops counting too
    gc.collect()
    assert adm.work_ahead() == 0


def test_finished_work_stops_counting_at_once():
    """One client sending requests back to back: each finishes before the next report,
    and neither its admission nor the debt the last report counted for it holds up the next."""
    now = [100.0]
    adm = controller(slo_latency_s=5.0, min_replicas=1, clock=lambda: now[0])
    first = adm.try_admit(40).charge
    now[0] = 100.1
    adm.update_view({"a": replica(debt=40, live=1, stats_time=100.1)})  # the report counts the first request
    first.progress(30)
    assert adm.work_ahead() == 10  # 30 of its steps done since the report
    now[0] = 100.2
    second = adm.try_admit(40).charge  # admitted after the report
    assert adm.work_ahead() == 50
    first.close()
    second.close()
    assert adm.work_ahead() == 0  # both finished before the next report
    adm.update_view({"a": replica(debt=0, live=0, stats_time=100.3)})
    assert adm.work_ahead() == 0


def test_the_log_says_why_it_refuses_once_and_then_every_ten_seconds_at_most(caplog):
    now = [100.0]
    adm = controller(slo_latency_s=5.0, min_replicas=1, clock=lambda: now[0])
    adm.update_view({"a": replica(debt=5000, live=200)})
    with caplog.at_level("WARNING", logger="cluster.admission"):
        for _ in range(3):
            assert not admit(adm, 20).admitted
        now[0] += REFUSAL_LOG_EVERY_S - 0.5
        assert not admit(adm, 20).admitted
        now[0] += 1.0
        assert not admit(adm, 20).admitted
    [first, later] = [r.getMessage() for r in caplog.records]
    assert first.startswith("refusing: predicted ") and "work ahead 5000 + this request 20" in first
    assert "over 0.8 x the SLO 5 s;" in first  # the limit the decision used
    assert "c0 7.00 ms c1 2.000 ms" in first and "from 1 replica report(s)" in first
    assert later.startswith("refusing (4 in the last 10 s): predicted ")


def test_requests_in_flight_here_set_the_batch_where_a_report_does_not_show_them_yet():
    """Twelve requests admitted here, then a report taken before they reached the replica
    (no live request, no debt): the queue runs at their batch, not at one row. Seen from
    a fresh cluster, where twelve closed-loop clients were refused at a batch-1 drain rate."""
    now = [100.0]
    adm = controller(slo_latency_s=5.0, min_replicas=1, clock=lambda: now[0])
    adm.update_view({"a": replica(stats_time=99.0)})
    charges = [admit(adm, 50) for _ in range(12)]
    assert all(c.admitted for c in charges)
    now[0] = 100.5
    adm.update_view({"a": replica(debt=0, live=0, stats_time=100.4)})  # taken after the admissions
    assert adm.work_ahead() == 12 * 50  # this ingress's own charges: the report does not count them yet
    assert (12 * 50 + 50) * (C0 + C1) > SLO_HEADROOM * 5.0  # at one row a step, it would be refused
    assert adm._queue()[1] == 13  # the twelve and the next
    last = adm.try_admit(50)
    assert last.admitted
    for decision in charges:
        decision.charge.close()
    adm.update_view({"a": replica(debt=0, live=0, stats_time=101.0)})
    assert adm._queue()[1] == 2  # the last one is still in flight here, and the next
    last.charge.close()
    assert adm._queue()[1] == 1
