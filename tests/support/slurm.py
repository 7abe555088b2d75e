"""`make test-deploy`: deploy/slurm/baton.sbatch under a real Slurm on this one machine.

    python -m tests.support.slurm [--nodes 1]

Installs Debian's `slurm-wlm` and `munge` when missing (apt-get, root), starts a private
munged and a single-host Slurm (slurmctld + one slurmd per node, NODES nodes named b0..,
every NodeAddr 127.0.0.1, generated slurm.conf and state in a temporary folder), submits the
batch script unchanged with `sbatch -N 3` (router, prefill and decode each on their own
node; `--nodes 1`: every role on one node), sends requests to the router it started and checks their tokens against the
colocated engine, `scancel`s the job, stops the daemons and checks that no process it
caused is left. Prints one `SKIP: ...` line and exits 0 only where it cannot run here (not
root and Slurm missing, no apt-get, packages not installable); any other failure exits 1
with the logs' tails.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from baton.cluster.local import free_port
from tests.support.apt import apt_install

ROOT = Path(__file__).resolve().parents[2]
NODES = 3
PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("sbatch", "scancel", "squeue", "sinfo", "scontrol", "slurmctld", "slurmd", "munged")
CONFIG = """\
cache: {num_blocks: 256, num_state_slots: 16}
worker: {max_num_seqs: 8, max_model_len: 1024}
transfer: {lease_seconds: 20}
router: {policy: round_robin, heartbeat_seconds: 0.5}
"""


class Skip(Exception):
    """This machine cannot run the check (the one line says why)."""


def ensure_slurm() -> None:
    if all(shutil.which(t) for t in DAEMONS):
        return
    if os.geteuid() != 0:
        raise Skip("Slurm is not installed and installing it needs root")
    if not shutil.which("apt-get"):
        raise Skip("Slurm is not installed and there is no apt-get to install it")
    r = apt_install(list(PACKAGES))
    if r.returncode != 0:
        raise Skip(f"could not install {' '.join(PACKAGES)}: {r.stderr.strip()[-300:]}")
    missing = [t for t in DAEMONS if not shutil.which(t)]
    if missing:
        raise Skip(f"{' '.join(PACKAGES)} installed but {missing} are missing")


def slurm_conf(tmp: Path, ctld_port: int, node_ports: list[int]) -> str:
    host = socket.gethostname()
    lines = [
        "ClusterName=batontest",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={tmp}/munge.sock",
        "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={tmp}/state", f"SlurmdSpoolDir={tmp}/spool-%n",
        f"SlurmctldPidFile={tmp}/slurmctld.pid", f"SlurmdPidFile={tmp}/slurmd-%n.pid",
        f"SlurmctldLogFile={tmp}/slurmctld.log", f"SlurmdLogFile={tmp}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/linear",
        "SchedulerType=sched/builtin", "ReturnToService=2", "MpiDefault=none",
        "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none", "SwitchType=switch/none",
        "KillWait=10", "UnkillableStepTimeout=60",
    ]
    for i, port in enumerate(node_ports):
        lines.append(f"NodeName=b{i} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
                     "CPUs=1 State=UNKNOWN")
    lines.append("PartitionName=baton Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


class LocalSlurm:
    """munged + slurmctld + one slurmd per node, in the foreground as our children."""

    def __init__(self, tmp: Path, nodes: int):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        (tmp / "state").mkdir()
        key = tmp / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf = tmp / "slurm.conf"
        self.conf.write_text(slurm_conf(tmp, free_port(), [free_port() for _ in range(nodes)]))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._start(["munged", "-F", "--force", f"--socket={tmp}/munge.sock",
                     f"--key-file={key}", f"--pid-file={tmp}/munged.pid",
                     f"--log-file={tmp}/munged.log", f"--seed-file={tmp}/munge.seed"], "munged")
        self._wait(lambda: (tmp / "munge.sock").exists(), 10, "munged's socket")
        self._start(["slurmctld", "-D", "-i"], "slurmctld")
        for i in range(nodes):
            self._start(["slurmd", "-D", "-N", f"b{i}"], f"slurmd-b{i}")
        self._wait(lambda: self.run("sinfo", "-h", "-o", "%T").split() == ["idle"], 60,
                   f"{nodes} idle Slurm nodes")

    def _start(self, argv: list[str], name: str) -> None:
        out = open(self.tmp / f"{name}.out", "wb")
        self.procs.append(subprocess.Popen(argv, env=self.env, stdout=out,
                                           stderr=subprocess.STDOUT, cwd=self.tmp))

    def _wait(self, ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited ({p.returncode}) waiting for {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} within {timeout:g} s")
            time.sleep(0.2)

    def run(self, *argv: str) -> str:
        r = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)
        return r.stdout if r.returncode == 0 else ""

    def stop(self) -> None:
        for p in reversed(self.procs):  # slurmds, slurmctld, then munged
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def ours(marker: str) -> list[str]:
    """Processes (pid and command line) whose command line or environment names `marker`."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        if marker in cmd or marker.encode() in env:
            found.append(f"{d.name}: {cmd.strip()[:160]}")
    return found


