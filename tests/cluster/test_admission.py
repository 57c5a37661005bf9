"""Step-aware admission: cost, capacity, Retry-After, release."""

import gc

from cluster.admission import AdmissionController, Charge
from cluster.config import AdmissionSettings


def controller(**settings):
    return AdmissionController(AdmissionSettings(**settings), slo_latency_s=10.0, min_replicas=2)


def test_capacity_from_configured_debt_bound():
    adm = controller(max_step_debt_per_replica=1000)
    assert adm.capacity() == 2000
    assert adm.try_admit(1500).admitted
    assert adm.try_admit(500).admitted
    refused = adm.try_admit(100)
    assert not refused.admitted
    # 100 row-steps over capacity at 2 x 500 row-steps/s -> at least 1 s
    assert refused.retry_after_s == 1
    adm.release(600)
    assert adm.try_admit(100).admitted


def test_capacity_from_measured_rates_and_slo():
    adm = controller()
    adm.update_view({"a": {"row_steps_per_s": 300.0, "age_s": 0.1},
                     "b": {"row_steps_per_s": 100.0, "age_s": 0.2},
                     "stale": {"row_steps_per_s": 1e6, "age_s": 60.0}})
    assert adm.capacity() == 400.0 * 10.0
    assert adm.try_admit(3000).admitted
    refused = adm.try_admit(3000)
    assert not refused.admitted and refused.retry_after_s == 5  # 2000 excess / 400 per s


def test_idle_cluster_admits_even_an_oversized_request():
    adm = controller(max_step_debt_per_replica=10)
    assert adm.try_admit(10_000).admitted
    assert not adm.try_admit(1).admitted


def test_cost_uses_quantile_of_measured_steps():
    adm = controller(cost_quantile=0.9)
    assert adm.cost(max_tokens=64, block_length=16, worst_case_steps_per_block=17) == 68  # nothing measured yet
    adm.update_view({"a": {"steps_per_block": {"2": 80, "5": 15, "9": 5}, "age_s": 0}})
    assert adm.cost(max_tokens=64, block_length=16, worst_case_steps_per_block=17) == 20  # p90 = 5 steps
    assert adm.cost(max_tokens=49, block_length=16, worst_case_steps_per_block=3) == 12  # 4 blocks, capped at 3


def test_disabled_admission_admits_everything():
    adm = controller(enabled=False, max_step_debt_per_replica=1)
    assert all(adm.try_admit(100).admitted for _ in range(10))


def test_charge_releases_progressively_and_once():
    adm = controller(max_step_debt_per_replica=1000)
    adm.try_admit(100)
    charge = Charge(adm, 100)
    charge.progress(30)
    assert adm.outstanding == 70
    charge.progress(250)  # never more than the cost
    assert adm.outstanding == 0
    charge.close()
    assert adm.outstanding == 0


def test_unstreamed_charge_is_released_when_dropped():
    adm = controller(max_step_debt_per_replica=1000)
    adm.try_admit(100)
    charge = Charge(adm, 100)
    del charge
    gc.collect()
    assert adm.outstanding == 0
