"""`baton serve`: router + N prefill + M decode workers, each its own process, on this machine.

Supervised: a process that exits is started again with the same command line (a worker
registers anew under a new id, the router comes back on its port and the workers find it),
after a backoff that doubles while it keeps dying young; the cluster keeps serving meanwhile.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import grpc

from baton import envs
from baton.auth import ENV_TOKEN, ClusterSecret
from baton.auth.grpc_auth import open_channel
from baton.auth.secret import configured_token
from baton.auth.tls import cluster_tls, router_channel_credentials
from baton.config import BatonConfig
from baton.errors import BatonError
from baton.proto_gen import router_pb2, router_pb2_grpc

log = logging.getLogger("baton.serve")

STDERR_FD = 2
"""The process's own fd 2 (not `sys.stderr`, which test runners replace with objects)."""
STOP_GRACE_S = 3.0
"""`stop()` waits this long for SIGTERMed processes, then kills what is left: a stop (and a
SIGTERM to `baton serve`) ends every process within 5 s, however busy they are."""
RESTART_FIRST_S = 0.5
"""Backoff before the first restart of a process that died; doubled for every further death
within STABLE_S of its start, up to RESTART_MAX_S."""
RESTART_MAX_S = 30.0
STABLE_S = 60.0
"""A process that ran this long before dying restarts after RESTART_FIRST_S again."""
SUPERVISE_PERIOD_S = 0.2


PICK_RANGE = (20000, 32768)
"""Ports handed out ahead of a process's start come from below the kernel's ephemeral range
(32768-60999 by default), where nothing else binds by chance: a port 0 picks from that range,
so a port chosen there can be taken by an outgoing connection or another process's port 0
listener before the process it was chosen for binds it."""


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing listens on `port` (a bind there succeeds now)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server binds
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


RESERVE_S = 120.0
"""A port `free_port` hands out stays reserved this long, for every caller on the host: the
process it is for may take seconds (a model load) to bind it, and meanwhile another cluster
(a parallel test, a second `baton serve`) must not be handed the same port."""
RESERVATIONS = os.path.join(tempfile.gettempdir(), f"baton-ports-{os.getuid()}")
"""One empty file per reserved port, named by it; its mtime is when it was handed out."""
START_RETRIES = 3
"""How often `wait_ready` restarts a process that died at start because a port chosen for it
was taken meanwhile (by anything on the host), each time on a fresh port."""


