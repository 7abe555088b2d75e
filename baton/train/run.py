"""`baton train`: one model, from its settings to a checkpoint folder Baton serves.

    check    the corpus (missing / hash differs), the output folder (exists and is not
             this run's), the size against the time budget (two measured steps): one line each
    prepare  tokenizer (trained on the train part) and token streams, written into OUT
    train    AdamW, warmup then cosine; loss = next-token + mtp_weight x MTP (token i+2);
             progress every log_every steps, held-out loss every eval_every, the whole state
             to OUT/.train/state.pt every checkpoint_minutes and when stopped (SIGINT/SIGTERM)
    finish   config.json + model.safetensors (published names, --dtype), training.json

Run again with the same arguments after an interruption: it resumes from the last checkpoint
(the batches are a function of (seed, step), so the run continues as if never stopped).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from baton.errors import ConfigError
from baton.train import corpus as corpus_mod
from baton.train import data, models
from baton.train import tokenizer as tokenizer_mod

STATE = ".train"


@dataclass(frozen=True)
class Settings:
    family: str
    size: str
    steps: int
    batch: int = 8
    seq: int = 256
    lr: float = 2e-3
    warmup: int = 100
    mtp_weight: float = 0.3
    """Weight of the MTP head's loss (multi-token prediction, trained with the target)."""
    seed: int = 0
    corpus_hash: str = ""
    """The train part's digest (its first 16 hex digits suffice); "" = the manifest's."""

    @property
    def tokens(self) -> int:
        return self.steps * self.batch * self.seq


@dataclass(frozen=True)
class Knobs:
    """How a run goes, not what it makes (may change between a run and its resume)."""

    threads: int = 1
    budget_minutes: float = 120.0
    eval_every: int = 250
    eval_tokens: int = 16384
    final_eval_tokens: int | None = None
    """Held-out tokens of the final evaluation (None: all of them)."""
    log_every: int = 10
    checkpoint_minutes: float = 5.0
    dtype: str = "bfloat16"
    nice: int = 10


def planned(family: str) -> Settings:
    """The settings of `family`'s shipped model (its `TrainRecipe.planned`; docs/training.md:
    measured step times, the plan)."""
    size, steps = models.recipe(family).planned
    return Settings(family, size, steps=steps)


def say(msg: str) -> None:
    print(msg, flush=True)


def train(s: Settings, out: Path, k: Knobs = Knobs(), corpus_root: Path | None = None) -> dict:
    """Train (or resume) into `out`; returns the final held-out figures."""
    out = Path(out)
    state_dir = out / STATE
    models.fields(s.family, s.size)  # an unknown family or size, before anything else
    resume = _check_out(out, s)
    corpus, model, config, opt = _start(s, k, corpus_root)
    if not resume:
        _check_budget(model, opt, s, k)
    state_dir.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(out, corpus, resume)
    train_ids = data.stream(tok, [d.text for d in corpus.train])
    held_ids = data.stream(tok, [d.text for d in corpus_mod.heldout()])
    tbytes = torch.tensor(tokenizer_mod.token_bytes(tok) + [0] * (models.VOCAB
                                                                   - tok.get_vocab_size()))
    step, log = 0, []
    if resume:
        st = torch.load(state_dir / "state.pt", weights_only=True)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, log = st["step"], json.loads(st["log"])
        say(f"resuming {out} at step {step}/{s.steps}")
    else:
        (state_dir / "settings.json").write_text(json.dumps(dataclasses.asdict(s), indent=1))
        say(f"training {s.family} {s.size}: {models.num_params(model) / 1e6:.2f}M parameters, "
            f"{s.steps} steps of {s.batch}x{s.seq} tokens ({s.tokens / 1e6:.1f}M; the train "
            f"part is {len(train_ids) / 1e6:.2f}M), {k.threads} thread(s) -> {out}")
        ev = evaluate(model, held_ids, tbytes, s, k.eval_tokens)  # the seeded random model
        log.append({"step": 0, **ev})
        say(f"held-out @ 0: {_fmt(ev)}")
    stop = _Stop()
    try:
        step, log = _loop(model, opt, s, k, train_ids, held_ids, tbytes, step, log, stop,
                          state_dir)
    finally:
        stop.close()
    if step < s.steps:
        say(f"stopped at step {step}/{s.steps}; run the same command again to resume")
        raise KeyboardInterrupt
    ev = evaluate(model, held_ids, tbytes, s, k.final_eval_tokens)
    say(f"held-out ({ev['tokens']} tokens): {_fmt(ev)}")
    models.save(model, config, out, getattr(torch, k.dtype))
    result = {"settings": dataclasses.asdict(s), "corpus_sha256": corpus.digest,
              "python_corpus": corpus_mod.manifest().get("python"),
              "parameters": models.num_params(model), "heldout": ev, "log": log}
    (out / "training.json").write_text(json.dumps(result, indent=1) + "\n")
    say(f"wrote {out}")
    return ev


VERIFY_TOLERANCE = 0.02
"""A rerun with the same settings lands within this of the recorded held-out loss (nats)."""


