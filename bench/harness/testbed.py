"""A reusable set of stage processes that runs handoffs end to end and checks the bytes.

    Testbed(max_prefill=3, max_decode=2)       spawns 5 processes once
      .configure(backend, model, pp_prefill, pp_decode)   re-sets them up (new pools/agents)
      .run(handoffs)                           expect on decode, send on prefill, wait
      .mismatch(handoffs)                      None when every decode pool is bit-exact

Decode stage j's pools start as canaries; `run` snapshots them first, so `mismatch`
compares every block and slot: moved ones against the source, all others unchanged.
"""

from __future__ import annotations

import torch

from baton.model.config import config_from_dict
from baton.model.partition import partition_layers
from baton.model.pools import PoolSpec
from bench.harness.loopback import StageProc
from bench.harness.verify import Handoff, expected_after, first_difference, split_layers, views


def tiny_model(pattern: str, **overrides) -> dict:
    """A NemotronH config.json dict small enough for many pools per test."""
    d = dict(vocab_size=32, hidden_size=32, hybrid_override_pattern=pattern,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_num_heads=4,
             mamba_head_dim=4, ssm_state_size=4, n_groups=2, conv_kernel=4)
    return {**d, **overrides}


def tiny_qwen(pattern: str, **overrides) -> dict:
    """A Qwen3.5 text config.json dict (DeltaNet `G`, gated attention `*`), as small."""
    kinds = {"G": "linear_attention", "*": "full_attention"}
    d = dict(model_type="qwen3_5_text", vocab_size=32, hidden_size=32,
             num_hidden_layers=len(pattern), layer_types=[kinds[c] for c in pattern],
             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=4,
             linear_value_head_dim=6, linear_conv_kernel_dim=3)
    return {**d, **overrides}


def two_handoffs(tag: str) -> list[Handoff]:
    """One contiguous handoff (coalesces) and one scattered one with held prefix blocks."""
    return [
        Handoff(f"{tag}-a", [0, 1, 2, 3], 0, [4, 5, 6, 7], 1),
        Handoff(f"{tag}-b", [5, 7, 6, 9, 10], 2, [0, 2, 9, 11, 10], 0, skip=2),
    ]


def events_ok(events: dict, rids: list[str]) -> str | None:
    """None when every stage process reported exactly `rids`, all ok; else what differs."""
    for role, per_proc in events.items():
        for i, evs in enumerate(per_proc):
            got = {rid: (ok, err) for rid, ok, err in evs}
            if got != {r: (True, None) for r in rids}:
                return f"{role} stage {i}: {evs}"
    return None


