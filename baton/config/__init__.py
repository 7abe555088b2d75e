"""The whole Baton config: sections `model`, `cache`, `transfer`, `router`, `worker`, `cluster`,
`speculative`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Literal

import yaml

from baton.config.base import from_dict, to_dict
from baton.config.cache import CacheConfig
from baton.config.cluster import ClusterConfig
from baton.config.ports import PortRange, port_range
from baton.config.router import RouterConfig
from baton.config.speculative import SpeculativeConfig
from baton.config.transfer import TransferConfig
from baton.errors import ConfigError


@dataclass(frozen=True)
class ModelSection:
    path: str = "tiny"
    """`tiny` (embedded default, made on first use) or an HF checkpoint directory."""
    device: str = "cpu"
    """`cpu`, `cuda` or `cuda:N`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    weight_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """How the linear layers' weights are stored: `float16` / `bfloat16` keep them at half
    the bytes while the arithmetic stays in `dtype` (float32: each weight is upcast exactly
    when used). Opt-in and not exact: logits within 1e-2 (float16) / 5e-2 (bfloat16) of
    float32, greedy tokens equal where float32's top-1 leads by 0.05 (tests/unit/
    test_weight_dtype.py). float32 is the default and the exact reference. Single-
    stage workers only (pipeline stages keep `dtype` weights)."""
    quantize: Literal["int8", "int4"] | None = None
    """Quantize a float checkpoint's projections at load: int8 per output channel or int4 in
    groups of 32 (norms, router, conv, SSM parameters, embeddings and LM head stay exact);
    packed in memory (int8 / int4, read as stored by the CPU kernels). docs/quantization.md.
    Single-process workers (no TP / PP yet)."""
    quantize_activations: Literal["int8"] | None = None
    """Opt-in integer path for int8 / int4 weights on CPU: activations quantized to int8
    per 32 columns (llama.cpp's Q8_0 blocks) and dotted in integers (AVX-512 VNNI / AVX2);
    faster, not exact against the dequantized weights (docs/quantization.md). Needs
    packed int8 / int4 weights (`model.quantize` or such a checkpoint)."""
    quantize_embeddings: Literal["int8"] | None = None
    """Keep the embeddings and the LM head packed int8 (one float32 scale a row; a lookup
    decodes the rows it reads) instead of the model dtype: a quarter of their bytes, at some
    quality (docs/quantization.md). Single-process workers."""

    def __post_init__(self) -> None:
        if self.weight_dtype != "float32" and self.dtype != "float32":
            raise ConfigError(
                f"model.weight_dtype={self.weight_dtype!r} needs model.dtype 'float32' (it "
                f"stores float32-computed weights narrower), got {self.dtype!r}"
            )


