"""API keys: read from the environment and a file, matched in constant time, limited per key."""

import pytest

from cluster.auth import API_KEYS_ENV, KeyConfigError, KeyRing, load_keys


def test_keys_come_from_the_environment_and_the_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# clients\nalpha-key-1 2\n\nbeta-key-22   # no limit\n")
    keys = load_keys(path, {API_KEYS_ENV: "env-key-333, env-key-4444 1"})
    assert [(k.name, k.max_concurrent) for k in keys] == [
        ("key 1", None), ("key 2", 1), ("key 3", 2), ("key 4", None)]
    ring = KeyRing(keys)
    assert ring.match("Bearer alpha-key-1").name == "key 3"
    assert ring.match("bearer env-key-333").name == "key 1"
    for wrong in (None, "", "Bearer", "Bearer alpha-key-", "Basic alpha-key-1", "alpha-key-1"):
        assert ring.match(wrong) is None


def test_no_keys_means_no_key_required():
    assert not KeyRing(load_keys(None, {})).required


@pytest.mark.parametrize("text, message", [
    ("short", "at least 8"), ("long-enough-key 0", "MAX_CONCURRENT"), ("long-enough-key 2 3", "KEY MAX_CONCURRENT"),
    ("# only a comment\n", "holds no key")])
def test_bad_key_files_are_refused_without_echoing_the_key(tmp_path, text, message):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(KeyConfigError, match=message) as refused:
        load_keys(path, {})
    key = text.split()[0]
    assert key.startswith("#") or key not in str(refused.value)


def test_a_missing_key_file_is_refused(tmp_path):
    with pytest.raises(KeyConfigError, match="cannot read"):
        load_keys(tmp_path / "absent", {})


def test_per_key_concurrency_limit():
    ring = KeyRing(load_keys(None, {API_KEYS_ENV: "limited-key 2,free-key-00"}))
    limited, free = ring.keys
    first, second = ring.acquire(limited), ring.acquire(limited)
    assert first and second and ring.acquire(limited) is None
    first.release()
    first.release()  # idempotent
    assert ring.in_flight["key 1"] == 1
    third = ring.acquire(limited)
    del second  # a slot nobody released frees its place when collected
    assert third and ring.in_flight["key 1"] == 1
    assert all(ring.acquire(free) for _ in range(100))
    assert ring.acquire(None) is not None  # no key required: never limited
