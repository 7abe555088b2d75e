"""The `baton` command: one subcommand per role, plus generate, make-model and bench."""

from __future__ import annotations

import argparse
import logging
import sys

from baton.errors import BatonError


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="baton", description=__doc__)
    ap.add_argument("--log-level", default="INFO")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("serve", help="router + N prefill + M decode workers on this machine")
    p.add_argument("--model", default="tiny")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--host", default="127.0.0.1",
                   help="interface the router listens on (default 127.0.0.1: this machine only)")
    p.add_argument("--http-port", type=int, default=None,
                   help="OpenAI-compatible HTTP port (default: config router.http_port, 8000)")
    p.add_argument("--config")

    p = sub.add_parser("router", help="the router alone (gRPC and the OpenAI-compatible HTTP API)")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--host", default=None,
                   help="interface to listen on (default: config router.host)")
    p.add_argument("--http-port", type=int, default=None,
                   help="OpenAI-compatible HTTP port (default: config router.http_port, 8000)")
    p.add_argument("--config")
    p.add_argument("--model", default=None,
                   help="checkpoint whose tokenizer encodes text prompts (default: config model.path)")

    for role in ("prefill-worker", "decode-worker"):
        p = sub.add_parser(role, help=f"one {role} that registers with a router")
        p.add_argument("--router", required=True, help="HOST:PORT of the router")
        p.add_argument("--model", default="tiny")
        p.add_argument("--config")
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
        p.add_argument("--pp-rank", type=int, default=None,
                       help="run only this pipeline stage (with --pp-master), for launchers "
                            "that place stages on different hosts; 0 serves gRPC")
        p.add_argument("--pp-master", default=None,
                       help="HOST:PORT of the stages' rendezvous, hosted by stage 0")

    p = sub.add_parser("generate", help="send requests to a router or a local engine")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--router", help="HOST:PORT of a running router")
    g.add_argument("--local", action="store_true", help="run the colocated engine in-process")
    p.add_argument("--model", default="tiny")
    p.add_argument("--config")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-ids")
    src.add_argument("--requests", help="JSONL file, one request a line")
    _add_sampling(p)
    p.add_argument("--session")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.add_argument("--speculative-tokens", type=int, default=None,
                   help="--local: MTP draft tokens per decode step, 0..8 (default: config "
                        "speculative.num_draft_tokens, 0 = off)")

    p = sub.add_parser("make-model", help="write a small seeded NemotronH checkpoint")
    p.add_argument("--out", required=True)
    p.add_argument("--pattern", default=None)
    p.add_argument("--hidden-size", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="tiny", help="tiny or 100m")
    p.add_argument("--family", default="nemotron_h", choices=["nemotron_h", "qwen3_5"])
    p.add_argument("--multimodal", action="store_true",
                   help="qwen3_5: the published multimodal layout (text_config, a vision stub)")
    p.add_argument("--mtp-layers", type=int, default=0,
                   help="add an MTP head (num_nextn_predict_layers; a dense '*-' block)")

    p = sub.add_parser("bench", help="benchmarks against their baselines")
    p.add_argument("which", choices=["engine", "reuse", "transfer", "router", "e2e", "handoff",
                                     "pp", "http", "soak", "spec", "all"])
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None, help="folder for JSON, markdown and plots")
    p.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    p.add_argument("--hosts", choices=["local", "netns"], default="local",
                   help="e2e: netns puts router, prefill and decode in network namespaces "
                        "(KV over UCX TCP, link rates shaped with tc; root)")
    p.add_argument("--minutes", type=float, default=None,
                   help="soak: how long to run (default 2; --quick: 0.25)")
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
