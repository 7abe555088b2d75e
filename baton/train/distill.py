"""`baton train --distill-mtp DIR`: train a finished model's MTP head alone, by distillation.

The trunk (embedding, layers, final norm, LM head) is frozen; only `mtp.*` learns. On the
training corpus split (the windows of `data.batch`, drawn from (seed, step) alone) the head at
position i reads what it reads when serving, the target's final-normed hidden h_i and the token
t_{i+1}, and is trained to match the target's own next-token distribution at i+1 (the
distribution of token i+2):

    loss = mean_i KL(softmax(target logits at i+1) || softmax(head logits at i))

The head starts from DIR's head (`--distill-init checkpoint`, the default) or from the seeded
init of the family (`seeded`). One thread and nice +10 by default; progress every
`--log-every` steps; the held-out KL and top-1 agreement every `--eval-every` steps; the head
and its AdamW state to OUT/.distill/state.pt every `--checkpoint-minutes` and when stopped.
Run the same command again to resume. The output folder is DIR's files with only the `mtp.*`
tensors replaced (the trunk's bytes are DIR's), and `distill.json` (settings, figures, log).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from baton.errors import ConfigError
from baton.train import corpus as corpus_mod
from baton.train import data, models
from baton.train.run import Knobs, _hms, _lr, _Stop, say

STATE = ".distill"
COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json", "training.json")


@dataclass(frozen=True)
class DistillSettings:
    source: str
    """The model folder whose head is distilled (its training.json names family and size)."""
    steps: int
    batch: int = 8
    seq: int = 256
    lr: float = 1e-3
    warmup: int = 20
    seed: int = 1
    """Batch seed (1: other windows than the training run's seed 0 drew)."""
    init: str = "checkpoint"
    """The head's start: "checkpoint" (DIR's head) or "seeded" (the family's seeded init)."""


def load(folder: Path, init: str = "checkpoint") -> tuple[models.Trainee, dict, dict]:
    """(the model with DIR's weights in float32, its training settings, config.json dict)."""
    folder = Path(folder)
    rec = folder / "training.json"
    if not rec.is_file():
        raise ConfigError(f"--distill-mtp {folder}: no training.json there (a finished "
                          f"`baton train` run or a shipped model folder)")
    settings = json.loads(rec.read_text())["settings"]
    model, _ = models.build(settings["family"], settings["size"], settings["seed"])
    config = json.loads((folder / "config.json").read_text())
    saved = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    renames = {v: k for k, v in models.recipe(settings["family"]).published_prefixes.items()}
    trunk = {}
    for k, v in saved.items():
        if k.startswith("mtp."):
            continue
        prefix = next((p for p in renames if k.startswith(p)), None)
        trunk[renames[prefix] + k[len(prefix):] if prefix is not None else k] = v
    missing, unexpected = model.lm.load_state_dict(trunk, strict=False)
    tied = model.lm.config.tie_word_embeddings
    if unexpected or missing != (["lm_head.weight"] if tied else []):
        raise ConfigError(f"--distill-mtp {folder}: model.safetensors does not match "
                          f"{settings['family']} {settings['size']} (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]})")
    if init == "checkpoint":
        model.mtp.load_state_dict({k[4:]: v for k, v in saved.items() if k.startswith("mtp.")})
    elif init != "seeded":
        raise ConfigError(f"--distill-init {init!r}: one of checkpoint, seeded")
    for p in model.lm.parameters():
        p.requires_grad_(False)
    model.lm.eval()
    return model, settings, config


def _kl(model: models.Trainee, ids: torch.Tensor):
    """(mean KL(target || head) per position, head argmax == target argmax count, positions)
    over windows ids [B, T]: the head at i (h_i, t_{i+1}) against the target at i+1."""
    with torch.no_grad():
        h = model.lm.model(input_ids=ids).last_hidden_state
        target = F.log_softmax(model.lm.lm_head(h[:, 1:]).float(), -1)
    m = model.mtp(h[:, :-1], ids[:, 1:], model.lm.get_input_embeddings())
    head = F.log_softmax(model.lm.lm_head(m).float(), -1)
    kl = F.kl_div(head.flatten(0, 1), target.flatten(0, 1), log_target=True,
                  reduction="batchmean")
    agree = int((head.argmax(-1) == target.argmax(-1)).sum())
    return kl, agree, head.shape[0] * head.shape[1]


@torch.no_grad()
def evaluate(model: models.Trainee, held_ids, seq: int, batch: int, max_tokens: int | None):
    """Held-out mean KL(target || head) and top-1 agreement of the head with the target."""
    wins = data.windows(held_ids, seq, max_tokens)[:, :-1]
    model.mtp.eval()
    kls = agree = n = 0.0
    for i in range(0, len(wins), batch):
        kl, a, m = _kl(model, wins[i : i + batch])
        kls += float(kl) * m
        agree += a
        n += m
    model.mtp.train()
    return {"tokens": int(n), "kl": kls / n, "agreement": agree / n}


def _fmt(ev: dict) -> str:
    return f"KL(target || head) {ev['kl']:.4f} nats, agrees with the target's top-1 " \
           f"{ev['agreement']:.1%} ({ev['tokens']} positions)"


def distill(s: DistillSettings, out: Path, k: Knobs | None = None,
            corpus_root: Path | None = None) -> dict:
    """Distill (or resume distilling) `s.source`'s head into `out`; the final held-out figures."""
    from tokenizers import Tokenizer

    k = k or Knobs()
    out, src = Path(out), Path(s.source)
    state_dir = out / STATE
    resume = _check_out(out, s)
    if k.nice:
        os.nice(k.nice)
    torch.set_num_threads(k.threads)
    torch.manual_seed(s.seed)
    model, trained, _ = load(src, s.init)
    corpus = corpus_mod.scan(corpus_root)
    corpus_mod.check(corpus, trained.get("corpus_hash") or
                     corpus_mod.manifest().get("train_sha256", ""))
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    train_ids = data.stream(tok, [d.text for d in corpus.train])
    held_ids = data.stream(tok, [d.text for d in corpus_mod.heldout()])
    params = list(model.mtp.parameters())
    opt = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), weight_decay=0.1)
    step, log = 0, []
    state_dir.mkdir(parents=True, exist_ok=True)
    if resume:
        st = torch.load(state_dir / "state.pt", weights_only=True)
        model.mtp.load_state_dict(st["mtp"])
        opt.load_state_dict(st["opt"])
        step, log = st["step"], json.loads(st["log"])
        say(f"resuming {out} at step {step}/{s.steps}")
    else:
        (state_dir / "settings.json").write_text(json.dumps(dataclasses.asdict(s), indent=1))
        say(f"distilling the MTP head of {src} ({trained['family']} {trained['size']}, "
            f"{sum(p.numel() for p in params) / 1e6:.2f}M head parameters, trunk frozen): "
            f"{s.steps} steps of {s.batch}x{s.seq}, {k.threads} thread(s) -> {out}")
        ev = evaluate(model, held_ids, s.seq, s.batch, k.eval_tokens)
        log.append({"step": 0, **ev})
        say(f"held-out @ 0: {_fmt(ev)}")
    stop = _Stop()
    last_ckpt, t_log, done_log = time.monotonic(), time.monotonic(), step
    try:
        while step < s.steps and not stop.asked:
            for g in opt.param_groups:
                g["lr"] = _lr(s, step)
            kl, _, _ = _kl(model, data.batch(train_ids, s.seed, step, s.batch, s.seq)[:, :-1])
            kl.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % k.log_every == 0 or step == s.steps:
                dt = (time.monotonic() - t_log) / (step - done_log)
                t_log, done_log = time.monotonic(), step
                say(f"step {step}/{s.steps} kl {kl.item():.4f} lr {_lr(s, step - 1):.2e} | "
                    f"{dt:.2f} s/step, eta {_hms(dt * (s.steps - step))}")
            if step % k.eval_every == 0 and step < s.steps:
                ev = evaluate(model, held_ids, s.seq, s.batch, k.eval_tokens)
                log.append({"step": step, **ev})
                say(f"held-out @ {step}: {_fmt(ev)}")
            if time.monotonic() - last_ckpt > k.checkpoint_minutes * 60:
                _save_state(state_dir, model, opt, step, log)
                last_ckpt = time.monotonic()
        _save_state(state_dir, model, opt, step, log)
    finally:
        stop.close()
    if step < s.steps:
        say(f"stopped at step {step}/{s.steps}; run the same command again to resume")
        raise KeyboardInterrupt
    ev = evaluate(model, held_ids, s.seq, s.batch, k.final_eval_tokens)
    say(f"held-out ({ev['tokens']} positions): {_fmt(ev)}")
    _write(model, src, out)
    (out / "distill.json").write_text(json.dumps(
        {"settings": dataclasses.asdict(s), "heldout": ev, "log": log}, indent=1) + "\n")
    say(f"wrote {out}")
    return ev


