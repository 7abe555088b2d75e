"""A local cluster (router + workers as real processes) for integration tests."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import yaml

from baton.auth.grpc_auth import authorized
from baton.cluster.local import LocalCluster, free_port
from baton.proto_gen import baton_pb2, router_pb2, router_pb2_grpc, worker_pb2_grpc


def children(pid: int) -> list[int]:
    """The child processes of `pid` (a worker's stage or rank processes)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    """`pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def write_config(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def start_cluster(model_dir: Path, config: Path, prefill: int, decode: int,
                  worker_args: tuple[str, ...] = ()) -> LocalCluster:
    """`worker_args`: flags every worker takes (`baton serve`'s `--quantize int8`, ...)."""
    cluster = LocalCluster(str(model_dir), prefill, decode, free_port(), str(config),
                           log_level="WARNING", worker_args=worker_args)
    try:
        cluster.wait_ready(timeout=240)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def list_workers(address: str, bearer: str | None = None) -> list:
    """The router's ListWorkers; `bearer`: an API key or the cluster bearer, which the router
    needs when API keys are configured."""
    with authorized(grpc.insecure_channel(address), bearer) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        return list(stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5).workers)


def worker_counters(info, bearer: str | None = None) -> dict[str, float]:
    """A worker's Stats counters (cache stats, integrity_ok, live_requests); `bearer`: the
    cluster secret's (`cluster.secret.bearer`), which every worker RPC needs."""
    with authorized(grpc.insecure_channel(info.address), bearer) as ch:
        if info.role == baton_pb2.WORKER_ROLE_PREFILL:
            stub = worker_pb2_grpc.PrefillWorkerStub(ch)
        else:
            stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        return dict(stub.Stats(baton_pb2.StatsRequest(), timeout=10).counters)


def assert_clean(cluster, quarantine: bool = False,
                 within: float = 15.0) -> dict[str, dict[str, float]]:
    """Every worker of `cluster` (a LocalCluster): integrity holds and nothing is held for a
    request any more, within `within` seconds (a listed worker that cannot be reached, killed
    and not yet ejected by the router, is asked again until then). Blocks quarantined after a failed transfer count as held
    (a dead writer's are released QUARANTINE_GRACE_S after its connection closed) unless
    `quarantine` (a writer cut off by a link that is still down may yet write them). Returns
    the workers' counters."""
    deadline = time.monotonic() + within
    while True:
        try:
            counters = {w.worker_id: worker_counters(w, cluster.secret.bearer)
                        for w in list_workers(cluster.address, cluster.secret.bearer)}
        except grpc.RpcError as e:  # a killed worker the router has not ejected yet
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        idle = all(c["live_requests"] == 0 and c["engine_requests"] == 0
                   and (quarantine or c.get("slots_quarantined", 0) == 0
                        and c.get("blocks_quarantined", 0) == 0)
                   for c in counters.values())
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for wid, c in counters.items():
        assert c["integrity_ok"] == 1.0, wid
        # test canaries (BATON_TEST_CANARIES=1): no free block or slot took a stray write
        assert c.get("canary_bad_blocks", 0) == 0 and c.get("canary_bad_slots", 0) == 0, (wid, c)
        assert c["live_requests"] == 0 and c["engine_requests"] == 0, (wid, c)
        if not quarantine:
            assert c.get("blocks_quarantined", 0) == 0, (wid, c)
            assert c.get("slots_quarantined", 0) == 0, (wid, c)
    return counters
