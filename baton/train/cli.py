"""`baton train`'s flags (baton/cli.py adds them) and what the command does with them."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from baton.model import family as families


def add_arguments(p: argparse.ArgumentParser) -> None:
    from baton.train.run import Knobs, Settings

    d, k = Settings("", "", 0), Knobs()
    recipes = families.trained()
    sizes = sorted({size for r in recipes.values() for size in r.sizes})
    p.add_argument("--family", choices=sorted(recipes), help="model family (required)")
    p.add_argument("--out", help="output folder (required; must not exist, unless it is this "
                                 "run to resume)")
    p.add_argument("--verify", metavar="DIR", default=None,
                   help="rerun the first --steps steps of the run recorded in DIR/training.json "
                        "(a run's or shipped model's folder; --steps left out: all of them) and "
                        "check its held-out loss is within 0.02 of the one logged there")
    p.add_argument("--distill-mtp", metavar="DIR", default=None,
                   help="train only DIR's MTP head (trunk frozen) to match DIR's own next-token "
                        "distributions on the train part, into --out (baton/train/distill.py; "
                        "--steps required, --lr 1e-3, --warmup 20 and --seed 1 unless given)")
    p.add_argument("--distill-init", default="checkpoint", choices=["checkpoint", "seeded"],
                   help="--distill-mtp: start from DIR's head or the family's seeded init")
    p.add_argument("--size", default=None,
                   help=f"model size: {', '.join(sizes)}; None: the planned one "
                        f"({_planned(recipes, 0)})")
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps; None: the planned ones ({_planned(recipes, 1)})")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per step")
    p.add_argument("--seq", type=int, default=d.seq, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=None, help=f"peak learning rate (AdamW; {d.lr}, distillation 1e-3)")
    p.add_argument("--warmup", type=int, default=None, help=f"warmup steps ({d.warmup}, distillation 20)")
    p.add_argument("--mtp-weight", type=float, default=d.mtp_weight,
                   help="weight of the MTP head's loss (token i+2), trained with the target")
    p.add_argument("--seed", type=int, default=None, help=f"init and batch seed ({d.seed}, distillation 1)")
    p.add_argument("--corpus", default=None,
                   help="stdlib folder to read (default: this interpreter's)")
    p.add_argument("--corpus-hash", default=d.corpus_hash,
                   help="the train part's expected sha256 (16+ hex digits; default: the "
                        "committed manifest's)")
    p.add_argument("--threads", type=int, default=k.threads, help="torch threads")
    p.add_argument("--budget-minutes", type=float, default=k.budget_minutes,
                   help="refuse a run whose measured estimate is longer")
    p.add_argument("--eval-every", type=int, default=k.eval_every,
                   help="steps between held-out evaluations")
    p.add_argument("--eval-tokens", type=int, default=k.eval_tokens,
                   help="held-out tokens of those evaluations (the final one reads all)")
    p.add_argument("--log-every", type=int, default=k.log_every, help="steps between lines")
    p.add_argument("--checkpoint-minutes", type=float, default=k.checkpoint_minutes,
                   help="minutes between checkpoints (also written when stopped)")
    p.add_argument("--dtype", default=k.dtype, choices=["bfloat16", "float32"],
                   help="dtype of the written weights")
    p.add_argument("--nice", type=int, default=k.nice,
                   help="niceness increment (a background run yields the CPU)")


def _planned(recipes: dict, i: int) -> str:
    return ", ".join(f"{family} {r.planned[i]}" for family, r in recipes.items())


def run(args) -> int:
    from baton.errors import ConfigError
    from baton.train.run import Knobs, Settings, planned, train

    if args.verify:
        return _verify(args)
    if args.distill_mtp:
        return _distill(args)
    for flag in ("family", "out"):
        if not getattr(args, flag):
            raise ConfigError(f"--{flag} is required (or --verify DIR)")
    plan = planned(args.family)
    s = Settings(args.family, args.size or plan.size, args.steps or plan.steps,
                 batch=args.batch, seq=args.seq, lr=_given(args.lr, Settings.lr),
                 warmup=_given(args.warmup, Settings.warmup), mtp_weight=args.mtp_weight,
                 seed=_given(args.seed, Settings.seed), corpus_hash=args.corpus_hash)
    k = Knobs(**{f.name: getattr(args, f.name, f.default) for f in dataclasses.fields(Knobs)})
    try:
        train(s, Path(args.out), k, Path(args.corpus) if args.corpus else None)
    except KeyboardInterrupt:
        return 130
    return 0


def _verify(args) -> int:
    from baton.train.run import VERIFY_TOLERANCE, Knobs, verify

    k = Knobs(**{f.name: getattr(args, f.name, f.default) for f in dataclasses.fields(Knobs)})
    try:
        r = verify(Path(args.verify), args.steps, k, Path(args.corpus) if args.corpus else None)
    except KeyboardInterrupt:
        return 130
    ok = abs(r["difference"]) <= VERIFY_TOLERANCE
    print(f"verify {args.verify}: held-out loss at step {r['step']} ({r['tokens']} tokens) "
          f"{r['loss']:.4f} nats/token, recorded {r['recorded_loss']:.4f}: difference "
          f"{r['difference']:+.4f}, {'within' if ok else 'NOT within'} {VERIFY_TOLERANCE}",
          flush=True)
    return 0 if ok else 1


def _given(value, default):
    return default if value is None else value


def _distill(args) -> int:
    from baton.errors import ConfigError
    from baton.train.distill import DistillSettings, distill
    from baton.train.run import Knobs

    if not args.out:
        raise ConfigError("--out is required with --distill-mtp (a new folder, or this "
                          "distillation's to resume)")
    if not args.steps or args.steps < 1:
        raise ConfigError(f"--steps {args.steps!r}: --distill-mtp needs a positive step count")
    d = DistillSettings
    from baton.model.registry import resolve_model

    s = DistillSettings(str(Path(resolve_model(args.distill_mtp)).resolve()), args.steps, batch=args.batch,
                        seq=args.seq, lr=_given(args.lr, d.lr),
                        warmup=_given(args.warmup, d.warmup), seed=_given(args.seed, d.seed),
                        init=args.distill_init)
    k = Knobs(**{f.name: getattr(args, f.name, f.default) for f in dataclasses.fields(Knobs)})
    try:
        distill(s, Path(args.out), k, Path(args.corpus) if args.corpus else None)
    except KeyboardInterrupt:
        return 130
    return 0
