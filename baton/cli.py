"""The `baton` command: one subcommand per role, plus generate, make-model and bench."""

from __future__ import annotations

import baton.startup  # noqa: F401 - first: this module is a process's entry point

# isort: split

import argparse
import logging
import sys

from baton.errors import BatonError
from baton.model import family as families


class _Parser(argparse.ArgumentParser):
    """Every flag's help shows its default; a bad value is one line on stderr (exit 2)."""

    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kw)
        self.flags_later = None
        """Adds this parser's flags when it first parses: `train`'s import torch, which every
        other command (the router among them) then starts without."""

    def parse_known_args(self, args=None, namespace=None):
        if self.flags_later is not None:
            add, self.flags_later = self.flags_later, None
            add(self)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=16,
                   help="most tokens to generate per request, the first one included")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass kept, in (0, 1]")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    p.add_argument("--seed", type=int, default=None,
                   help="per-request seed: the same seed gives the same tokens")
    p.add_argument("--logprobs", type=int, default=None,
                   help="report each token's logprob and this many alternatives (0-20); "
                        "--json adds them as `logprobs`")
    p.add_argument("--prompt-logprobs", type=int, default=None,
                   help="report every prompt token's logprob and this many alternatives "
                        "(0-20; the prompt is computed whole); --json adds `prompt_logprobs`")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted once from tokens the output holds, in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted per occurrence in the output, in [-2, 2]")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divides positive (multiplies negative) logits of tokens already in "
                        "the prompt or output; 1 = off")
    p.add_argument("--min-tokens", type=int, default=0,
                   help="EOS and stop tokens are not drawn before this many tokens")
    p.add_argument("--n", type=int, default=1,
                   help="samples of each prompt (one prefill, n decodes; sample i seeded "
                        "seed + i); one result line each, --json adds its `index`")


MODEL_HELP = ("`tiny` (the embedded seeded model, made on first use), `code-nemotron_h` or "
              "`code-qwen3_5` (trained, once shipped: docs/training.md) or a checkpoint folder")
CONFIG_HELP = "YAML config file (sections model, cache, transfer, router, worker, cluster)"


def _add_quantize(p, who: str = "") -> None:
    p.add_argument("--quantize", choices=["int8", "int4"], default=None,
                   help=f"{who}quantize the projections at load, kept int8 / int4 in memory "
                        "(default: config model.quantize; docs/quantization.md)")
    p.add_argument("--quantize-activations", choices=["int8"], default=None,
                   help=f"{who}int8 / int4 weights dotted with int8 activations (faster, not "
                        "exact; default: config model.quantize_activations)")


