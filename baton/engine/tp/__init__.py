"""Tensor parallelism inside one worker: N rank processes, one torch.distributed group, built
like the pipeline's stages (`baton.engine.pipeline`) and sharing its machinery.

    rank 0 (the worker)                          rank k (1..N-1)
    scheduler + HybridCacheManager               its shard of every layer and pool
    its shard of every layer and pool
        |-- control (msgpack, tag CTRL) ------->|  the forward's plan (token ids, positions,
        |                                       |  block tables, slots) + mirrored cache ops
        |== all-reduce / gather (TP group) =====|  inside the layers, in lockstep
        |<-- replies (sync, canaries, stats) ---|  tag REPLY

Every rank runs the same forward on its shard; block and slot ids are rank 0's everywhere
(its cache manager decides, its copy/zero/fill operations are mirrored to every rank ahead
of the next forward). Full logits exist only on rank 0 (the vocab-parallel head gathers
them there). Files: `model.py` (rank 0's drop-in for a family's model, a `PipelineModel`
with one stage of N shards), `rank.py` (the loop of ranks 1..N-1), `launch.py` (processes,
group, threads, the rank layout).
"""