def _reserve(port: int, now: float | None = None) -> bool:
    """Takes `port` for RESERVE_S unless another caller on this host holds it now."""
    now = time.time() if now is None else now
    path = os.path.join(RESERVATIONS, str(port))
    try:
        os.makedirs(RESERVATIONS, mode=0o700, exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return True
    except FileExistsError:
        try:
            if now - os.stat(path).st_mtime < RESERVE_S:
                return False
            os.utime(path, (now, now))  # stale: its process bound it long ago, or never will
            return True
        except OSError:
            return False
    except OSError:  # no writable temp folder: the bind check alone
        return True


def free_port() -> int:
    """A port free now, for a process about to start: random in PICK_RANGE (cut at the
    ephemeral range's start) and not handed out to anyone on this host in the last RESERVE_S,
    else the kernel's choice."""
    lo, hi = PICK_RANGE
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            hi = min(hi, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        pass
    for port in random.sample(range(lo, hi), min(64, max(0, hi - lo))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if _reserve(port):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "baton.cli", *args]


class LocalCluster:
    """The processes of one local cluster; `stop()` ends every one of them.

    They share one cluster secret: the configured one (`BATON_CLUSTER_TOKEN` or
    `cluster.token_file`), else a fresh random one that only they know (`token`).
    The router's HTTP API listens on `http_port` (None: a free port); every worker gets a free
    Prometheus port of its own, listed in `metrics_ports` (role, port) in start order.
    """

    def __init__(self, model: str, prefill: int, decode: int, port: int, config: str | None,
                 log_level: str = "INFO", host: str = "127.0.0.1", http_port: int | None = None,
                 worker_args: tuple[str, ...] = (), router_args: tuple[str, ...] = ()):
        local = host in ("0.0.0.0", "::", "")
        reach = "127.0.0.1" if local else host
        self._reach = reach
        # port 0: one free port, chosen here, so the workers know where the router is and a
        # restarted router comes back on the same one
        port = port or free_port()
        self.address = f"{reach}:{port}"
        self.http_port = free_port() if http_port is None else http_port
        self._own_http = http_port is None
        """The HTTP port was chosen here: a restart may move it to a free one."""
        cfg = BatonConfig.load(config)
        self.tls = cluster_tls(cfg.cluster)
        """Mutual TLS of the cluster (None: plaintext); `channel()` and the probes use it."""
        self._router_credentials = router_channel_credentials(cfg.router, self.tls)
        https = bool(cfg.router.tls_cert_file or self.tls)
        self.http_address = f"http{'s' if https else ''}://{reach}:{self.http_port}"
        self.token = configured_token(cfg.cluster) or ClusterSecret.generate()
        self.secret = ClusterSecret(self.token)
        extra = ["--config", config] if config else []
        base = ["--log-level", log_level]
        self.procs: list[subprocess.Popen] = []
        """The current process of each role instance (a restart replaces its entry)."""
        self.restarts: list[int] = []
        """How often each entry of `procs` was restarted."""
        self._started: list[float] = []
        self._deaths: list[int] = []
        """Deaths in a row, each within STABLE_S of its start (the backoff's exponent)."""
        self._due: dict[int, float] = {}
        """Entries that died, and when they start again."""
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self.metrics_ports: list[tuple[str, int]] = []
        self.expected = prefill + decode
        self._spawn(_cmd(*base, "router", "--port", str(port), "--host", host, "--model", model,
                         "--http-port", str(self.http_port), *extra, *router_args))
        for role, n in (("prefill-worker", prefill), ("decode-worker", decode)):
            for _ in range(n):
                mport = free_port()
                self.metrics_ports.append((role.removesuffix("-worker"), mport))
                self._spawn(_cmd(*base, role, "--router", self.address, "--model", model,
                                 "--metrics-port", str(mport), *extra, *worker_args))

    def _spawn(self, cmd: list[str]) -> None:
        self.procs.append(self._popen(cmd))
        self.restarts.append(0)
        self._started.append(time.monotonic())
        self._deaths.append(0)

    def _popen(self, cmd: list[str]) -> subprocess.Popen:
        env = dict(os.environ)
        env[ENV_TOKEN] = self.token  # never on a command line, where `ps` would show it
        # several worker processes share this machine's cores: split them instead of oversubscribing
        env.setdefault(envs.NUM_THREADS.name, str(max(1, (os.cpu_count() or 1) // self.expected)))
        # children's banners go to stderr: stdout stays for what the caller prints (JSON)
        return subprocess.Popen(cmd, start_new_session=True, env=env, stdout=STDERR_FD)

    # -- supervision ------------------------------------------------------------------------

    def supervise(self) -> None:
        """Restart dead processes from a background thread until `stop()`."""
        if self._supervisor is None:
            self._supervisor = threading.Thread(target=self._supervise_loop, name="supervisor",
                                                daemon=True)
            self._supervisor.start()

    def _supervise_loop(self) -> None:
        while not self._stopping.wait(SUPERVISE_PERIOD_S):
            self.check_children()

    def check_children(self, now: float | None = None) -> None:
        """One supervision pass: schedules the restart of a process that exited (logged, with
        its backoff) and starts those whose backoff is over."""
        now = time.monotonic() if now is None else now
        for i, p in enumerate(self.procs):
            if self._stopping.is_set() or p.poll() is None:
                continue
            if i not in self._due:
                ran = now - self._started[i]
                self._deaths[i] = self._deaths[i] + 1 if ran < STABLE_S else 1
                delay = min(RESTART_MAX_S, RESTART_FIRST_S * 2 ** (self._deaths[i] - 1))
                self._due[i] = now + delay
                log.warning("%s (pid %d) exited with code %s after %.1fs; restarting it in "
                            "%.1fs", _name(p), p.pid, p.returncode, ran, delay)
            elif now >= self._due[i]:
                del self._due[i]
                self._restart(i, self._restart_args(i, list(p.args)), now)

    def _restart(self, i: int, args: list[str], now: float) -> None:
        name = _name(self.procs[i])
        self.procs[i] = self._popen(args)
        self._started[i] = now
        self.restarts[i] += 1
        log.warning("restarted %s as pid %d (restart %d)", name, self.procs[i].pid,
                    self.restarts[i])

    def _restart_args(self, i: int, args: list[str]) -> list[str]:
        """The command that restarts entry `i`: the same, except where a port chosen here for
        it was taken meanwhile (by anything on the host): a worker's metrics port, or the
        router's HTTP port unless it was configured. It gets a fresh one, logged and listed in
        `metrics_ports` (or `http_port`): with the old port it would die again at every start."""
        for flag in ("--metrics-port", "--http-port"):
            if flag not in args or (flag == "--http-port" and not self._own_http):
                continue
            at = args.index(flag) + 1
            old = int(args[at])
            if port_is_free(old, self._reach):
                continue
            new = free_port()
            args[at] = str(new)
            if flag == "--http-port":
                self.http_port = new
                self.http_address = self.http_address.rpartition(":")[0] + f":{new}"
                what = "the HTTP API"
            else:
                k = i - 1  # entry 0 is the router, the workers follow in metrics_ports' order
                role, _ = self.metrics_ports[k]
                self.metrics_ports[k] = (role, new)
                what = "/metrics"
            log.warning("%s's %s port %d is taken now; it restarts with %s on port %d",
                        _name_of(args), flag.removeprefix("--").replace("-port", ""), old,
                        what, new)
        return args

    def _restart_at_start(self, i: int) -> bool:
        """Entry `i` died before the cluster was ready: restarts it at once (True) if a port
        chosen for it was taken meanwhile, at most START_RETRIES times."""
        p = self.procs[i]
        if self.restarts[i] >= START_RETRIES:
            return False
        args = self._restart_args(i, list(p.args))
        if args == list(p.args):
            return False
        self._restart(i, args, time.monotonic())
        return True

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Until every worker has registered; raises if a process died or time ran out."""
        deadline = time.monotonic() + timeout
        with self.channel() as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            while time.monotonic() < deadline:
                dead = [" ".join(p.args[5:7]) for i, p in enumerate(self.procs)
                        if p.poll() is not None and not self._restart_at_start(i)]
                if dead:
                    raise BatonError(f"cluster process(es) exited during start: {dead}")
                try:
                    n = len(stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=2).workers)
                    if n >= self.expected and self._http_ready():
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.3)
        raise BatonError(f"cluster not ready after {timeout:.0f}s ({self.expected} workers expected)")

    def channel(self, token: str | None = None) -> grpc.Channel:
        """A channel to the router as a cluster process (TLS as configured) that sends `token`
        (default: the cluster secret's bearer)."""
        return open_channel(self.address, token or self.secret.bearer, self._router_credentials)

    def _http_ready(self) -> bool:
        context = None
        if self.http_address.startswith("https"):
            context = self.tls.ssl_context() if self.tls else ssl.create_default_context()
        try:
            with urllib.request.urlopen(f"{self.http_address}/health", timeout=2,
                                        context=context) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=5)
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.procs:
            try:
                p.wait(timeout=max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs of SIGTERM; killing it",
                            _name(p), STOP_GRACE_S)
                p.kill()
                p.wait()


def _name(p: subprocess.Popen) -> str:
    """The role of a cluster process ("router", "prefill-worker", ...)."""
    return _name_of(p.args)


def _name_of(args) -> str:
    return next((a for a in args if a in ("router", "prefill-worker", "decode-worker")),
                " ".join(map(str, args[3:6])))


def _raise_interrupt(*_) -> None:
    raise KeyboardInterrupt


def _http_port(args) -> int | None:
    """--http-port, else router.http_port from the config; 0 (or None) picks a free port."""
    if args.http_port is not None:
        return args.http_port or None
    from baton.config import BatonConfig

    return BatonConfig.load(args.config).router.http_port or None


def _worker_flags(args) -> tuple[str, ...]:
    """`baton serve`'s flags that every worker takes over its config file (a bad
    `--speculative-tokens` is refused here, in one line, before any worker starts)."""
    k = getattr(args, "speculative_tokens", None)
    if k is not None:
        from baton.config import BatonConfig

        BatonConfig.load(args.config).speculative.with_draft_tokens(k)
    out: list[str] = []
    for flag in ("tensor_parallel_size", "speculative_tokens", "quantize", "quantize_activations"):
        v = getattr(args, flag, None)
        if v is not None:
            out += ["--" + flag.replace("_", "-"), str(v)]
    return tuple(out)


def serve_local(args) -> int:
    from baton.model.registry import resolve_model

    model = str(resolve_model(args.model))  # make `tiny` once, before the workers race for it
    # SIGTERM (a supervisor, `timeout`) must stop the workers too: they run in their own sessions
    signal.signal(signal.SIGTERM, _raise_interrupt)
    cluster = LocalCluster(model, args.prefill, args.decode, args.port, args.config,
                           host=args.host, http_port=_http_port(args),
                           worker_args=_worker_flags(args),
                           router_args=("--quantize", args.quantize) if args.quantize else ())
    try:
        cluster.wait_ready()
        metrics = ", ".join(f"{role} :{port}" for role, port in cluster.metrics_ports)
        print(f"baton cluster ready: router gRPC at {cluster.address}, OpenAI-compatible HTTP "
              f"at {cluster.http_address}/v1 ({args.prefill} prefill, {args.decode} decode; "
              f"worker metrics on {metrics}); Ctrl-C stops it", flush=True)
        # clients that load a tokenizer (lm-eval, AIPerf: --tokenizer DIR) point at this folder
        print(f"baton model folder: {model}", flush=True)
        while True:  # a process that exits is restarted (with backoff); the cluster goes on
            cluster.check_children()
            time.sleep(SUPERVISE_PERIOD_S)
    except KeyboardInterrupt:
        return 0
    finally:
        # a second SIGTERM / Ctrl-C (`timeout` forwards its own beside the one sent) must not
        # cut the stop short between workers: one left running would outlive `serve`
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        cluster.stop()
