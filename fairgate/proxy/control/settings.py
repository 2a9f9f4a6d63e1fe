"""The live settings and where each value in force comes from.

One order, lowest first: the embedded **default**, the YAML **file** (``--config`` or $FAIRGATE_CONFIG), the
**environment** ($FAIRGATE_POLICY, …), the **flag** (``serve --policy``), then the **database**: what an admin
stored with ``fairgate admin policy set`` (``locality set``, ``fairserve set``, …) reaches every gateway on the
database within ``settings_refresh_s`` and wins over its configuration, on a running gateway and at every
start, until ``fairgate admin … unset`` removes it and hands the setting back to the file and flags.
"""

from __future__ import annotations

from typing import Any

from fairgate.proxy.config import LOCALITY_SETTINGS, GatewayConfig

_WHOLE = lambda raw: int(float(raw))  # noqa: E731 - "30" and "30.0" both mean 30
# FairServe's settings an admin changes at run time, and how each is read from its SQL string
FAIRSERVE_RUNTIME = {"alpha": float, "beta": float, "gamma": float, "kv_threshold": float, "user_rpm": _WHOLE,
                     "queue_threshold": _WHOLE, "charge": str}
FAIRSERVE_SETTINGS = tuple(FAIRSERVE_RUNTIME)
LIVE_KEYS = ("policy", "placement", *(f"locality.{k}" for k in LOCALITY_SETTINGS),
             *(f"fairserve.{k}" for k in FAIRSERVE_SETTINGS))


def configured(config: GatewayConfig, key: str) -> Any:
    """The configured value of a live setting (``locality.quantum`` → config.locality.quantum)."""
    obj: Any = config
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def effective(config: GatewayConfig, stored: dict[str, str], keys: tuple[str, ...] = LIVE_KEYS) -> list[dict]:
    """Each live setting's value in force on a gateway configured as ``config`` with these database settings:
    ``{"setting", "value", "source"}``, and where the database overrides the configuration, what it overrides
    (``configured``, ``configured_source``)."""
    rows = []
    for key in keys:
        row: dict[str, Any] = {"setting": key, "value": configured(config, key), "source": config.source(key)}
        if key in stored:
            row = {"setting": key, "value": stored[key], "source": "database",
                   "configured": row["value"], "configured_source": row["source"]}
        rows.append(row)
    return rows


def override_message(key: str, value: str, config: GatewayConfig, was: Any) -> str:
    """What a gateway logs when the database's value of ``key`` overrides ``was``, its configured value."""
    return (f"{key} {value} from the database overrides the configured {was} ({config.source(key)}); "
            f"`fairgate admin {_command(key)} unset` hands it back")


def _command(key: str) -> str:
    return {"policy": "policy", "placement": "locality placement"}.get(key, key.split(".")[0])