def verify(folder: Path, steps: int | None, k: Knobs = Knobs(),
           corpus_root: Path | None = None) -> dict:
    """Rerun the first `steps` steps of the run recorded in folder/training.json (its settings,
    corpus and tokenizer, the full schedule) and compare the held-out loss with the one logged
    at that step; None: the whole run against its final figures. Returns both losses; the
    caller judges |difference| <= VERIFY_TOLERANCE. Nothing is written into `folder`."""
    import tempfile

    folder = Path(folder)
    record_path = folder / "training.json"
    if not record_path.is_file():
        raise ConfigError(f"--verify {folder}: no training.json there (a finished "
                          f"`baton train` run or a shipped model folder)")
    record = json.loads(record_path.read_text())
    s = Settings(**record["settings"])
    if steps is None or steps == s.steps:
        steps, want = s.steps, record["heldout"]
    else:
        logged = {e["step"]: e for e in record["log"] if e["step"] > 0}
        if steps not in logged:
            raise ConfigError(f"--steps {steps}: {record_path} logs the held-out loss at steps "
                              f"{sorted(logged)} and {s.steps} (the end)")
        want = logged[steps]
    corpus, model, _, opt = _start(s, k, corpus_root)
    tok = tokenizer_mod.build(corpus, models.VOCAB)
    train_ids = data.stream(tok, [d.text for d in corpus.train])
    held_ids = data.stream(tok, [d.text for d in corpus_mod.heldout()])
    tbytes = torch.tensor(tokenizer_mod.token_bytes(tok) + [0] * (models.VOCAB
                                                                   - tok.get_vocab_size()))
    say(f"verifying {folder}: {s.family} {s.size}, the first {steps} of {s.steps} steps")
    quiet = dataclasses.replace(k, eval_every=s.steps + 1, checkpoint_minutes=1e9)
    stop = _StopAt(steps)
    try:
        with tempfile.TemporaryDirectory(prefix="baton-verify-") as tmp:
            done, _ = _loop(model, opt, s, quiet, train_ids, held_ids, tbytes, 0, [], stop,
                            Path(tmp))
    finally:
        stop.close()
    if done < steps:
        raise KeyboardInterrupt
    ev = evaluate(model, held_ids, tbytes, s, want["tokens"])
    return {"step": steps, "tokens": ev["tokens"], "loss": ev["loss"],
            "recorded_loss": want["loss"], "difference": ev["loss"] - want["loss"]}


