"""``reference/metrics.md`` from ``fairgate.proxy.control.metrics.GatewayMetrics``: every series' name, type, labels
and help."""

from __future__ import annotations

from gen.text import cell, code


def metrics_page() -> str:
    from fairgate.proxy.control.metrics import GatewayMetrics

    m = GatewayMetrics()
    lines = [
        "# Metrics reference",
        "",
        "!!! note \"Generated\"",
        "    This page is generated when the site is built, from the series `GatewayMetrics` registers",
        "    (`fairgate/proxy/control/metrics.py`). Who may read `/metrics` is in the",
        "    [operations guide](../operations/metrics.md).",
        "",
        "Counters are exposed with the `_total` suffix (Prometheus' convention), histograms as `_bucket`,",
        "`_sum` and `_count`. A `tenant` label is the fairness key for the first 200 tenants and `other`",
        "after them, or a hash of the key with `hash_tenant_labels: true`.",
        "",
        "| series | type | labels | help |",
        "|---|---|---|---|",
    ]
    for metric in vars(m).values():
        if not hasattr(metric, "describe"):
            continue
        for family in metric.describe():
            name = family.name + ("_total" if family.type == "counter" else "")
            labels = ", ".join(code(label) for label in getattr(metric, "_labelnames", ()))
            lines.append(f"| `{name}` | {family.type} | {labels} | {cell(family.documentation)} |")
    lines.append("")
    return "\n".join(lines)
