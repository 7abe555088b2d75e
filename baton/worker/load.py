"""A worker's load as the router sees it."""

from __future__ import annotations

from baton.engine.loop import EngineLoop
from baton.proto_gen import baton_pb2


def load_of(loop: EngineLoop) -> baton_pb2.WorkerLoad:
    def read():
        eng = loop.engine
        spec = eng.pools.spec
        return baton_pb2.WorkerLoad(
            running=len(eng.scheduler.running), waiting=len(eng.scheduler.waiting),
            free_blocks=eng.cache.num_free_blocks, free_slots=eng.cache.num_free_slots,
            total_blocks=spec.num_blocks, total_slots=spec.num_slots,
        )

    return loop.call(read)