class Testbed:
    __test__ = False  # not a pytest class

    def __init__(self, max_prefill: int = 3, max_decode: int = 2):
        self.prefill = [StageProc() for _ in range(max_prefill)]
        self.decode = [StageProc() for _ in range(max_decode)]

    def configure(self, backend: str, model: dict, pp_prefill: int, pp_decode: int,
                  num_blocks: int = 12, tokens_per_block: int = 4, num_slots: int = 3,
                  seed: int = 0, partitions: tuple[list[int], list[int]] = ((), ()),
                  **cfg) -> None:
        """`partitions`: layers per stage of each side (empty: the even split)."""
        mc = config_from_dict(model)
        self.pp, self.dp = pp_prefill, pp_decode
        kw = dict(backend=backend, model=model, num_blocks=num_blocks,
                  tokens_per_block=tokens_per_block, num_slots=num_slots, **cfg)
        self.layerwise = cfg.get("layerwise", False)
        self.specs = {}
        for role, procs, pp, part in (("prefill", self.prefill, pp_prefill, partitions[0]),
                                      ("decode", self.decode, pp_decode, partitions[1])):
            splits = [list(r) for r in partition_layers(mc.num_layers, pp, tuple(part))] \
                if part else split_layers(mc.num_layers, pp)
            for i, layers in enumerate(splits):
                self.specs[role, i] = PoolSpec.for_model(
                    mc, num_blocks=num_blocks, tokens_per_block=tokens_per_block,
                    num_slots=num_slots, layers=layers,
                    dtype=getattr(torch, cfg.get("dtype", "float32")))
                seed_i = seed + i + 1 if role == "prefill" else -1
                procs[i].submit("setup", role=role, layers=layers, seed=seed_i, **kw)
        replies = [p.result() for p in self.prefill[:pp_prefill] + self.decode[:pp_decode]]
        for r in replies:
            if not r["ok"]:
                raise RuntimeError(r["error"] + "\n" + r.get("trace", ""))
        self.endpoints = [r["endpoint"] for r in replies[pp_prefill:]]

    def pair(self, backend: str, decode_overrides: dict | None = None,
             prefill_overrides: dict | None = None, **cfg) -> str:
        """Set up prefill[0] -> decode[0] on the 9-layer tiny model, each side's setup
        arguments overridable (to make them disagree); returns the decode endpoint."""
        base = dict(backend=backend, model=tiny_model("MM-MM*-*M"), layers=list(range(9)),
                    num_blocks=12, tokens_per_block=4, num_slots=3, **cfg)
        d = _ok(self.decode[0].call("setup", role="decode", seed=-1,
                                    **{**base, **(decode_overrides or {})}))
        _ok(self.prefill[0].call("setup", role="prefill", seed=1,
                                 **{**base, **(prefill_overrides or {})}))
        return d["endpoint"]

    def run(self, handoffs: list[Handoff], timeout: float = 20.0) -> dict:
        """Do the handoffs; events per process: {"prefill": [[...]], "decode": [[...]]}."""
        self.before = [p.call("dump") for p in self.decode[:self.dp]]
        expects = [["expect", dict(rid=h.rid, blocks=h.dst_blocks[h.skip:], slot=h.dst_slot)]
                   for h in handoffs]
        self._all(self.decode[:self.dp], lambda i: expects)
        self._all(self.prefill[:self.pp], lambda i: [["send", dict(
            rid=h.rid, endpoints=self.endpoints, src_blocks=h.src_blocks, src_slot=h.src_slot,
            dst_blocks=h.dst_blocks, dst_slot=h.dst_slot, skip=h.skip,
            layers_done=self._layers("prefill", i) if self.layerwise else [])]
            for h in handoffs])
        return self.wait([h.rid for h in handoffs], timeout)

    def _layers(self, role: str, i: int) -> list[int]:
        spec = self.specs[role, i]
        return sorted(spec.attn_layers + spec.mamba_layers)

    @staticmethod
    def _all(procs: list[StageProc], calls) -> None:
        """Run a batch on every process at once: stage i gets calls(i)."""
        for i, p in enumerate(procs):
            p.submit("batch", calls=calls(i))
        for p in procs:
            _ok(p.result())

    def wait(self, rids: list[str], timeout: float = 20.0) -> dict:
        procs = self.prefill[:self.pp] + self.decode[:self.dp]
        for p in procs:
            p.submit("wait", rids=rids, timeout=timeout)
        res = [_ok(p.result(timeout + 10))["events"] for p in procs]
        return {"prefill": res[:self.pp], "decode": res[self.pp:]}

    def mismatch(self, handoffs: list[Handoff]) -> str | None:
        sources = [(self.specs["prefill", i], p.call("dump"))
                   for i, p in enumerate(self.prefill[:self.pp])]
        for j, p in enumerate(self.decode[:self.dp]):
            spec = self.specs["decode", j]
            exp = expected_after(spec, self.before[j], sources, handoffs)
            diff = first_difference(exp, views(p.call("dump"), spec))
            if diff:
                return f"decode stage {j} (layers {spec.attn_layers}/{spec.mamba_layers}): {diff}"
        return None

    def respawn(self, role: str, i: int) -> StageProc:
        """Replace a stage process (e.g. one a test killed)."""
        procs = self.prefill if role == "prefill" else self.decode
        procs[i].stop()
        procs[i] = StageProc()
        return procs[i]

    def close(self) -> None:
        for p in self.prefill + self.decode:
            p.stop()


def _ok(reply: dict) -> dict:
    if not reply["ok"]:
        raise RuntimeError(reply["error"] + "\n" + reply.get("trace", ""))
    return reply


MATRIX_PATTERNS = ("MM-MM*-*M", "M*M*M*", "MMMM--**")
"""Layer patterns whose splits give attention-free and Mamba-free stages."""


def check_pp_matrix(bed: Testbed, backend: str) -> None:
    """Prefill PP {1,2,3} x decode PP {1,2} over MATRIX_PATTERNS: every handoff bit-exact."""
    for pattern in MATRIX_PATTERNS:
        for pp in (1, 2, 3):
            for dp in (1, 2):
                bed.configure(backend, tiny_model(pattern), pp, dp, seed=pp * 10 + dp)
                hs = two_handoffs(f"{pattern}-{pp}x{dp}")
                case = (backend, pattern, pp, dp)
                assert events_ok(bed.run(hs), [h.rid for h in hs]) is None, case
                assert bed.mismatch(hs) is None, (*case, bed.mismatch(hs))
