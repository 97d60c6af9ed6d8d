"""What the README tells a newcomer about the four clients matches what the tests run
(``ocache.toolchain.clients``): each npm package with its pinned version, the node version Claude
Code needs, and the variables that keep opencode and pi offline (``isolated_env``). Before, the
README named only Claude Code's and Codex's packages and no offline variable."""

from __future__ import annotations

import re
from pathlib import Path

from ocache.toolchain import clients

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")


def test_the_readme_names_each_clients_npm_package_and_pinned_version():
    for c in (clients.OPENCODE, clients.PI, clients.CLAUDE, clients.CODEX):
        assert f"npm `{c.package}`, tested {c.version}" in README, c.spec
    assert (f"npm `{clients.CLAUDE.package}`, tested {clients.CLAUDE.version}, needs node "
            f"≥ {clients.CLAUDE_NODE_MIN}") in README


def test_the_readme_gives_the_offline_variables_the_tests_set(tmp_path):
    env = clients.isolated_env(tmp_path)
    for prefix in ("OPENCODE_", "PI_"):
        wanted = {f"{k}={v}" for k, v in env.items() if k.startswith(prefix) and v == "1"}
        assert wanted, prefix
        line = next(ln for ln in README.splitlines() if f"`{prefix}" in ln)
        given = set(re.findall(rf"{prefix}\w+=\w+", line))
        assert wanted <= given, (prefix, wanted - given)
