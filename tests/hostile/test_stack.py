"""Hostile values of kubernetes.stack: each is refused with one clear event naming the key and
its line, exit 2, by every command that reads the agent config, and every file as it was."""

from __future__ import annotations

import pytest

from conftest import HostFactory, with_runtime_binary
from hostile.support import Cli, check_refusal

AGENT_CONFIG = "etc/gpunode/config.toml"

# The [kubernetes] body → the refusal it must give.
BAD_STACKS: dict[str, tuple[str, str]] = {
    "underscore": ('stack = "gpu_operator"',
                   r"kubernetes\.stack.*must be one of gpunode, gpu-operator"),
    "capitals": ('stack = "GPU-Operator"', r"kubernetes\.stack.*must be one of gpunode"),
    "empty": ('stack = ""', r"kubernetes\.stack.*must be one of gpunode"),
    "padded": ('stack = " gpunode"', r"kubernetes\.stack.*must be one of gpunode"),
    "a-boolean": ("stack = true", r"kubernetes\.stack.*must be a string, not a boolean"),
    "an-integer": ("stack = 1", r"kubernetes\.stack.*must be a string, not an integer"),
    "an-array": ('stack = ["gpunode", "gpu-operator"]',
                 r"kubernetes\.stack.*must be a string, not an array"),
    "a-table": ('stack = { name = "gpu-operator" }',
                r"kubernetes\.stack.*must be a string, not a table"),
}
COMMANDS = {"label-dry-run": ["label", "--dry-run"], "boot": ["boot"], "status": ["status"]}


@pytest.mark.parametrize("command", COMMANDS, ids=COMMANDS.keys())
@pytest.mark.parametrize("case", BAD_STACKS, ids=BAD_STACKS.keys())
def test_a_bad_stack_is_refused_naming_key_and_line(
    make_host: HostFactory, cli: Cli, case: str, command: str,
) -> None:
    body, pattern = BAD_STACKS[case]
    root = with_runtime_binary(make_host("nc4as-t4-v3", "ready")).root
    (root / AGENT_CONFIG).parent.mkdir(parents=True, exist_ok=True)
    (root / AGENT_CONFIG).write_text(f'[kubernetes]\nnode_name = "n"\n{body}\n')
    result = check_refusal(cli, root, ["--root", str(root), *COMMANDS[command]], 2, pattern)
    assert "config.toml:3: key 'kubernetes.stack'" in result.err
