"""Docker for `make test-deploy`: the engine, a compose and debootstrap installed from Debian's packages if
missing, a daemon started if none answers, and stand-ins for the images `Dockerfile` and `docker-compose.yml`
name (tests/stand-ins/README.md), built from Debian's packages and cached between runs.

A stand-in is tagged with the name the files use, so they stay exactly what a user runs with the real images;
an image of that name without the stand-in label (the real one, pulled) is left alone and used. Builds run on
the host's network: the registries are reached through the machine's resolver and CA bundle.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAND_INS_DIR = Path(__file__).resolve().parent / "stand-ins"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fairgate" / "stand-ins"
BASE = "fairgate-stand-in/bookworm"  # a debootstrap --variant=minbase root, the stand-ins' FROM
LABEL = "fairgate.stand-in"  # on every stand-in: the digest of its build context
STAND_INS = {"python:3.11-slim": "python", "postgres:16": "postgres", "redis:7": "redis",
             "prom/prometheus:v2.53.0": "prometheus"}
LEFT_OUT = {"grafana/grafana:11.1.0": "Debian packages no Grafana, so no stand-in can be built here"}
MIRROR = "http://deb.debian.org/debian"
MACHINE_CA = Path("/etc/ssl/certs/ca-certificates.crt")
IMAGE = "fairgate:dev"


def run(*cmd: str, timeout: float = 900, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """``cmd`` with its output captured; a failure raises with what it printed."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def compose_command() -> list[str] | None:
    """`docker compose` (the v2 plugin) if there is one, else `docker-compose` (Debian's 1.29)."""
    if shutil.which("docker") and run("docker", "compose", "version", check=False, timeout=30).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def install_packages() -> None:
    """docker.io, docker-compose and debootstrap from Debian, for what is missing."""
    wanted = [pkg for tool, pkg in (("dockerd", "docker.io"), ("debootstrap", "debootstrap")) if not shutil.which(tool)]
    if compose_command() is None:
        wanted.append("docker-compose")
    if not shutil.which("docker"):
        wanted.append("docker.io")
    if wanted:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        run("apt-get", "update", "-q", env=env)
        run("apt-get", "install", "-y", "-q", "--no-install-recommends", *sorted(set(wanted)), env=env)


@contextlib.contextmanager
def daemon() -> Iterator[None]:
    """A Docker daemon: the running one, else one started here (and stopped on the way out)."""
    if run("docker", "info", check=False, timeout=30).returncode == 0:
        yield
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "dockerd.log", "ab") as log:
        proc = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while run("docker", "info", check=False, timeout=30).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dockerd did not start (exit {proc.poll()}); see {CACHE / 'dockerd.log'}")
            time.sleep(1)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _image_label(image: str) -> str | None:
    """The image's stand-in label ('' if it has none), or None if there is no such image."""
    done = run("docker", "image", "inspect", "-f", f'{{{{index .Config.Labels "{LABEL}"}}}}', image, check=False)
    return done.stdout.strip().replace("<no value>", "") if done.returncode == 0 else None


def base_image() -> None:
    """The Debian root every stand-in starts from: debootstrap's minbase of bookworm, its tarball cached."""
    if _image_label(BASE) is not None:
        return
    tarball = CACHE / "bookworm-minbase.tar"
    if not tarball.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="fairgate-debootstrap-") as root:
            run("debootstrap", "--variant=minbase", "bookworm", root, MIRROR, timeout=1800)
            run("tar", "-C", root, "-cf", f"{tarball}.part", ".")
        os.replace(f"{tarball}.part", tarball)
    run("docker", "import", str(tarball), BASE)


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(MACHINE_CA.read_bytes() if MACHINE_CA.exists() else b"")
    return h.hexdigest()[:16]


def stand_ins() -> list[str]:
    """Build (or keep) a stand-in for each image of ``STAND_INS``; returns the ones built now."""
    built = []
    for image, folder in STAND_INS.items():
        context, digest = STAND_INS_DIR / folder, _digest(STAND_INS_DIR / folder)
        label = _image_label(image)
        if label == digest or label == "":  # this stand-in already, or the real image: kept
            continue
        base_image()
        with tempfile.TemporaryDirectory(prefix="fairgate-stand-in-") as tmp:
            shutil.copytree(context, tmp, dirs_exist_ok=True)
            shutil.copyfile(MACHINE_CA, Path(tmp) / "machine-ca.crt")
            run("docker", "build", "--network", "host", "--label", f"{LABEL}={digest}", "-t", image, tmp)
        built.append(image)
    return built


def build_image() -> None:
    """The project's own image, from its Dockerfile as a user builds it (on the host's network)."""
    run("docker", "build", "--network", "host", "-t", IMAGE, str(ROOT), timeout=1800)


def image_size_mb(image: str = IMAGE) -> float:
    return int(run("docker", "image", "inspect", "-f", "{{.Size}}", image).stdout) / 1e6
