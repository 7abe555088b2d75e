"""How pipeline stages split a model's layers: contiguous global ranges."""

from __future__ import annotations

from baton.errors import ConfigError


def partition_layers(num_layers: int, size: int, partition: tuple[int, ...] = ()) -> list[range]:
    """The global layer range of each of `size` stages; errors name the config field."""
    if size > num_layers:
        raise ConfigError(
            f"worker.pipeline_parallel_size={size} is larger than the model's {num_layers} "
            f"layers; every stage needs at least one layer"
        )
    if partition:
        if len(partition) != size or any(n < 1 for n in partition):
            raise ConfigError(
                f"worker.pp_layer_partition {list(partition)} must give each of the "
                f"{size} stages at least one layer"
            )
        if sum(partition) != num_layers:
            raise ConfigError(
                f"worker.pp_layer_partition {list(partition)} sums to {sum(partition)} layers "
                f"but the model has {num_layers}; make the counts add up to {num_layers}"
            )
        counts = list(partition)
    else:
        q, r = divmod(num_layers, size)
        counts = [q + (1 if i < r else 0) for i in range(size)]
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out
