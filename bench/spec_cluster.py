"""The cluster rows of `baton bench spec`: one prefill and one decode worker (`baton serve`'s
processes on this machine), speculation off and K = 3 on the decode worker, the same prompts
as the colocated rows at 1, 8 and 32 concurrent requests.

Decode tokens/s through the cluster: the tokens after each request's first, over the time
from the batch's first first-token to its last token (the client's clock, every request of a
batch sent at once; the same rule for off and on).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

CLUSTER_VARIANTS = (0, 3)


def _decode_rate(results: list[dict]) -> float:
    tokens = sum(len(r["token_ids"]) - 1 for r in results)
    window = max(r["t_last"] for r in results) - min(r["t_first"] for r in results)
    return tokens / window if window > 0 else float("nan")


def _stream(address: str, specs: list, concurrency: int) -> list[dict]:
    """Every request at once: its tokens, the client's time of its first and last chunk,
    and the summary's draft counts."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from baton.client.remote import to_pb
    from baton.contract import wire
    from baton.proto_gen import router_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)

        def one(spec) -> dict:
            out = {"token_ids": [], "t_first": None}
            for msg in stub.Generate(to_pb(spec), timeout=600):
                chunk = wire.chunk_from_pb(msg)
                if chunk.token_ids and out["t_first"] is None:
                    out["t_first"] = time.perf_counter()
                out["token_ids"].extend(chunk.token_ids)
                if chunk.summary is not None:
                    out.update(draft_tokens=chunk.summary.draft_tokens,
                               accepted_tokens=chunk.summary.accepted_tokens)
            out["t_last"] = time.perf_counter()
            return out

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return list(pool.map(one, specs))


def _measure(path: Path, variant, refs: dict, out_len: int) -> dict:
    import yaml

    from baton.client.remote import run_remote
    from baton.client.requests import RequestSpec
    from baton.cluster.local import LocalCluster, free_port
    from baton.engine.request import SamplingParams
    from bench.spec import config

    n = max(refs)
    total = max(len(reqs[0]) for reqs, _ in refs.values()) + out_len
    cfg = config(n, total, variant)
    cfg["router"] = {"local_prefill_max_tokens": 0}  # every request through the handoff
    with tempfile.TemporaryDirectory() as tmp:
        cfg_file = Path(tmp) / "spec.yaml"
        cfg_file.write_text(yaml.safe_dump(cfg))
        cluster = LocalCluster(str(path), 1, 1, free_port(), str(cfg_file), log_level="WARNING")
        try:
            cluster.wait_ready(timeout=240)
            sp = SamplingParams(max_tokens=out_len, ignore_eos=True)
            out = {}
            for conc, (reqs, _) in refs.items():
                specs = [RequestSpec(f"c{conc}-{i}", prompt_ids=p, sampling=sp)
                         for i, p in enumerate(reqs)]
                run_remote(cluster.address, specs[:1], 1)  # warm: first calls pay setup
                out[conc] = _stream(cluster.address, specs, conc)
            return out
        finally:
            cluster.stop()


def cluster_rows(path: Path, preset: str, refs: dict, out_len: int) -> list[dict]:
    """refs: concurrency -> (prompts, the colocated off run's tokens by request)."""
    runs = {v: _measure(path, v, refs, out_len) for v in CLUSTER_VARIANTS}
    rows = []
    for conc, (_, ref) in refs.items():
        base = _decode_rate(runs[0][conc])
        want = list(ref.values())
        for v in CLUSTER_VARIANTS[1:]:
            res = runs[v][conc]
            drafts = sum(r.get("draft_tokens", 0) for r in res)
            accepted = sum(r.get("accepted_tokens", 0) for r in res)
            rate = _decode_rate(res)
            rows.append({
                "benchmark": "spec", "label": f"{preset}-c{conc}-{v}-cluster", "model": preset,
                "where": "1P+1D", "concurrency": conc, "variant": str(v),
                "off_decode_tok_s": round(base, 1), "spec_decode_tok_s": round(rate, 1),
                "speedup": round(rate / base, 2),
                # steps with drafts ~ drafts / K; accepted length = 1 + accepted per such step
                "accepted_length": round(1 + accepted * v / drafts, 2) if drafts else 1.0,
                "identical_to_off": [r["token_ids"] for r in res] == want
                and [r["token_ids"] for r in runs[0][conc]] == want,
            })
    return rows
