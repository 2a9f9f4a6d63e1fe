"""What ships for deployment holds together: the Helm chart renders (with Go's text/template, as Helm does —
the chart uses no sprig function, so this is Helm's output up to whitespace) into a Deployment probed on
/ready and /health, a migration hook, a Service, a ServiceMonitor and an HPA that name each other; the
Grafana dashboard plots only series the gateway exports; docker-compose mounts files that exist."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "fairgate"
RENDER = """
import sys
from go_template.wrapper import render_template
render_template(sys.argv[1], sys.argv[2], sys.argv[3])
"""


def render(tmp_path: Path, **values) -> dict[str, dict]:
    """Every manifest the chart renders with its values.yaml updated by ``values``, by kind."""
    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    for key, value in values.items():
        merged[key] = {**merged[key], **value} if isinstance(value, dict) else value
    context = tmp_path / "context.yaml"
    chart = {k[0].upper() + k[1:]: v for k, v in yaml.safe_load((CHART / "Chart.yaml").read_text()).items()}
    context.write_text(yaml.safe_dump({"Values": merged, "Release": {"Name": "prod", "Service": "Helm"},
                                       "Chart": chart}))  # .Chart.AppVersion, as Helm names Chart.yaml's keys
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    out: dict[str, dict] = {}
    for template in sorted((CHART / "templates").glob("*.yaml")):
        source, target = tmp_path / template.name, tmp_path / f"{template.stem}.out"
        source.write_text(helpers + template.read_text())
        p = subprocess.run([sys.executable, "-c", RENDER, str(source), str(context), str(target)],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, f"{template.name}: {p.stdout}{p.stderr}"  # a template error panics
        text = target.read_text()
        assert "<no value>" not in text, f"{template.name} reads a value values.yaml lacks:\n{text}"
        for doc in yaml.safe_load_all(text):
            if doc:
                out[doc["kind"]] = doc
    return out


def test_the_chart_renders_a_coherent_release(tmp_path):
    m = render(tmp_path, serviceMonitor={"enabled": True}, autoscaling={"enabled": True})
    assert set(m) == {"Secret", "Job", "Deployment", "Service", "ServiceMonitor", "HorizontalPodAutoscaler"}
    dep, svc = m["Deployment"], m["Service"]
    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    (gw,) = pod["spec"]["containers"]
    assert gw["command"] == ["fairgate"] and gw["args"][0] == "serve"  # the Dockerfile's CMD is replaced whole
    assert "--backend=http://vllm-0.vllm:8000" in gw["args"]
    assert (gw["readinessProbe"]["httpGet"]["path"], gw["livenessProbe"]["httpGet"]["path"]) == ("/ready", "/health")
    assert "replicas" not in dep["spec"]  # the HPA owns the count
    secret = m["Secret"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in gw["env"]}
    assert set(refs) == {"FAIRGATE_DATABASE_URL", "FAIRGATE_REDIS_URL", "FAIRGATE_OPS_TOKEN"}
    assert all(r["name"] == secret["metadata"]["name"] and r["key"] in secret["stringData"] for r in refs.values())
    job = m["Job"]
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == ["fairgate", "db", "upgrade"]
    hook = lambda d: int(d["metadata"]["annotations"]["helm.sh/hook-weight"])  # noqa: E731
    assert "pre-upgrade" in job["metadata"]["annotations"]["helm.sh/hook"] and hook(secret) < hook(job)
    monitor = m["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert monitor["endpoints"][0]["path"] == "/metrics"
    assert monitor["endpoints"][0]["bearerTokenSecret"] == {"name": secret["metadata"]["name"], "key": "opsToken"}
    assert m["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > 30  # beyond the gateway's drain_s


def test_the_chart_renders_objects_the_kubernetes_api_accepts(tmp_path):
    """Each rendered object validated, strictly (no unknown field), against the API schemas of the oldest and
    newest Kubernetes the schema package knows; the ServiceMonitor is the Prometheus operator's resource,
    which those schemas lack. Pods run as the image's unprivileged user."""
    import kubernetes_validate
    from kubernetes_validate.utils import all_versions

    versions = sorted(set(all_versions()), key=lambda v: tuple(map(int, v.split("."))))
    m = render(tmp_path, serviceMonitor={"enabled": True}, autoscaling={"enabled": True})
    for kind, doc in m.items():
        if kind == "ServiceMonitor":
            continue
        for version in (versions[0], versions[-1]):
            kubernetes_validate.validate(doc, version, strict=True)  # (raises ValidationError naming the field)
    for pod in (m["Deployment"]["spec"]["template"]["spec"], m["Job"]["spec"]["template"]["spec"]):
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001


def test_the_chart_defaults_and_an_existing_secret(tmp_path):
    m = render(tmp_path, secret={"create": False, "name": "fleet-secrets"}, migration={"enabled": False})
    assert set(m) == {"Deployment", "Service"}
    env = m["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in env} == {"fleet-secrets"}
    assert m["Deployment"]["spec"]["replicas"] == 2


async def test_the_dashboard_plots_series_the_gateway_exports(gw):
    """Every fairgate_ series a panel queries is one /metrics serves (after a request, so all exist)."""
    client = gw.client(await gw.key("chat", user="ann"))
    await client.chat.completions.create(model="sim-llama", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=2)
    gw.gateway.config.metrics_public = True
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        exported = set(re.findall(r"^(fairgate_\w+?)(?:\{| )", await r.text(), re.M))
    exported |= {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported}
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "fairgate.json").read_text())
    queried = {n for p in dashboard["panels"] for t in p.get("targets", ())
               for n in re.findall(r"fairgate_\w+", t["expr"])}
    assert queried and queried <= exported | {"fairgate_rate_limited_total"}, queried - exported
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("fairness", "throughput", "latency", "throttle"):
        assert topic in titles


def test_compose_mounts_what_the_repository_has():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = [v.split(":")[0] for s in compose["services"].values() for v in s.get("volumes", ())]
    assert mounts and all((ROOT / m).exists() for m in mounts), mounts
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yaml").read_text())
    token = compose["x-fairgate"]["environment"]["FAIRGATE_OPS_TOKEN"]
    assert prom["scrape_configs"][0]["authorization"]["credentials"] == token