@dataclass(frozen=True)
class WorkerConfig:
    max_num_seqs: int = 32
    """Most requests running at once (each holds one live Mamba slot)."""
    prefill_chunk_size: int = 512
    """Most prompt tokens computed per request per step (chunks also end at snapshot points)."""
    max_batch_tokens: int = 2048
    """Most prompt tokens computed per engine step over all requests."""
    prefill_schedule: Literal["fcfs", "fewest_uncached_first"] = "fewest_uncached_first"
    """Which prefilling requests get the step's `max_batch_tokens` first: `fcfs` in admission
    order; `fewest_uncached_first` those with the fewest prompt tokens left to compute, so a
    mostly cached prompt is not stuck behind full prefills (see `prefill_max_wait_s`).
    Policies by name: baton/engine/scheduler.py PREFILL_ORDERS."""
    prefill_max_wait_s: float = 1.0
    """Anti-starvation bound of `fewest_uncached_first`: a request that arrived this many
    seconds ago or more is served before all younger ones, oldest first (`.inf`: no bound;
    0: plain first come, first served)."""
    max_model_len: int = 0
    """Longest prompt + output; 0 = the model's max_position_embeddings."""
    decode_batch_buckets: tuple[int, ...] = ()
    """Batch sizes a plain decode step is padded up to, ascending (e.g. [1, 2, 4, 8, 16, 32]);
    empty = off (the default: on CPU padding only adds work). On, every decode forward has
    one of these batch sizes and a block-table width that is a power of two, its metadata
    lives in the same buffers from step to step, and the model reads it without a host
    synchronisation: the fixed shapes that CUDA graphs capture (not captured yet). Pad rows
    read and write one KV block and one state slot kept out of the cache for them; a batch
    larger than the last bucket runs unpadded. A real row's tokens and states are those of
    an unpadded step, bit for bit on the CPU fast path (tests/unit/engine/test_decode_buckets.py).
    Single-process workers (pipeline and tensor-parallel ones ignore it with a warning)."""
    host: str = "auto"
    """Address this worker advertises to the router and peers, and binds its gRPC server,
    side channel and metrics to. `auto` (or ""): the address of this host's interface that
    routes to the router (127.0.0.1 when the router is on loopback); `--host` overrides."""
    port: int | str = 0
    """gRPC port: 0 = any free port, N = exactly N, "FIRST-LAST" = the first free port of
    that range (`--port` overrides)."""
    metrics_port: int = 0
    """Prometheus `/metrics` HTTP port (0 = pick a free one; the worker prints it on start).
    Set a fixed port where Prometheus scrapes a known address (one worker per host or pod)."""
    pipeline_parallel_size: int = 1
    """Stage processes this worker's layers are split over (`--pipeline-parallel-size`).
    Stage 0 serves gRPC and schedules; every stage holds only its layers' weights and pools."""
    pp_layer_partition: tuple[int, ...] = ()
    """Layers per stage, in order, summing to the model's layer count; empty = as even as
    possible (earlier stages take the remainder). Checked against the model when it loads."""
    tensor_parallel_size: int = 1
    """Rank processes every layer is split over by heads (`--tensor-parallel-size`): rank 0
    schedules and owns the cache manager; each rank holds 1/N of the weights and of every
    pool (KV heads, Mamba heads and groups; KV heads and n_groups == 1 replicated when fewer
    than N). Heads, groups, FFN and vocab must divide (refused at start naming the field);
    MoE layers split their experts as `moe_tp_split` says.
    The cores are split between the ranks; the layout is printed on start. NemotronH and
    Qwen3.5 (DeltaNet by key / value heads). Combines with `pipeline_parallel_size` (TP x PP
    processes: each stage split over TP ranks). Prefill and decode may use different sizes:
    each prefill rank writes its pieces into every decode rank that needs them."""
    torch_threads: int = 0
    """torch threads of this worker's engine process; with pipeline or tensor parallelism
    the total its stage / rank processes divide between them. 0: the `BATON_NUM_THREADS`
    environment variable (which `baton serve` sets to split the machine's cores between its
    workers, and tests and benchmarks pin), else torch's default (every core)."""
    moe_tp_split: Literal["experts", "within"] = "experts"
    """How a MoE layer's routed experts are split over the TP ranks (router, Qwen's shared
    gate and NemotronH's latent projections replicated; the shared expert split within;
    one all-reduce per MoE layer either way; `baton/model/layers/moe_tp.py`):
    `experts` whole experts per rank (expert parallel; the expert count must divide by
    TP): each rank runs only the tokens routed to its experts; `within` every expert on
    every rank, its up / gate rows and down columns split (the expert width must divide).
    `experts` is the default: on the 2-core CPU host (`bench tp` MoE rows, slowest rank's
    CPU time) it used 17% / 12% less than `within` for prefill / decode at TP 2 and 11% /
    12% at TP 4 on a NemotronH MoE of 32 experts (top 4): fewer, larger matmuls per rank,
    each rank looping over its own experts only. With few experts (Qwen3.5-MoE, 8, top 2)
    the two tie at TP 2 and `within` is 2% / 15% cheaper at TP 4 (2 experts per rank leave
    the ranks' loads uneven)."""

    def __post_init__(self) -> None:
        if not self.prefill_max_wait_s >= 0:
            raise ConfigError(
                f"worker.prefill_max_wait_s must be >= 0 seconds, got {self.prefill_max_wait_s}; "
                f"use .inf for no anti-starvation bound"
            )
        b = self.decode_batch_buckets
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in b) \
                or list(b) != sorted(set(b)):
            raise ConfigError(
                f"worker.decode_batch_buckets must be batch sizes >= 1 in ascending order "
                f"without repeats (e.g. [1, 2, 4, 8]), got {list(b)}"
            )
        _ = self.ports  # a bad port is refused when the config loads, not at bind time
        if isinstance(self.torch_threads, bool) or not isinstance(self.torch_threads, int) \
                or self.torch_threads < 0:
            raise ConfigError(f"worker.torch_threads must be an integer >= 0 (0: "
                              f"BATON_NUM_THREADS or torch's default), got {self.torch_threads!r}")
        if self.pipeline_parallel_size < 1:
            raise ConfigError(
                f"worker.pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}"
            )
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(
                self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ConfigError(
                f"worker.tensor_parallel_size must be an integer >= 1, got "
                f"{self.tensor_parallel_size!r}")
        if self.pp_layer_partition and len(self.pp_layer_partition) != self.pipeline_parallel_size:
            raise ConfigError(
                f"worker.pp_layer_partition {list(self.pp_layer_partition)} has "
                f"{len(self.pp_layer_partition)} stages but worker.pipeline_parallel_size is "
                f"{self.pipeline_parallel_size}; give one layer count per stage or leave it empty"
            )
        zero = [i for i, n in enumerate(self.pp_layer_partition) if n < 1]
        if zero:
            raise ConfigError(
                f"worker.pp_layer_partition {list(self.pp_layer_partition)} gives stage {zero[0]} "
                f"no layers; every stage needs at least one layer"
            )

    @cached_property
    def ports(self) -> PortRange:
        return port_range(self.port, "worker.port")


@dataclass(frozen=True)
class BatonConfig:
    model: ModelSection = field(default_factory=ModelSection)
    cache: CacheConfig = field(default_factory=CacheConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    prefill: dict | None = None
    """Per-role overrides of any `worker` key for prefill workers (`baton serve`)."""
    decode: dict | None = None
    """Per-role overrides of any `worker` key for decode workers (`baton serve`)."""

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):
            self.for_role(role)  # a bad override is refused when the config loads

    def for_role(self, role: str) -> BatonConfig:
        """This config with the `prefill:` or `decode:` section's keys over `worker`."""
        override = getattr(self, role, None)
        if not override:
            return self
        if not isinstance(override, dict):
            raise ConfigError(f"{role} must be a mapping of worker keys, got {override!r}")
        worker = from_dict(WorkerConfig, {**to_dict(self.worker), **override}, role)
        return dataclasses.replace(self, worker=worker, prefill=None, decode=None)

    @classmethod
    def from_dict(cls, data: dict | None) -> BatonConfig:
        return from_dict(cls, data, "config")

    @classmethod
    def load(cls, path: str | Path | None) -> BatonConfig:
        if path is None:
            return cls()
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
        return cls.from_dict(data)
