"""Stage processes driven over a pipe: one pipeline stage per OS process, as in production.

Used by the integration tests and the benchmark. Each `StageProc` is a `spawn`ed child
holding one stage's `Pools` and one Receiver (decode) or Sender (prefill), so every stage
has its own NIXL agent / UCX worker. Commands are msgpack over a multiprocessing pipe:

    parent ── setup{role, backend, model, layers, ...} ──► child: pools + receiver|sender
           ── expect / send / connect / wait{rids} / dump / fill ──►
           ◄── {"ok": True, ...} | {"ok": False, "error": "..."}

A child can be set up again with another model or layer split, so one set of processes
serves many test cases. Prefill pools are filled with random bytes, decode pools with a
canary byte pattern; `dump` returns the raw pool bytes for bit-exact checks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import traceback

import msgpack
import numpy as np

START_METHOD = os.environ.get("BATON_STAGE_START_METHOD", "forkserver")
"""`forkserver` (default): a clean server process that has imported torch and nothing of
NIXL/UCX forks each stage, so no transport state is ever inherited across a fork and
torch (seconds to import) loads once. `spawn` gives each stage a fresh interpreter."""


def context():
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(["torch", "numpy", "msgpack", "baton.model.pools"])
    return ctx


class StageProc:
    """Parent-side handle of one stage process."""

    def __init__(self, ctx=None):
        ctx = ctx or context()
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def call(self, op: str, timeout: float = 60.0, **kw) -> dict:
        self.submit(op, **kw)
        return self.result(timeout)

    def submit(self, op: str, **kw) -> None:
        self._conn.send_bytes(msgpack.packb({"op": op, **kw}, use_bin_type=True))

    def result(self, timeout: float = 60.0) -> dict:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"stage process {self.proc.pid} gave no answer in {timeout} s")
        return msgpack.unpackb(self._conn.recv_bytes(), raw=False)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=10)
            except (OSError, EOFError, TimeoutError):
                pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.kill()


def _main(conn) -> None:
    os.dup2(2, 1)  # UCX prints protocol tables on stdout; keep the parent's stdout clean
    stage = _Stage()
    while True:
        try:
            msg = msgpack.unpackb(conn.recv_bytes(), raw=False)
        except EOFError:
            break
        op = msg.pop("op")
        try:
            reply = {"ok": True, **(getattr(stage, op)(**msg) or {})}
        except Exception as e:
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}",
                     "trace": traceback.format_exc()}
        conn.send_bytes(msgpack.packb(reply, use_bin_type=True))
        if op == "exit":
            break
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # endpoints are closed; skip interpreter teardown of transport threads


class _Stage:
    """Child-side state; each public method is one command."""

    def __init__(self):
        self.end = None

    def setup(self, role: str, backend: str, model: dict, layers: list[int], num_blocks: int,
              tokens_per_block: int, num_slots: int, seed: int, dtype: str = "float32",
              lease_seconds: float = 30.0, handshake_timeout_s: float = 10.0,
              layerwise: bool = False, env: dict | None = None, tp: list[int] | None = None,
              snapshots: list | None = None, kv_dtype: str | None = None):
        """`tp` [rank, size]: this process is that tensor-parallel rank (its pools the rank's
        shard; a prefill rank's bytes are its shard of the TP-1 pools `seed` fills, so
        replicated units are equal on every rank: `bench/harness/tp_bytes.py`).
        `snapshots` [live slots, dtype]: the slots past the first `live slots` form a
        snapshot pool of that dtype (16-bit state handoffs, docs/state-precision.md)."""
        import torch

        from baton.model.config import config_from_dict
        from baton.model.pools import Pools, PoolSpec
        from transfer import TransferConfig, compute_fingerprint, make_receiver, make_sender

        os.environ.update(env or {})
        self.close()
        mc = config_from_dict(model)
        rank, size = tp or (0, 1)
        local = mc
        if tp is not None:
            from baton.model.tp_loader import family_tp

            local = family_tp(mc).local_config(mc, size)
        spec = PoolSpec.for_model(local, num_blocks=num_blocks,
                                  tokens_per_block=tokens_per_block, num_slots=num_slots,
                                  layers=layers, dtype=getattr(torch, dtype),
                                  kv_dtype=getattr(torch, kv_dtype) if kv_dtype else None)
        if snapshots:
            live, sdt = snapshots
            spec = spec.split_snapshots(live, {t.name: getattr(torch, sdt)
                                               for t in spec.state_tensors})
        self.pools = Pools(spec)
        if tp is not None and seed >= 0:
            from bench.harness.tp_bytes import fill_shard

            fill_shard(self.pools, mc, layers, seed, rank, size)
        else:
            self.fill(seed)
        cfg = TransferConfig(backend=backend, lease_seconds=lease_seconds,
                             handshake_timeout_s=handshake_timeout_s, layerwise=layerwise)
        fp = compute_fingerprint(mc, spec)
        side = None
        if tp is not None:
            from transfer import tp_identity

            fp, side = tp_identity(mc, spec, rank, size)
        if role == "decode":
            self.end = make_receiver(cfg, self.pools, fp)
        else:
            self.end = make_sender(cfg, self.pools, fp, tp=side)
        self.poller = _Poller(self.end)
        return {"endpoint": getattr(self.end, "endpoint", None)}

    def decode_worker(self, model_dir: str, num_blocks: int, tokens_per_block: int,
                      num_slots: int, max_num_seqs: int, lease_seconds: float = 30.0):
        """A decode worker's service (engine loop + receiver + DecodeService, as `baton
        decode-worker` builds them, without gRPC) on this stage; `dw_*` commands drive it."""
        from baton.config import BatonConfig
        from baton.engine.builder import build_engine
        from baton.engine.loop import EngineLoop
        from decode_worker.service import DecodeService
        from transfer import compute_fingerprint, make_receiver

        self.close()
        cfg = BatonConfig.from_dict({
            "worker": {"max_num_seqs": max_num_seqs},
            "cache": {"num_blocks": num_blocks, "tokens_per_block": tokens_per_block,
                      "num_state_slots": num_slots},
            "transfer": {"lease_seconds": lease_seconds}})
        engine = build_engine(cfg, model_dir)
        self.pools = engine.pools
        self.loop = EngineLoop(engine)
        fp = compute_fingerprint(engine.model.config, engine.pools.spec)
        self.end = make_receiver(cfg.transfer, engine.pools, fp)
        self.service = DecodeService(self.loop, self.end, "dw", lease_seconds)
        self.poller = None  # the service's own event thread polls the receiver
        return {"endpoint": self.end.endpoint}

    def dw_reserve(self, rid: str, prompt: list[int], max_tokens: int = 16):
        from baton.contract import ReserveInput
        from baton.sampling import SamplingParams

        res = self.service.reserve(ReserveInput(rid, tuple(prompt),
                                                SamplingParams(max_tokens=max_tokens)))
        return {"blocks": list(res.block_ids), "slot": res.slot, "skip": res.skip_blocks}

    def dw_abort(self, rid: str):
        return {"found": self.service.abort(rid)}

    def dw_counters(self):
        from baton.worker.load import counters_of

        return {"counters": counters_of(self.loop)}

    def dw_granted(self, rid: str):
        e = self.end._expected.get(rid)
        return {"granted": bool(e and e.writers)}

    def dw_bytes(self, blocks: list[int], slot: int):
        """The KV bytes of `blocks` and the state bytes of `slot`, in that order."""
        import torch

        def raw(t):
            return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()

        p = self.pools
        return {"kv": [raw(p.kv[:, b]) for b in blocks],
                **{name: raw(t[:, slot]) for name, t in p.state.items()}}

    def dw_fill(self, blocks: list[int], slot: int, value: float):
        """Fill `blocks` and `slot` with a canary value (what another request holds)."""
        p = self.pools

        def put():
            for b in blocks:
                p.kv[:, b].fill_(value)
            for t in p.state.values():
                t[:, slot].fill_(value)

        self.loop.call(put)

    def delay_posts(self, seconds: float):
        """Test hook: every post of this sender waits `seconds` first, as bytes held up on a
        link that went down and came back (the sender's lock is held meanwhile)."""
        transport = self.end._transport
        post = type(transport).post

        def late(peer, plan, notif):
            time.sleep(seconds)
            return post(transport, peer, plan, notif)

        transport.post = late

    def fill(self, seed: int):
        """Random bytes on prefill (seed >= 0), canary pattern on decode (seed < 0)."""
        import torch

        g = torch.Generator().manual_seed(abs(seed))
        for t in self.pools.tensors:
            b = t.view(-1).view(torch.uint8)
            if seed >= 0:
                b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
            else:
                b.copy_((torch.arange(b.numel()) % 251).to(torch.uint8))

    def dump(self):
        import torch

        tensors = {"kv": self.pools.kv, **self.pools.state}
        return {k: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                for k, t in tensors.items()}

    def connect(self, endpoint: str):
        return {"layers": sorted(self.end.connect(endpoint).layers)}

    def expect(self, rid: str, blocks: list[int], slot: int | None, lease_s: float | None = None):
        self.end.expect(rid, blocks, slot, lease_s)

    def send(self, rid: str, endpoints: list[str], src_blocks: list[int], src_slot: int | None,
             dst_blocks: list[int], dst_slot: int | None, skip: int = 0, layers_done=()):
        self.end.send(rid, endpoints, src_blocks, src_slot, dst_blocks, dst_slot, skip,
                      layerwise=self.end.cfg.layerwise)
        for g in layers_done:
            self.end.layer_done(rid, g)
        self.poller.wake()

    def batch(self, calls: list[list]):
        """Several [op, kwargs] commands in one round trip (stops at the first error)."""
        for op, kw in calls:
            getattr(self, op)(**kw)

    def wait(self, rids: list[str], timeout: float = 20.0):
        """Poll until every rid has an event (or timeout); events as [rid, ok, error]
        (`held` tells which failed reservations are quarantined)."""
        want, got = set(rids), []
        deadline = time.monotonic() + timeout
        while want and time.monotonic() < deadline:
            for ev in self.poller.take():
                got.append(list(ev[:3]))
                want.discard(ev.request_id)
            time.sleep(0.0005)
        return {"events": got, "elapsed": timeout - (deadline - time.monotonic())}

    def digest(self, ranges: bytes):
        """blake2b of the pool bytes at (addr, len) uint64 pairs, in order."""
        import hashlib

        from transfer.ucx_backend import _Memory

        mem, h = _Memory(self.pools), hashlib.blake2b()
        for a, n in np.frombuffer(ranges, dtype="<u8").reshape(-1, 2).tolist():
            h.update(mem.view(a, n))
        return {"digest": h.hexdigest()}

    def bench_send(self, endpoint: str, src_blocks: list[int], src_slot: int,
                   dst_blocks: list[int], dst_slot: int, rids: list[str], capture: bool):
        """Time handoffs one after another (send -> delivered event), busy-polling."""
        from transfer.planner import plan

        with _captured_output(capture) as out:  # UCX picks protocols on first contact
            p = plan(self.end.layout, self.end.connect(endpoint), src_blocks, src_slot,
                     dst_blocks, dst_slot)
            times = [self._timed(rids[0], endpoint, src_blocks, src_slot, dst_blocks, dst_slot)]
        proto = out.read()
        times += [self._timed(rid, endpoint, src_blocks, src_slot, dst_blocks, dst_slot)
                  for rid in rids[1:]]
        src, dst = p.coalesced()
        return {"times": times, "bytes": p.nbytes, "descriptors": int(p.length.size),
                "descriptors_coalesced": len(src), "proto": proto,
                "src_ranges": src.astype("<u8").tobytes(), "dst_ranges": dst.astype("<u8").tobytes()}

    def _timed(self, rid: str, endpoint: str, *args) -> float:
        # as a prefill worker does: the claim goes out when the destination arrives and its
        # grant is back before the prompt's compute ends (not part of the handoff's time)
        src_blocks, src_slot, dst_blocks, dst_slot = args
        self.end.claim(rid, endpoint, dst_blocks, dst_slot)
        deadline = time.monotonic() + 5
        self.poller.wake()  # its poll reads the grant
        while self.end._grants.get((endpoint, rid)) == "" and time.monotonic() < deadline:
            time.sleep(0.001)
        t0 = time.perf_counter()
        self.end.send(rid, endpoint, *args)
        self.poller.wake()
        evs = self.poller.wait()
        if not evs[0].ok:
            raise RuntimeError(f"handoff {rid} failed: {evs[0].error}")
        return time.perf_counter() - t0

    def memcpy(self, nbytes: int, reps: int):
        """Plain single-threaded memcpy of `nbytes` (numpy copyto), seconds per copy."""
        a = np.full(nbytes, 7, dtype=np.uint8)
        b = np.empty_like(a)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            np.copyto(b, a)
            times.append(time.perf_counter() - t0)
        return {"times": times[1:]}

    def close(self):
        if getattr(self, "service", None) is not None:
            self.service.close()
            self.loop.stop()
            self.service = self.end = None
        if self.end is not None:
            self.poller.stop()
            self.end.close()
            self.end = None

    def exit(self):
        self.close()


class _captured_output:
    """Redirect fds 1 and 2 to a temporary file (UCX prints UCX_PROTO_INFO there)."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        import tempfile

        self.file = tempfile.TemporaryFile(mode="w+b")
        if self.on:
            sys.stdout.flush()
            sys.stderr.flush()
            self.saved = (os.dup(1), os.dup(2))
            os.dup2(self.file.fileno(), 1)
            os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        if self.on:
            os.dup2(self.saved[0], 1)
            os.dup2(self.saved[1], 2)
            for fd in self.saved:
                os.close(fd)

    def read(self) -> str:
        self.file.seek(0)
        text = self.file.read().decode(errors="replace")
        self.file.close()
        return text


class _Poller:
    """Progresses the endpoint the way a worker does (NIXL has no progress thread of its
    own): a thread polls it as often as it asks, woken when a sender starts writing."""

    def __init__(self, end):
        import threading

        self.end, self._events, self._lock = end, [], threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._woken, self._stop = threading.Event(), False
        if hasattr(end, "on_activity"):
            end.on_activity = self._woken.set
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def wake(self):
        self._woken.set()

    def take(self) -> list:
        with self._lock:
            out, self._events = self._events, []
        return out

    def wait(self) -> list:
        """Blocks (GIL released: a spinning waiter would starve the poller) until events."""
        with self._ready:
            while not self._events:
                self._ready.wait()
            out, self._events = self._events, []
        return out

    def stop(self):
        self._stop = True
        self._woken.set()
        self._thread.join(timeout=5)

    def _run(self):
        while not self._stop:
            evs = self.end.poll()
            if evs:
                with self._ready:
                    self._events.extend(evs)
                    self._ready.notify_all()
                continue
            interval = self.end.poll_interval()
            self._woken.wait(0.05 if interval is None else interval)
            self._woken.clear()
