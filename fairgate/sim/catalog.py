"""The workloads ``fairgate simulate --workload`` names: the built-ins (sim/builtin.py), the FairServe-like
scenarios (sim/scenarios.py), or a YAML file (sim/workload.py reads it)."""

from __future__ import annotations

from pathlib import Path

import yaml

from fairgate.sim.builtin import BUILTIN
from fairgate.sim.scenarios import SCENARIOS
from fairgate.sim.workload import Workload, WorkloadError, from_dict


def builtin_names() -> list[str]:
    """The built-in workloads and scenarios, by name."""
    return sorted([*BUILTIN, *SCENARIOS])


def load(spec: str) -> Workload:
    """A YAML file, or the name of a built-in workload."""
    if spec in BUILTIN:
        return from_dict(BUILTIN[spec], spec)
    if spec in SCENARIOS:
        return SCENARIOS[spec]()
    path = Path(spec)
    if not path.exists():
        raise WorkloadError(f"no workload file {spec!r} and no built-in of that name; built-ins: "
                            f"{', '.join(builtin_names())}")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise WorkloadError(f"{spec}: a workload is a mapping")
    return from_dict(data, path.stem, path.parent)