def _train_flags(p: argparse.ArgumentParser) -> None:
    from baton.train.cli import add_arguments

    add_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="baton", description=__doc__)
    ap.add_argument("--log-level", default="INFO",
                    help="DEBUG, INFO, WARNING or ERROR (logs go to stderr)")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    p = sub.add_parser("serve", help="router + N prefill + M decode workers on this machine")
    p.add_argument("--model", default="tiny", help=MODEL_HELP)
    p.add_argument("--prefill", type=int, default=1, help="prefill worker processes")
    p.add_argument("--decode", type=int, default=1, help="decode worker processes")
    p.add_argument("--port", type=int, default=50051, help="the router's gRPC port")
    p.add_argument("--host", default="127.0.0.1",
                   help="interface the router listens on (default 127.0.0.1: this machine only)")
    p.add_argument("--http-port", type=int, default=None,
                   help="OpenAI-compatible HTTP port (default: config router.http_port, 8000)")
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="TP ranks of every prefill and decode worker (default: config "
                        "worker.tensor_parallel_size and the per-role sections)")
    p.add_argument("--speculative-tokens", type=int, default=None,
                   help="MTP draft tokens per decode step, 0..8 (default: config "
                        "speculative.num_draft_tokens, 0 = off; the section's other keys stay)")
    _add_quantize(p, "every worker: ")

    p = sub.add_parser("router", help="the router alone (gRPC and the OpenAI-compatible HTTP API)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port")
    p.add_argument("--host", default=None,
                   help="interface to listen on (default: config router.host)")
    p.add_argument("--http-port", type=int, default=None,
                   help="OpenAI-compatible HTTP port (default: config router.http_port, 8000)")
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--model", default=None,
                   help="checkpoint whose tokenizer encodes text prompts (default: config model.path)")
    _add_quantize(p, "the format /v1/models names: ")

    for role in ("prefill-worker", "decode-worker"):
        p = sub.add_parser(role, help=f"one {role} that registers with a router")
        p.add_argument("--router", required=True, help="HOST:PORT of the router")
        p.add_argument("--model", default="tiny", help=MODEL_HELP)
        p.add_argument("--config", help=CONFIG_HELP)
        p.add_argument("--port", default=None,
                       help="gRPC port: N, FIRST-LAST (the first free one) or 0 for any "
                            "(default: config worker.port)")
        p.add_argument("--host", default=None,
                       help="address to advertise and bind (default: config worker.host; "
                            "auto: the address that routes to --router)")
        p.add_argument("--metrics-port", type=int, default=None,
                       help="Prometheus /metrics port (default: config worker.metrics_port; "
                            "0 = a free port)")
        p.add_argument("--pipeline-parallel-size", type=int, default=None,
                       help="stage processes to split the layers over (default: config "
                            "worker.pipeline_parallel_size); stage 0 starts the others")
        p.add_argument("--tensor-parallel-size", type=int, default=None,
                       help="rank processes to split every layer over by heads (default: "
                            "config worker.tensor_parallel_size); rank 0 starts the others")
        p.add_argument("--pp-rank", type=int, default=None,
                       help="run only this pipeline stage (with --pp-master), for launchers "
                            "that place stages on different hosts; 0 serves gRPC")
        p.add_argument("--pp-master", default=None,
                       help="HOST:PORT of the stages' rendezvous, hosted by stage 0")
        p.add_argument("--speculative-tokens", type=int, default=None,
                       help="MTP draft tokens per decode step, 0..8 (default: config "
                            "speculative.num_draft_tokens, 0 = off; the section's other "
                            "keys stay)")
        _add_quantize(p)

    p = sub.add_parser("generate", help="send requests to a router or a local engine")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--router", help="HOST:PORT of a running router")
    g.add_argument("--local", action="store_true", help="run the colocated engine in-process")
    p.add_argument("--model", default="tiny", help=MODEL_HELP + " (with --local)")
    p.add_argument("--config", help=CONFIG_HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt, as text (the model's tokenizer encodes it)")
    src.add_argument("--prompt-ids", help="one prompt, as comma-separated token ids")
    src.add_argument("--requests", help="JSONL file, one request a line")
    _add_sampling(p)
    p.add_argument("--session", help="session id: its requests stay on the same workers")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    p.add_argument("--json", action="store_true", help="one JSON object a request on stdout")
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="--local: rank processes to split every layer over (default: config "
                        "worker.tensor_parallel_size)")
    p.add_argument("--speculative-tokens", type=int, default=None,
                   help="--local: MTP draft tokens per decode step, 0..8 (default: config "
                        "speculative.num_draft_tokens, 0 = off)")

    _add_quantize(p, "--local: ")

    p = sub.add_parser("quantize", help="write a float checkpoint as int8 / int4 "
                       "(compressed-tensors)")
    p.add_argument("src", help="float checkpoint folder (or a named model)")
    p.add_argument("out", help="new folder to write")
    p.add_argument("--to", required=True, choices=["int8", "int4"],
                   help="int8: per output channel; int4: groups of 32, float16 scales")

    p = sub.add_parser("make-model", help="write a small seeded checkpoint of a registered family")
    p.add_argument("--out", required=True, help="folder to write the checkpoint into")
    p.add_argument("--pattern", default=None,
                   help="layer pattern: M = Mamba2, * = attention, - = MLP (default: the "
                        "preset's)")
    p.add_argument("--hidden-size", type=int, default=None,
                   help="hidden size (default: the preset's)")
    p.add_argument("--seed", type=int, default=0, help="weight seed")
    p.add_argument("--preset", default="tiny", help="tiny or 100m")
    p.add_argument("--tokenizer", action=argparse.BooleanOptionalAction, default=True,
                   help="write tokenizer.json (byte-level BPE trained on the shipped text, as the "
                        "named models have; default on); --no-tokenizer: text is one id a byte")
    p.add_argument("--family", default=families.for_model_type(None).name,
                   choices=families.names(), help="model family (config.json model_type)")
    p.add_argument("--multimodal", action="store_true",
                   help="the published multimodal layout (text_config, a vision stub), for "
                        "families that have one")
    p.add_argument("--moe-experts", type=int, default=None, help="routed experts per E layer")
    p.add_argument("--moe-top-k", type=int, default=None, help="experts per token")
    p.add_argument("--moe-latent-size", type=int, default=None, help="latent MoE width")
    p.add_argument("--mtp-layers", type=int, default=0,
                   help="add an MTP head (num_nextn_predict_layers; a dense '*-' block)")

    p = sub.add_parser("train", help="train a small NemotronH or Qwen3.5 (with an MTP head) "
                                     "on the Python standard library's source, on CPU")
    p.flags_later = _train_flags

    p = sub.add_parser("bench", help="benchmarks against their baselines")
    from bench import BENCHES

    p.add_argument("which", choices=[*BENCHES, "all"], help="which benchmark")
    p.add_argument("--json", action="store_true", help="one JSON object a measurement")
    p.add_argument("--out", default=None, help="folder for JSON, markdown and plots")
    p.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    p.add_argument("--peer", choices=["llamacpp"], default=None,
                   help="engine: compare with llama.cpp on the same checkpoint (builds "
                        "llama-cpp-python into its own cached venv on first use)")
    p.add_argument("--hosts", choices=["local", "netns"], default="local",
                   help="e2e: netns puts router, prefill and decode in network namespaces "
                        "(KV over UCX TCP, link rates shaped with tc; root)")
    p.add_argument("--minutes", type=float, default=None,
                   help="soak: how long to run (default 2; --quick: 0.25)")
    p.add_argument("--model", default=None,
                   help="quality, spec: the model (a named one or a folder; quality: default tiny; spec: "
                        "default a seeded 100m with a distilled head)")
    p.add_argument("--variant", default=None,
                   help="quality: YAML config of the engine variant compared with the float32 "
                        "reference (default: model.dtype bfloat16)")
    p.add_argument("--trace", default=None,
                   help="reuse: replay this multi-turn trace (Mooncake/AIPerf JSONL) at pools "
                        "of 100/50/25%% of its working set, LRU vs value-aware, with and "
                        "without the disk tier (bench/reuse_trace.py)")
    p.add_argument("--cluster", action="store_true",
                   help="reuse --trace: replay through 1 prefill + 1 decode worker behind the "
                        "router, TTFT at the client (bench/reuse_trace_cluster.py)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from baton import commands

    try:
        return commands.COMMANDS[args.cmd](args)
    except BatonError as e:
        print(f"baton {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
