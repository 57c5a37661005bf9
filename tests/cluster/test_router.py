"""Prefix affinity in the router: where a prompt's longest prefix went, and when the drain
time lets the request follow it."""

import subprocess
import sys

from cluster.router import PrefixMemory, affinity_first, holders_first, ranks_for_serve
from replicas.prefix_cache import page_hashes


def test_page_hashes_follow_the_prefix_and_agree_between_processes():
    a = page_hashes(list(range(100)), 16)
    b = page_hashes(list(range(40)) + [7] * 60, 16)
    assert len(a) == 6 and a[:2] == b[:2] and a[2] != b[2]  # the third page differs (ids 32-47)
    assert page_hashes(list(range(15)), 16) == ()  # no whole page
    code = "from replicas.prefix_cache import page_hashes; print(page_hashes(list(range(100)), 16))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other.strip() == str(a)


def test_the_longest_prefix_sent_names_its_replica_and_the_oldest_is_forgotten_first():
    memory = PrefixMemory(capacity=4)
    system = page_hashes(list(range(64)), 16)
    memory.record(system[:2], "r1")
    memory.record(system, "r2")
    assert memory.holder(system) == "r2" and memory.holder(system[:1]) == "r2"
    memory.record(page_hashes([9] * 32, 16), "r3")  # two pages more: the two oldest go
    assert memory.holder(system[:2]) is None and memory.holder(system) == "r2"
    assert memory.holder(()) is None
    assert memory.known_pages(system) == 4 and memory.known_pages(system[:3]) == 3
    assert memory.known_pages(page_hashes([5] * 48, 16)) == 0 and memory.known_pages(()) == 0


def test_the_holder_goes_first_unless_it_drains_too_late():
    fresh = [(2.0, "r1", "one"), (0.5, "r2", "two"), (1.2, "r3", "three")]
    assert affinity_first(fresh, None, 0.5) == ["two", "three", "one"]
    assert affinity_first(fresh, "r3", 0.8) == ["three", "two", "one"]  # 1.2 s <= 0.5 + 0.8
    assert affinity_first(fresh, "r1", 0.8) == ["two", "three", "one"]  # 2.0 s: too late
    assert affinity_first(fresh, "r3", 0.0) == ["two", "three", "one"]
    assert affinity_first(fresh, "gone", 9.0) == ["two", "three", "one"]


def test_a_failing_replica_is_offered_only_when_no_other_is_up():
    assert ranks_for_serve(["a", "b"], ["s"], ["f"]) == [["a"], ["b"], ["s"]]
    assert ranks_for_serve([], ["s1", "s2"], ["f"]) == [["s1", "s2"]]
    assert ranks_for_serve([], [], ["f1", "f2"]) == [["f1", "f2"]]  # rather than nowhere
    assert ranks_for_serve([], [], []) == []


def test_replicas_holding_the_adapter_go_first_when_they_drain_nearly_as_soon():
    ranked = [(0.5, "two"), (1.2, "three"), (4.0, "one")]
    holds = {"three", "one"}.__contains__
    assert holders_first(ranked, holds, 2.0) == ["three", "two", "one"]  # 1.2 s <= 0.5 + 2; 4.0 s too late
    assert holders_first(ranked, holds, 5.0) == ["three", "one", "two"]
    assert holders_first(ranked, holds, 0.5) == ["two", "three", "one"]
    assert holders_first(ranked, lambda replica: False, 9.0) == ["two", "three", "one"]
