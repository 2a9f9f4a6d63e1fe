"""The CLI explains itself: every command and option has a one-line help, choices and defaults are listed, no
type placeholders, -h and --version work."""

from __future__ import annotations

import subprocess
import sys

from fairgate.cli.main import command


def _walk(cmd, path=("fairgate",)):
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _walk(sub, (*path, name))


def test_every_command_and_option_has_help():
    missing = []
    for path, cmd in _walk(command()):
        if not (cmd.help or "").strip():
            missing.append(" ".join(path))
        for p in cmd.params:
            if p.param_type_name == "option" and not p.hidden and not (p.help or "").strip():
                missing.append(f"{' '.join(path)} {p.opts[0]}")
            if p.param_type_name == "argument" and not (getattr(p, "help", None) or "").strip():
                missing.append(f"{' '.join(path)} <{p.name}>")
    assert not missing, "no help: " + ", ".join(missing)


def _fg(*args: str) -> str:
    p = subprocess.run([sys.executable, "-m", "fairgate.cli.main", *args], capture_output=True, text=True,
                       timeout=60, env={"COLUMNS": "200", "PATH": ""})
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_help_lists_choices_and_defaults_without_placeholders():
    serve = _fg("serve", "-h")
    assert "<bool>" not in serve and "<str>" not in serve and "<int>" not in serve
    assert "dlpm" in serve and "least-load" in serve and "(default: vtc)" in serve and "json" in serve
    assert "fairserve_small" in _fg("simulate", "--help")  # the built-in workloads are listed
    for words in (("usage", "summary"), ("admin", "app", "allow"), ("admin", "fairserve", "unset")):
        assert "<" not in _fg(*words, "-h"), words  # arguments and choice lists too
    assert _fg("--version").startswith("fairgate ")