def list_workers(address: str) -> list:
    import grpc

    from baton.proto_gen import router_pb2, router_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        return list(stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5).workers)


def check(tmp: Path, nodes: int) -> str:
    from baton.client.local import run_local
    from baton.client.remote import run_remote
    from baton.client.requests import RequestSpec
    from baton.config import BatonConfig
    from baton.engine.builder import build_engine
    from baton.engine.request import SamplingParams
    from baton.model.make_model import write_checkpoint

    model = write_checkpoint(tmp / "model")
    config = tmp / "baton.yaml"
    config.write_text(CONFIG)
    baton = tmp / "baton"  # this checkout, this interpreter, on every "node"
    baton.write_text(f"#!/bin/sh\nexport PYTHONPATH={ROOT}\nexec {sys.executable} -m baton.cli "
                     '"$@"\n')
    baton.chmod(0o755)
    slurm = LocalSlurm(tmp, nodes)
    job = None
    try:
        port = free_port()
        env = dict(BATON_DIR=str(ROOT), MODEL=str(model), CONFIG=str(config), PORT=str(port),
                   HTTP_PORT=str(free_port()), METRICS_PORT="0", BATON=str(baton))
        out = slurm.run("sbatch", "--parsable", f"-N{nodes}", f"--chdir={tmp}",
                        f"--output={tmp}/job-%j.out",
                        "--export=ALL," + ",".join(f"{k}={v}" for k, v in env.items()),
                        str(ROOT / "deploy/slurm/baton.sbatch"))
        job = out.strip().split(";")[0]
        if not job:
            raise RuntimeError("sbatch refused the script")
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 150
        while True:
            try:
                workers = list_workers(address)
            except Exception:  # the router is not up yet
                workers = []
            if len(workers) == 2:
                break
            if time.monotonic() > deadline or not slurm.run("squeue", "-h", "-j", job):
                raise RuntimeError("the job's 2 workers never registered")
            time.sleep(0.5)
        specs = [RequestSpec(f"s{i}", prompt_ids=[(7 * i + j) % 200 + 3 for j in range(30 + 40 * i)],
                             sampling=SamplingParams(max_tokens=8, ignore_eos=True))
                 for i in range(6)]
        remote = run_remote(address, specs, concurrency=6)
        local = run_local(build_engine(BatonConfig.load(config), str(model)), specs, 6)
        got = {r["id"]: r.get("token_ids", r.get("error")) for r in remote}
        want = {r["id"]: r["token_ids"] for r in local}
        if got != want:
            raise RuntimeError(f"tokens differ from the colocated engine: {got} != {want}")
        served = sorted({r["prefill_worker"] for r in remote} | {r["decode_worker"] for r in remote})
        placed = next((ln for ln in (tmp / f"job-{job}.out").read_text().splitlines()
                       if ln.startswith("router at ")), "")
        want = ("workers: b1 prefill-worker b2 decode-worker" if nodes == 3 else
                "workers: b0 prefill-worker b0 decode-worker")
        if want not in placed:
            raise RuntimeError(f"roles not placed as {want!r}: {placed!r}")
        slurm.run("scancel", job)
        cancelled = job
        deadline = time.monotonic() + 60
        while slurm.run("squeue", "-h", "-j", job) or ours(str(model)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"after scancel, still running: {ours(str(model))}")
            time.sleep(0.5)
        job = None
        where = "router on b0, prefill on b1, decode on b2" if nodes == 3 else "all on b0"
        return (f"job {cancelled}: {where} (served by "
                f"{', '.join(served)}); {len(specs)} requests equal the colocated engine; "
                "scancel left nothing running")
    finally:
        if job is not None:
            slurm.run("scancel", job)
            time.sleep(2)
        slurm.stop()


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, choices=(1, NODES), default=NODES)
    nodes = ap.parse_args().nodes
    t0 = time.monotonic()
    try:
        ensure_slurm()
    except Skip as e:
        print(f"SKIP: Slurm deploy test: {e}")
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="baton-slurm-"))
    try:
        summary = check(tmp, nodes)
        left = ours(str(tmp))
        if left:
            raise RuntimeError(f"processes left behind: {left}")
    except Exception as e:
        print(f"FAIL: Slurm deploy test: {e}")
        for log in sorted(tmp.glob("*.log")) + sorted(tmp.glob("*.out")):
            tail = log.read_text(errors="replace").splitlines()[-15:]
            print(f"--- {log.name}\n" + "\n".join(tail))
        for line in ours(str(tmp)):  # never leave anything behind, even on failure
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"OK: Slurm deploy test: {summary} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
