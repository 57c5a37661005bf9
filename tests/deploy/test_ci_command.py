"""The README's test set-up command is exactly what .ci/run runs."""

import re

from observability import ROOT


def test_readme_test_command_is_ci_command():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"Install and run the tests.*?```bash\n(.*?)\n```", readme, flags=re.S).group(1)
    assert ci == [block]
