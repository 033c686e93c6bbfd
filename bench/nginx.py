"""A throwaway nginx (Debian's /usr/sbin/nginx) serving a directory on a loopback port,
optionally throttling each response with `limit_rate` the way S3 limits each connection.

Used by the weight-origin tests and the weights benchmark:

    with NginxServer(root=models_dir, work_dir=tmp, limit_rate=8 << 20) as nginx:
        fetch(f"{nginx.url}/model.safetensors")
        records = nginx.access_records()   # one per request: range, status, bytes sent

How nginx's `limit_rate` throttles (measured with nginx 1.22 here): each response may
send its first `limit_rate` bytes at once, and is paced only after that, so a
response of S bytes takes about max(0, S / limit_rate - 1) s (2 MiB at 512 KiB/s: 3 s;
256 KiB at 512 KiB/s: at once). It models a per-connection limit faithfully only for
responses many times larger than `limit_rate`: size ranges (and rates) accordingly.

Everything nginx writes (conf, pid, logs, temp dirs) lives under `work_dir`; it runs as
a foreground child (`daemon off`), also as root (workers keep the caller's user so they
can read files the caller can read), and `stop()` shuts it down gracefully.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from meridian.ports import free_port

NGINX_BIN = "/usr/sbin/nginx"
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0

# The access log format: one request per line, fields separated by spaces, quoted
# fields with nginx's own escaping of '"' (\x22), so the quotes always delimit.
#   $msec $status "$request" "$http_range" $body_bytes_sent $bytes_sent
#   $request_time $connection $connection_requests
LOG_FORMAT = (
    '$msec $status "$request" "$http_range" $body_bytes_sent $bytes_sent '
    "$request_time $connection $connection_requests"
)
_LINE = re.compile(
    r'^(?P<msec>[\d.]+) (?P<status>\d{3}) "(?P<request>[^"]*)" "(?P<range>[^"]*)" '
    r"(?P<body>\d+) (?P<sent>\d+) (?P<rtime>[\d.]+) (?P<conn>\d+) (?P<conn_requests>\d+)$"
)
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
# stub_status page (not in the access log): how many responses are being written.
STATUS_PATH = "/__nginx_status"
_WRITING = re.compile(r"Writing: (\d+)")


def nginx_available(binary: str = NGINX_BIN) -> bool:
    """Whether the nginx binary exists and runs."""
    if not os.access(binary, os.X_OK):
        return False
    try:
        return subprocess.run([binary, "-v"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass(frozen=True)
class AccessRecord:
    """One request from nginx's access log."""

    time: float  # end of the request, seconds since the epoch ($msec)
    method: str
    path: str
    status: int
    # The requested Range as [range_start, range_end) like WeightOrigin.read_range;
    # None without a Range header. range_end is None for an open range ("bytes=N-").
    range_start: int | None
    range_end: int | None
    # Bytes handed to the kernel: a client killed mid-response may have read fewer.
    body_bytes_sent: int
    bytes_sent: int  # with the headers
    request_time: float  # seconds from the first byte read to the last byte sent
    connection: int  # connection serial number: equal numbers mean a reused connection
    connection_requests: int


def parse_access_line(line: str) -> AccessRecord | None:
    """An AccessRecord from one log line in LOG_FORMAT (None if it does not match)."""
    m = _LINE.match(line.rstrip("\n"))
    if not m:
        return None
    method, _, rest = m.group("request").partition(" ")
    path = rest.rsplit(" ", 1)[0] if " " in rest else rest
    start = end = None
    if r := _RANGE.match(m.group("range")):
        start = int(r.group(1))
        end = int(r.group(2)) + 1 if r.group(2) else None
    return AccessRecord(
        time=float(m.group("msec")),
        method=method,
        path=path,
        status=int(m.group("status")),
        range_start=start,
        range_end=end,
        body_bytes_sent=int(m.group("body")),
        bytes_sent=int(m.group("sent")),
        request_time=float(m.group("rtime")),
        connection=int(m.group("conn")),
        connection_requests=int(m.group("conn_requests")),
    )


