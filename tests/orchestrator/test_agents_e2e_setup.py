"""`make e2e-agents`' choice of Node: the agents are tested at the version users get."""

import json

from tests.orchestrator.agents_e2e import installed_version, node_major_needed


def test_a_newer_node_is_fetched_only_where_no_alternative_admits_this_one():
    assert node_major_needed(">=22.0.0", (20, 20, 2)) == 22  # Claude Code since 2.1.198
    assert node_major_needed(">=18.0.0", (20, 20, 2)) is None
    assert node_major_needed(">=16", (22, 1, 0)) is None
    assert node_major_needed("^20.19.0 || >=22.12.0", (20, 18, 0)) == 20  # a later 20.x
    assert node_major_needed("^20.19.0 || >=22.12.0", (20, 19, 0)) is None
    assert node_major_needed("", (20, 20, 2)) is None  # no engines field: any node


def test_the_installed_version_is_read_for_scoped_and_pinned_specs(tmp_path):
    for name, version in (("@openai/codex", "0.171.0"), ("opencode-ai", "1.18.33")):
        manifest = tmp_path / "node_modules" / name / "package.json"
        manifest.parent.mkdir(parents=True)
        manifest.write_text(json.dumps({"name": name, "version": version}))
    assert installed_version(tmp_path, "@openai/codex@0.171") == "0.171.0"
    assert installed_version(tmp_path, "opencode-ai@1.18") == "1.18.33"
    assert installed_version(tmp_path, "opencode-ai") == "1.18.33"
    assert installed_version(tmp_path, "@anthropic-ai/claude-code") == ""  # not installed
