"""KEY=VALUE files are read one way (gpunode/platform/envfile.py), whoever reads them: os-release
and Flatcar's release files, systemd EnvironmentFile= files, the kubelet's kubeadm-flags.env."""

from __future__ import annotations

from gpunode.platform import envfile

TEXT = """# a comment
; a systemd comment
  NAME = "Flatcar Container Linux by Kinvolk"
ID=flatcar
EMPTY=
QUOTED='single'
MISMATCHED="open'
no equals sign here
=no key
ID=flatcar-again
"""


def test_assignments_skip_comments_and_lines_without_a_key_and_keep_line_numbers() -> None:
    assert list(envfile.assignments(TEXT)) == [
        (3, "NAME", "Flatcar Container Linux by Kinvolk"), (4, "ID", "flatcar"),
        (5, "EMPTY", ""), (6, "QUOTED", "single"), (7, "MISMATCHED", "\"open'"),
        (10, "ID", "flatcar-again")]


def test_a_key_assigned_twice_keeps_its_last_value() -> None:
    assert envfile.values(TEXT)["ID"] == "flatcar-again"


def test_only_one_pair_of_matching_quotes_around_the_whole_value_is_removed() -> None:
    assert envfile.values("""ARGS="--a 'b c'"\n""") == {"ARGS": "--a 'b c'"}
