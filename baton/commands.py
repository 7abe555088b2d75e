"""What each `baton` subcommand does, given parsed arguments."""

from __future__ import annotations

import json
import sys

from baton.config import BatonConfig
from baton.engine.request import SamplingParams
from baton.errors import InvalidRequestError


def cmd_generate(args) -> int:
    from baton.client.requests import RequestSpec, load_jsonl, parse_prompt_ids

    defaults = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
        min_tokens=args.min_tokens, n=args.n,
    )
    if args.requests:
        specs = load_jsonl(args.requests, defaults, args.session)
    elif args.prompt_ids is not None:
        specs = [RequestSpec("req-1", prompt_ids=parse_prompt_ids(args.prompt_ids), session=args.session, sampling=defaults)]
    else:
        specs = [RequestSpec("req-1", prompt=args.prompt, session=args.session, sampling=defaults)]
    ids = [s.id for s in specs]
    if len(set(ids)) != len(ids):
        raise InvalidRequestError("request ids in the requests file must be unique")
    cfg = BatonConfig.load(args.config)
    tp = getattr(args, "tensor_parallel_size", None)
    if tp is not None:
        import dataclasses

        cfg = dataclasses.replace(cfg, worker=dataclasses.replace(cfg.worker,
                                                                   tensor_parallel_size=tp))
    if getattr(args, "speculative_tokens", None) is not None:
        cfg = _with_speculation(cfg, args.speculative_tokens)
    if getattr(args, "quantize", None):
        import dataclasses

        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, quantize=args.quantize))
    if getattr(args, "quantize_activations", None):
        import dataclasses

        cfg = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, quantize_activations=args.quantize_activations))
    if args.local:
        from baton.client.local import run_local
        from baton.engine.builder import build_engine

        engine = build_engine(cfg, args.model)
        try:
            results = run_local(engine, specs, args.concurrency)
        finally:
            if engine.model.capabilities.staged:  # TP ranks / PP stages leave cleanly
                engine.model.close()
    else:
        from baton.auth.tls import cluster_tls, router_channel_credentials
        from baton.client.remote import run_remote

        # TLS as the config says: a router certificate is verified against cluster.tls_ca_file
        # (presenting this host's cluster certificate) or the system trust store
        credentials = router_channel_credentials(cfg.router, cluster_tls(cfg.cluster))
        results = run_remote(args.router, specs, args.concurrency, credentials)
    return _print_results(results, args.json)


def _with_speculation(cfg: BatonConfig, k: int) -> BatonConfig:
    """`--speculative-tokens k` over the config: that key alone (max_batch, a tree stay)."""
    import dataclasses

    return dataclasses.replace(cfg, speculative=cfg.speculative.with_draft_tokens(k))


def _print_results(results: list[dict], as_json: bool) -> int:
    failed = 0
    for r in results:
        if "error" in r:
            failed += 1
            print(f"request {r['id']} failed: {r['error']}", file=sys.stderr)
        elif as_json:
            print(json.dumps(r), flush=True)
        else:
            print(r["text"] if r["text"] else " ".join(map(str, r["token_ids"])), flush=True)
    return 1 if failed else 0


def cmd_make_model(args) -> int:
    from baton.model import family
    from baton.model.make_model import write_checkpoint

    kw = {"seed": args.seed, "preset": args.preset, "family": args.family,
          "tokenizer": args.tokenizer}
    if args.multimodal:
        kw["multimodal"] = True
    if args.pattern:
        kw["pattern"] = args.pattern
    if args.hidden_size:
        kw["hidden_size"] = args.hidden_size
    spec = family.for_model_type(None) if args.family is None else family.by_name(args.family)
    experts = spec.moe_experts_field
    moe = {experts: args.moe_experts, "num_experts_per_tok": args.moe_top_k,
           "moe_latent_size": args.moe_latent_size}
    kw.update({k: v for k, v in moe.items() if v is not None})
    if getattr(args, "mtp_layers", 0):
        kw["mtp_layers"] = args.mtp_layers
    path = write_checkpoint(args.out, **kw)
    print(path)
    return 0


def cmd_serve(args) -> int:
    from baton.cluster.local import serve_local

    return serve_local(args)


def cmd_router(args) -> int:
    from baton.cluster.roles import run_router_role

    return run_router_role(args)


def cmd_prefill_worker(args) -> int:
    from baton.cluster.roles import run_prefill_worker

    return run_prefill_worker(args)


def cmd_decode_worker(args) -> int:
    from baton.cluster.roles import run_decode_worker

    return run_decode_worker(args)


def cmd_train(args) -> int:
    from baton.train.cli import run

    return run(args)


def cmd_bench(args) -> int:
    from bench.main import run_bench

    return run_bench(args)


def cmd_quantize(args) -> int:
    from baton.model.quant.quantize import write_quantized
    from baton.model.registry import resolve_model

    out = write_quantized(resolve_model(args.src), args.out, args.to)
    print(f"wrote {out} ({args.to}, compressed-tensors)")
    return 0


COMMANDS = {
    "generate": cmd_generate,
    "make-model": cmd_make_model,
    "serve": cmd_serve,
    "router": cmd_router,
    "prefill-worker": cmd_prefill_worker,
    "decode-worker": cmd_decode_worker,
    "bench": cmd_bench,
    "quantize": cmd_quantize,
    "train": cmd_train,
}

