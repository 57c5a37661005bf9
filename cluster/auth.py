"""API keys: where they come from, how a presented key is checked, per-key concurrency.

Keys never travel in the application's arguments or on a command line: each ingress
replica reads them itself, from the environment variable ``DLLM_API_KEYS`` (entries
separated by commas; on Kubernetes from a Secret) and from the file named by
``api_key_file`` (one entry per line, ``#`` starts a comment). An entry is ``KEY`` or
``KEY MAX_CONCURRENT``: the key may then have at most that many requests in flight on
one ingress replica. Keys are kept as SHA-256 digests and compared in constant time;
logs name a key by its position (``key 2``), never by its value.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

API_KEYS_ENV = "DLLM_API_KEYS"


class KeyConfigError(ValueError):
    """Keys that cannot be used; the message says where, never the key itself."""


@dataclass(frozen=True)
class ApiKey:
    name: str  # "key N" in the order read: for logs
    digest: bytes
    max_concurrent: int | None = None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_entries(entries: list[tuple[str, str]], first_index: int = 1) -> list[ApiKey]:
    """``entries``: (where, text) pairs, each ``KEY`` or ``KEY MAX_CONCURRENT``."""
    keys = []
    for index, (where, text) in enumerate(entries, first_index):
        fields = text.split()
        if len(fields) not in (1, 2):
            raise KeyConfigError(f"{where}: expected 'KEY' or 'KEY MAX_CONCURRENT'")
        limit = None
        if len(fields) == 2:
            if not fields[1].isdigit() or int(fields[1]) < 1:
                raise KeyConfigError(f"{where}: MAX_CONCURRENT must be a whole number >= 1")
            limit = int(fields[1])
        if len(fields[0]) < 8:
            raise KeyConfigError(f"{where}: a key must have at least 8 characters")
        keys.append(ApiKey(f"key {index}", _digest(fields[0]), limit))
    return keys


def load_keys(path: str | Path | None = None, environ: Mapping[str, str] = os.environ) -> list[ApiKey]:
    """The keys of ``API_KEYS_ENV``, then those of the file at ``path``; raises KeyConfigError."""
    entries = [(f"{API_KEYS_ENV} entry {i}", text.strip())
               for i, text in enumerate(environ.get(API_KEYS_ENV, "").split(","), 1) if text.strip()]
    if path is not None:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise KeyConfigError(f"cannot read the API key file {path}: {exc.strerror}") from None
        entries += [(f"{path} line {n}", line.split("#", 1)[0].strip())
                    for n, line in enumerate(lines, 1) if line.split("#", 1)[0].strip()]
        if not any(where.startswith(str(path)) for where, _ in entries):
            raise KeyConfigError(f"the API key file {path} holds no key")
    return parse_entries(entries)


class KeyRing:
    """The keys one ingress replica accepts, and each key's requests in flight."""

    def __init__(self, keys: list[ApiKey]):
        self.keys = keys
        self.in_flight: dict[str, int] = {key.name: 0 for key in keys}

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def match(self, authorization: str | None) -> ApiKey | None:
        """The key an ``Authorization: Bearer KEY`` header presents, or None. Every key is
        compared, each in constant time, whatever matches."""
        scheme, _, token = (authorization or "").partition(" ")
        presented = _digest(token.strip() if scheme.lower() == "bearer" else "")
        found = None
        for key in self.keys:
            if hmac.compare_digest(presented, key.digest) and found is None:
                found = key
        return found

    def acquire(self, key: ApiKey | None) -> KeySlot | None:
        """A place for one more request of ``key`` (None: no key required), or None when
        the key is at its limit."""
        if key is not None:
            if key.max_concurrent is not None and self.in_flight[key.name] >= key.max_concurrent:
                return None
            self.in_flight[key.name] += 1
        return KeySlot(self, key)

    def _release(self, key: ApiKey) -> None:
        self.in_flight[key.name] = max(0, self.in_flight[key.name] - 1)


class KeySlot:
    """One request's place under its key's limit. ``release`` is idempotent and also runs
    when the slot is garbage collected (a response never streamed cannot leak it)."""

    def __init__(self, ring: KeyRing, key: ApiKey | None):
        self._ring, self._key = ring, key

    def release(self) -> None:
        key, self._key = self._key, None
        if key is not None:
            self._ring._release(key)

    __del__ = release