def _loop(model, opt, s, k, train_ids, held_ids, tbytes, step, log, stop, state_dir):
    """Steps until the last or a stop; the state is saved on the way out."""
    last_ckpt, t_log, done_log = time.monotonic(), time.monotonic(), step
    while step < s.steps and not stop.asked:
        for g in opt.param_groups:
            g["lr"] = _lr(s, step)
        loss, mloss = model(data.batch(train_ids, s.seed, step, s.batch, s.seq))
        (loss + s.mtp_weight * mloss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % k.log_every == 0 or step == s.steps:
            dt = (time.monotonic() - t_log) / (step - done_log)
            t_log, done_log = time.monotonic(), step
            say(f"step {step}/{s.steps} loss {loss.item():.3f} mtp {mloss.item():.3f} "
                f"lr {_lr(s, step - 1):.2e} | {dt:.2f} s/step, eta {_hms(dt * (s.steps - step))}")
        if step % k.eval_every == 0 and step < s.steps:
            ev = evaluate(model, held_ids, tbytes, s, k.eval_tokens)
            log.append({"step": step, **ev})
            say(f"held-out @ {step}: {_fmt(ev)}")
        if time.monotonic() - last_ckpt > k.checkpoint_minutes * 60:
            _save_state(state_dir, model, opt, step, log)
            last_ckpt = time.monotonic()
    _save_state(state_dir, model, opt, step, log)
    return step, log


@torch.no_grad()
def evaluate(model, held_ids, tbytes, s: Settings, max_tokens: int | None) -> dict:
    """Held-out next-token loss (nats/token), bits per byte, the MTP head's loss and how often
    its argmax equals the target's at the next position (its greedy acceptance)."""
    wins = data.windows(held_ids, s.seq, max_tokens)
    model.eval()
    nats = mnats = agree = n = mn = 0.0
    for i in range(0, len(wins), s.batch):
        ids = wins[i : i + s.batch]
        x, y = ids[:, :-1], ids[:, 1:]
        h = model.lm.model(input_ids=x).last_hidden_state
        lg = model.lm.lm_head(h).float()
        nats += float(torch.nn.functional.cross_entropy(lg.transpose(1, 2), y, reduction="sum"))
        m = model.lm.lm_head(model.mtp(h[:, :-1], y[:, :-1],
                                       model.lm.get_input_embeddings())).float()
        mnats += float(torch.nn.functional.cross_entropy(m.transpose(1, 2), y[:, 1:],
                                                         reduction="sum"))
        agree += float((m.argmax(-1) == lg[:, 1:].argmax(-1)).sum())
        n += y.numel()
        mn += y[:, 1:].numel()
    model.train()
    targets = wins[:, 1:]
    return {"tokens": int(n), "loss": nats / n,
            "bits_per_byte": data.bits_per_byte(nats, targets, tbytes),
            "mtp_loss": mnats / mn, "mtp_agreement": agree / mn}


def _fmt(ev: dict) -> str:
    return (f"loss {ev['loss']:.3f} nats/token, {ev['bits_per_byte']:.3f} bits/byte; MTP loss "
            f"{ev['mtp_loss']:.3f}, agrees with the target's top-1 {ev['mtp_agreement']:.1%}")


def _check_out(out: Path, s: Settings) -> bool:
    """True to resume; ConfigError for a folder that is not this run's."""
    if not out.exists():
        return False
    settings = out / STATE / "settings.json"
    if (out / "training.json").exists():
        raise ConfigError(f"output folder {out} holds a finished run: choose a new --out")
    if not settings.is_file():
        raise ConfigError(f"output folder {out} exists and is not a baton train run to "
                          f"resume: choose a new --out")
    old = json.loads(settings.read_text())
    diff = [f"{k}={old.get(k)!r} there, {v!r} now" for k, v in dataclasses.asdict(s).items()
            if old.get(k) != v]
    if diff:
        raise ConfigError(f"output folder {out} is a run with other settings ({diff[0]}): "
                          f"resume it with its own settings or choose a new --out")
    if not (out / STATE / "state.pt").is_file():
        return False  # stopped before its first checkpoint: start it over
    return True


def _check_budget(model, opt, s: Settings, k: Knobs) -> None:
    """Two timed steps (after one untimed) on a copy: ConfigError when the run's estimate
    (steps and evaluations) is over the budget."""
    import copy

    m, o = copy.deepcopy(model), copy.deepcopy(opt)
    ids = torch.randint(3, models.VOCAB, (s.batch, s.seq + 1))
    times = []
    for _ in range(3):
        t = time.monotonic()
        loss, mloss = m(ids)
        (loss + s.mtp_weight * mloss).backward()
        o.step()
        o.zero_grad(set_to_none=True)
        times.append(time.monotonic() - t)
    per = min(times[1:])
    evals = (s.steps // k.eval_every) * k.eval_tokens + 400_000  # the final one: all of it
    est = per * (s.steps + 0.4 * evals / (s.batch * s.seq))
    if est > k.budget_minutes * 60:
        raise ConfigError(
            f"size {s.family} {s.size} with {s.steps} steps of {s.batch}x{s.seq} needs about "
            f"{_hms(est)} here ({per:.2f} s/step measured on {k.threads} thread(s)), over the "
            f"budget of {_hms(k.budget_minutes * 60)}: pick a smaller --size or fewer --steps, "
            f"or raise --budget-minutes")
    say(f"estimate: {_hms(est)} ({per:.2f} s/step measured), budget {_hms(k.budget_minutes * 60)}")


def _tokenizer(out: Path, corpus, resume: bool):
    from tokenizers import Tokenizer

    path = out / "tokenizer.json"
    if resume and path.is_file():
        return Tokenizer.from_file(str(path))
    tok = tokenizer_mod.build(corpus, models.VOCAB)
    tokenizer_mod.write(tok, out, 8192)
    return tok


def _save_state(state_dir: Path, model, opt, step: int, log: list) -> None:
    tmp = state_dir / "state.pt.tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                "log": json.dumps(log)}, tmp)
    os.replace(tmp, state_dir / "state.pt")


def _lr(s: Settings, step: int) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    t = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t))))


def _hms(sec: float) -> str:
    sec = int(sec)
    return f"{sec // 3600}h{sec % 3600 // 60:02d}m{sec % 60:02d}s"


class _StopAt:
    """Stops `_loop` after `steps` steps (and on SIGINT / SIGTERM)."""

    def __init__(self, steps: int):
        self.steps, self.checks, self.stop = steps, 0, _Stop()

    @property
    def asked(self) -> bool:
        self.checks += 1
        return self.checks > self.steps or self.stop.asked

    def close(self) -> None:
        self.stop.close()


class _Stop:
    """SIGINT / SIGTERM ask the loop to stop after its step (it then checkpoints)."""

    def __init__(self):
        self.asked = False
        self._old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._ask)
            except ValueError:  # not the main thread: no handlers
                pass

    def close(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _ask(self, *_):
        if self.asked:
            sys.exit(130)
        self.asked = True
        say("stopping after this step (again to stop now)")


def _start(s, k, corpus_root):
    """(corpus, model, config, optimizer) of a run's settings `s` and knobs `k`: the corpus
    checked against its digest, the process niced and threaded, the model built from the
    seed (a training run and `--verify` start the same way)."""
    corpus = corpus_mod.scan(corpus_root)
    corpus_mod.check(corpus, s.corpus_hash or corpus_mod.manifest().get("train_sha256", ""))
    if k.nice:
        os.nice(k.nice)
    torch.set_num_threads(k.threads)
    torch.manual_seed(s.seed)
    model, config = models.build(s.family, s.size, s.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.1)
    return corpus, model, config, opt
