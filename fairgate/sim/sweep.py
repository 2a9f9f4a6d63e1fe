"""A parameter sweep drawn as a Pareto plot (claims C1 and C7 of docs/policies/locality.md#checks: DLPM's Q^u
between VTC and LPM, D²LPM's Q^w): throughput at the horizon against Jain's index, one point per value,
beside the schedulers the parameter interpolates between."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

# the references each swept parameter is drawn beside: (label, policy, placement or None for the swept one's)
REFERENCES: dict[str, list[tuple[str, str, str | None]]] = {
    "quantum": [("VTC", "vtc", None), ("LPM", "lpm", None)],  # Q^u → 0 is VTC, Q^u → ∞ is LPM (B7)
    "client_quantum": [("VTC", "vtc", "client-round-robin"), ("RR+LPM", "lpm", "round-robin"),
                       ("Preble", "lpm", "prefix")],
    "window": [("VTC", "vtc", None), ("LPM", "lpm", None)],
    "ratio": [("least-load", "vtc", "least-load")],
}

Run = Callable[[str, str, dict[str, float]], dict[str, Any]]  # (policy, placement, params) → metrics document


def parse(spec: str) -> tuple[str, list[float]]:
    """``NAME=V1,V2,…`` → (NAME, values)."""
    name, eq, values = spec.partition("=")
    try:
        parsed = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        parsed = []
    if not eq or not name.strip() or not parsed:
        raise ValueError(f"--sweep takes NAME=V1,V2,… (numbers), not {spec!r}")
    return name.strip(), parsed


def _point(label: str, doc: dict[str, Any]) -> dict[str, Any]:
    return {"label": label, "throughput_at_horizon_tokens_per_s": doc["throughput_at_horizon_tokens_per_s"],
            "throughput_tokens_per_s": doc["throughput_tokens_per_s"], "jain": doc["fairness"]["jain"],
            "hit_rate": doc["cache"]["hit_rate"]}


def sweep(name: str, values: list[float], policy: str, placement: str, params: dict[str, float],
          run: Run) -> dict[str, Any]:
    points = [_point(f"{name}={v:g}", run(policy, placement, {**params, name: v})) for v in values]
    refs = [_point(label, run(p, pl or placement, {})) for label, p, pl in REFERENCES.get(name, [])]
    return {"parameter": name, "policy": policy, "placement": placement, "points": points, "references": refs}


def write(result: dict[str, Any], directory: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    name = result["parameter"]
    paths = [directory / f"sweep_{name}.json", directory / f"pareto_{name}.png"]
    paths[0].write_text(json.dumps(result, indent=2))
    fig, ax = plt.subplots(figsize=(6, 4.5))
    pts = result["points"]
    ax.plot([p["jain"] for p in pts], [p["throughput_at_horizon_tokens_per_s"] for p in pts], marker="o",
            label=f"{result['policy']} ({name})")
    for p in pts:
        ax.annotate(p["label"].split("=", 1)[1], (p["jain"], p["throughput_at_horizon_tokens_per_s"]), fontsize=7,
                    textcoords="offset points", xytext=(4, 4))
    for r in result["references"]:
        ax.scatter([r["jain"]], [r["throughput_at_horizon_tokens_per_s"]], marker="s", zorder=3)
        ax.annotate(r["label"], (r["jain"], r["throughput_at_horizon_tokens_per_s"]), fontsize=8,
                    textcoords="offset points", xytext=(4, -10))
    ax.set(xlabel="Jain's fairness index", ylabel="throughput at the horizon (tokens/s)", title=title)
    ax.legend(fontsize=7)
    fig.savefig(paths[1], dpi=110, bbox_inches="tight")
    plt.close(fig)
    return paths


def table(result: dict[str, Any]) -> str:
    rows = [*result["points"], *result["references"]]
    lines = [f"{'':>22} {'tokens/s at horizon':>20} {'tokens/s':>10} {'Jain':>6} {'hit rate':>8}"]
    lines += [f"{r['label']:>22} {r['throughput_at_horizon_tokens_per_s']:>20,.0f} {r['throughput_tokens_per_s']:>10,.0f} "
              f"{r['jain']:>6.3f} {r['hit_rate']:>8.2f}" for r in rows]
    return "\n".join(lines)