def _write(model: models.Trainee, src: Path, out: Path) -> None:
    """DIR's files, with `mtp.*` replaced by the distilled head in DIR's dtype."""
    tensors = load_file(str(src / "model.safetensors"))
    for k, v in model.mtp.state_dict().items():
        name = "mtp." + k
        if name not in tensors:
            raise ConfigError(f"--distill-mtp {src}: its checkpoint has no {name}")
        tensors[name] = v.detach().to(tensors[name].dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)


def _check_out(out: Path, s: DistillSettings) -> bool:
    """True to resume; ConfigError for a folder that is not this distillation's."""
    if not out.exists():
        return False
    settings = out / STATE / "settings.json"
    if (out / "distill.json").exists():
        raise ConfigError(f"output folder {out} holds a finished distillation: choose a new "
                          f"--out")
    if not settings.is_file():
        raise ConfigError(f"output folder {out} exists and is not a distillation to resume: "
                          f"choose a new --out")
    old = json.loads(settings.read_text())
    diff = [f"{k}={old.get(k)!r} there, {v!r} now" for k, v in dataclasses.asdict(s).items()
            if old.get(k) != v]
    if diff:
        raise ConfigError(f"output folder {out} is a distillation with other settings "
                          f"({diff[0]}): resume it with its own settings or choose a new --out")
    return (out / STATE / "state.pt").is_file()


def _save_state(state_dir: Path, model, opt, step: int, log: list) -> None:
    tmp = state_dir / "state.pt.tmp"
    torch.save({"mtp": model.mtp.state_dict(), "opt": opt.state_dict(), "step": step,
                "log": json.dumps(log)}, tmp)
    os.replace(tmp, state_dir / "state.pt")
