"""The README's metrics table and the exporter agree."""

import re
from pathlib import Path

from cluster.metrics import METRICS

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_exported_metric_is_documented_and_nothing_else():
    documented = set(re.findall(r"^\| `(dllm_[a-z_]+)` \|", README.read_text(), flags=re.M))
    exported = {spec.name for spec in METRICS}
    assert documented == exported, (
        f"undocumented: {sorted(exported - documented)}; documented but not exported: {sorted(documented - exported)}")
