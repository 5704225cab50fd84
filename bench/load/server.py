"""The verifier under load: one `python -m verifier serve` subprocess on loopback, as a user runs
it (port 0, the "listening on" line says which), and its resident memory from /proc."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LISTENING = re.compile(r"listening on (\S+)")


class ServerProcess:
    def __init__(self, model_dir: Path, *, device: str, dtype: str, n_slots: int | None = None,
                 max_seq_len: int | None = None, max_k: int | None = None, max_batch_rows: int | None = None,
                 extra_args: tuple[str, ...] = (), start_timeout_s: float = 300.0):
        """A size left None takes the server's own default; `extra_args` go on its command line as they are
        (a flag a bench needs, such as --no-goodput)."""
        sizes = {"--n-slots": n_slots, "--max-seq-len": max_seq_len, "--max-k": max_k, "--max-batch-rows": max_batch_rows}
        command = [sys.executable, "-m", "verifier", "serve", "--model", str(model_dir), "--port", "0",
                   "--device", device, "--dtype", dtype, "--grace-s", "5", *extra_args]
        for flag, value in sizes.items():
            if value is not None:
                command += [flag, str(value)]
        self.proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.address: str | None = None
        listening = threading.Event()

        def read() -> None:  # keep draining stderr so the server never blocks on a full pipe
            for line in self.proc.stderr:
                self.lines.append(line)
                found = LISTENING.search(line)
                if found and self.address is None:
                    self.address = found.group(1)
                    listening.set()
            listening.set()  # the process ended: wake the waiter

        self._reader = threading.Thread(target=read, daemon=True, name="verifier-stderr")
        self._reader.start()
        if not listening.wait(start_timeout_s) or self.address is None:
            self.stop()
            raise RuntimeError(f"the verifier did not start listening within {start_timeout_s} s:\n{self.log()}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_mib(self) -> float:
        return rss_mib(self.pid)

    def log(self) -> str:
        return "".join(self.lines[-40:])

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (graceful: drain, finish in-flight steps) and wait; kill only if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=10)
        return self.proc.returncode


def rss_mib(pid: int) -> float:
    """Resident set size of a process (VmRSS in /proc/PID/status), MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS line")