class NginxServer:
    """nginx serving `root` at http://127.0.0.1:<port>/, throttled per response by
    `limit_rate` bytes/s (None or 0: unthrottled)."""

    def __init__(
        self,
        root: Path,
        work_dir: Path,
        *,
        limit_rate: int | None = None,
        workers: int = 1,
        binary: str = NGINX_BIN,
    ) -> None:
        self.root = Path(root).resolve()
        self.work_dir = Path(work_dir).resolve()
        self.limit_rate = limit_rate or 0
        self.workers = workers
        self.binary = binary
        self.port = 0
        self.conf_path = self.work_dir / "nginx.conf"
        self.pid_path = self.work_dir / "nginx.pid"
        self.access_log = self.work_dir / "access.log"
        self.error_log = self.work_dir / "error.log"
        self.stderr_log = self.work_dir / "stderr.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The master's pid, which is also its process group's (workers included)."""
        return self._process.pid if self._process is not None else None

    def _conf(self) -> str:
        tmp = self.work_dir / "tmp"
        temp_paths = "\n".join(
            f"    {kind}_temp_path {tmp / kind};"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        # As root, nginx would switch its workers to "nobody", who cannot read a
        # private test directory: keep the caller's user instead.
        user = "user root;\n" if os.geteuid() == 0 else ""
        return f"""{user}daemon off;
worker_processes {self.workers};
pid {self.pid_path};
error_log {self.error_log} warn;
events {{
    worker_connections 1024;
}}
http {{
    log_format meridian '{LOG_FORMAT}';
    access_log {self.access_log} meridian;
{temp_paths}
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    keepalive_timeout 65s;
    keepalive_requests 100000;
    server {{
        listen 127.0.0.1:{self.port};
        root {self.root};
        location / {{
            limit_rate {self.limit_rate};
            limit_rate_after 0;
        }}
        location = {STATUS_PATH} {{
            stub_status;
            access_log off;
        }}
    }}
}}
"""

    def start(self) -> NginxServer:
        """Start nginx and wait until it accepts connections."""
        if self._process is not None:
            raise RuntimeError("nginx is already running")
        if not nginx_available(self.binary):
            raise FileNotFoundError(f"nginx not found at {self.binary}")
        (self.work_dir / "tmp").mkdir(parents=True, exist_ok=True)
        # A free port can be taken between choosing and binding it: try a few.
        last_error = ""
        for _ in range(5):
            self.port = free_port()
            self.conf_path.write_text(self._conf())
            # A file, not a pipe: nobody would drain a pipe while nginx runs.
            with open(self.stderr_log, "wb") as stderr:
                self._process = subprocess.Popen(
                    [
                        self.binary,
                        "-p",
                        str(self.work_dir),
                        "-e",
                        str(self.error_log),
                        "-c",
                        str(self.conf_path),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                    # Its own process group: benches read its CPU (master and workers) by group.
                    start_new_session=True,
                )
            if self._wait_ready():
                return self
            self._process.wait(timeout=STOP_TIMEOUT_S)
            self._process = None
            last_error = "\n".join(
                p.read_text(errors="replace").strip() for p in (self.stderr_log, self.error_log) if p.exists()
            )
            if "Address already in use" not in last_error:
                break
        raise RuntimeError(f"nginx did not start: {last_error}")

    def _wait_ready(self) -> bool:
        assert self._process is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return True
            except OSError:
                time.sleep(0.02)
        self._process.kill()
        return False

    def stop(self) -> None:
        """Shut nginx down (gracefully, then by force)."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGQUIT)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT_S)

    def access_records(self) -> list[AccessRecord]:
        """Every request logged so far, oldest first."""
        if not self.access_log.exists():
            return []
        with open(self.access_log, encoding="utf-8", errors="replace") as f:
            return [r for line in f if (r := parse_access_line(line)) is not None]

    def wait_for_records(self, count: int, timeout_s: float = 5.0) -> list[AccessRecord]:
        """The logged requests once there are at least `count` (nginx logs a request
        just after its last byte is sent, so a client can be a moment ahead)."""
        deadline = time.monotonic() + timeout_s
        while len(records := self.access_records()) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return records

    def writing(self) -> int:
        """Responses nginx is writing now, other than the status request asking."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as conn:
            conn.sendall(f"GET {STATUS_PATH} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
            answer = b""
            while chunk := conn.recv(4096):
                answer += chunk
        m = _WRITING.search(answer.decode(errors="replace"))
        if not m:
            raise RuntimeError(f"nginx status page unreadable: {answer[:200]!r}")
        return int(m.group(1)) - 1

    def wait_idle(self, timeout_s: float = 10.0) -> list[AccessRecord]:
        """Wait until nginx writes no response, then return the access log: a request
        whose client died (a killed process) is logged only once nginx notices, which
        under limit_rate can be a second later."""
        deadline = time.monotonic() + timeout_s
        while self.writing() > 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nginx still writing {self.writing()} responses after {timeout_s} s")
            time.sleep(0.02)
        return self.access_records()

    def __enter__(self) -> NginxServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
