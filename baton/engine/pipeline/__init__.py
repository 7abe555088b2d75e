"""Pipeline parallelism inside one worker: N stage processes, one torch.distributed group.

    stage 0 (the worker)                 stage k (1..N-1)               last stage
    scheduler + HybridCacheManager       layers of stage k              + norm_f + LM head
    embeddings + its layers
        |-- control (msgpack bytes) ---->|  every stage, tag CTRL: plan, cache ops, extras
        |-- hidden [mb] --------------->|-- hidden [mb] -------------->|  tag HIDDEN
        |<------------------------------------------------ logits [mb] |  tag OUT
        |<-- replies (sync, extras) -----|                                tag REPLY

Block ids and slot ids are the same on every stage: stage 0's cache manager decides and the
copy/zero operations it makes on its pools are mirrored (`mirror.py`) to the other stages in
order, ahead of the next forward. Files: `channel.py` (the wire), `stage.py` (what a stage
computes and the loop of stages 1..N-1), `model.py` (stage 0's drop-in for a family's model),
`launch.py` (process group, spawning local stages, building a stage).
"""
