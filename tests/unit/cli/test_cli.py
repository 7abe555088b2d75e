"""`baton generate --local` and `baton make-model` as users call them."""

from __future__ import annotations

import json

import pytest

from baton.cli import main
from tests.support.engine_helpers import prompt

FIELDS = {"id", "token_ids", "text", "finish_reason", "prompt_tokens", "cached_tokens",
          "prefill_worker", "decode_worker", "ttft_ms", "latency_ms"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "m"
    assert main(["make-model", "--out", str(out), "--seed", "3", "--no-tokenizer"]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert not (out / "tokenizer.json").exists()
    return out


def test_make_model_writes_a_tokenizer_autotokenizer_loads(tmp_path):
    from transformers import AutoTokenizer

    from baton.model.tokenizer import load_tokenizer

    out = tmp_path / "m"
    assert main(["make-model", "--out", str(out), "--seed", "3"]) == 0
    hf = AutoTokenizer.from_pretrained(str(out))
    ours = load_tokenizer(out)
    text = "Hello, Baton: a tokenizer that round-trips."
    ids = hf.encode(text, add_special_tokens=False)
    assert ids == ours.encode(text) and len(ids) < len(text.encode())
    assert hf.decode(ids) == text and ours.decode(ids) == text


def _lines(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_requests_file_in_order_with_session_reuse(model_dir, tmp_path, capsys):
    first = prompt(1, 32)
    reqs = [
        {"id": "a", "prompt_ids": first, "max_tokens": 5, "ignore_eos": True, "session": "s"},
        {"id": "b", "prompt_ids": first + [9, 10, 11], "max_tokens": 3, "ignore_eos": True,
         "session": "s"},
        {"id": "c", "prompt": "hello", "max_tokens": 4, "temperature": 0.8, "seed": 5,
         "ignore_eos": True},
    ]
    path = tmp_path / "reqs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in reqs))
    assert main(["generate", "--local", "--model", str(model_dir), "--requests", str(path),
                 "--json"]) == 0
    out = _lines(capsys)
    assert [o["id"] for o in out] == ["a", "b", "c"]
    assert all(set(o) == FIELDS for o in out)
    assert [len(o["token_ids"]) for o in out] == [5, 3, 4]
    assert [o["finish_reason"] for o in out] == ["length"] * 3
    assert out[0]["cached_tokens"] == 0
    # b extends a's block-aligned prompt, whose end snapshot survives a's decode-end one
    # (that one is a partial page in the next block)
    assert out[1]["cached_tokens"] == 32
    assert out[2]["prompt_tokens"] == 5  # byte-level fallback: one id a byte


def test_prompt_ids_match_between_json_and_concurrency(model_dir, tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(
        json.dumps({"id": f"r{i}", "prompt_ids": prompt(i, 10 + i), "max_tokens": 6,
                    "ignore_eos": True}) for i in range(6)))
    assert main(["generate", "--local", "--model", str(model_dir), "--requests", str(path),
                 "--json"]) == 0
    serial = {o["id"]: o["token_ids"] for o in _lines(capsys)}
    assert main(["generate", "--local", "--model", str(model_dir), "--requests", str(path),
                 "--json", "--concurrency", "4"]) == 0
    assert {o["id"]: o["token_ids"] for o in _lines(capsys)} == serial


def test_failed_requests_exit_nonzero_with_one_line_each(model_dir, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([
        json.dumps({"id": "ok", "prompt_ids": [5, 6], "max_tokens": 2}),
        json.dumps({"id": "empty", "prompt_ids": [], "max_tokens": 2}),
        json.dumps({"id": "vocab", "prompt_ids": [5, 10**7], "max_tokens": 2}),
    ]))
    rc = main(["generate", "--local", "--model", str(model_dir), "--requests", str(path), "--json"])
    captured = capsys.readouterr()
    assert rc == 1
    assert [json.loads(x)["id"] for x in captured.out.splitlines()] == ["ok"]
    errors = [x for x in captured.err.splitlines() if x.startswith("request ")]
    assert len(errors) == 2
    assert "empty" in errors[0] and "prompt is empty" in errors[0]
    assert "vocab" in errors[1] and "outside the vocabulary" in errors[1]


def test_unknown_field_in_requests_file_is_named(model_dir, tmp_path, capsys):
    path = tmp_path / "u.jsonl"
    path.write_text(json.dumps({"id": "x", "prompt_ids": [5], "tempreature": 1}))
    assert main(["generate", "--local", "--model", str(model_dir), "--requests", str(path)]) == 2
    assert "unknown field 'tempreature'" in capsys.readouterr().err


def test_missing_model_directory_is_one_clear_error(tmp_path, capsys):
    rc = main(["generate", "--local", "--model", str(tmp_path / "nope"), "--prompt-ids", "1,2"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "nope" in err


@pytest.mark.parametrize("flags, message", [
    (["--max-tokens", "-3"], "max_tokens must be an integer >= 1, got -3"),
    (["--max-tokens", str(2**32)], "a value does not fit the protocol (Value out of range: "
                                   "4294967296): max_tokens and top_k below 2^32"),
    (["--seed", str(2**64)], "a value does not fit the protocol (Value out of range: "
                             "18446744073709551616)"),
])
def test_generate_router_refuses_unencodable_values_in_one_line(capsys, flags, message):
    # nothing listens on port 1: the request is refused before any connection
    rc = main(["generate", "--router", "127.0.0.1:1", "--prompt-ids", "5,6", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1
    assert err[0].startswith(f"request req-1 failed: invalid request: {message}")


def test_generate_json_carries_logprobs_only_when_asked(model_dir, capsys):
    assert main(["generate", "--local", "--model", str(model_dir), "--prompt-ids", "5,6,7",
                 "--max-tokens", "3", "--logprobs", "2", "--prompt-logprobs", "0",
                 "--json"]) == 0
    (out,) = _lines(capsys)
    assert set(out) == FIELDS | {"logprobs", "prompt_logprobs"}
    assert [lp["token_id"] for lp in out["logprobs"]] == out["token_ids"]
    assert all(len(lp["top"]) == 2 and lp["logprob"] <= 0 for lp in out["logprobs"])
    assert [(lp["token_id"], lp["top"]) for lp in out["prompt_logprobs"]] == [(6, []), (7, [])]


def test_bad_flag_values_are_one_line_with_no_traceback(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--local", "--prompt-ids", "5", "--max-tokens", "many"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert err[0] == ("baton generate: error: argument --max-tokens: invalid int value: 'many' "
                      "(see baton generate --help)")


@pytest.mark.parametrize("layout", [[], ["--multimodal"]], ids=["text", "multimodal"])
def test_make_model_qwen3_5_then_generate(tmp_path, capsys, layout):
    out = tmp_path / "q"
    assert main(["make-model", "--family", "qwen3_5", "--out", str(out), "--seed", "2",
                 "--pattern", "GG*", *layout]) == 0
    cfg = json.loads((out / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    assert cfg["model_type"] == ("qwen3_5" if layout else "qwen3_5_text")
    assert text["layer_types"] == ["linear_attention", "linear_attention", "full_attention"]
    capsys.readouterr()
    reqs = tmp_path / "r.jsonl"
    reqs.write_text(json.dumps({"id": "q", "prompt_ids": [5, 6, 7], "max_tokens": 4,
                                "ignore_eos": True}))
    assert main(["generate", "--local", "--model", str(out), "--requests", str(reqs),
                 "--json"]) == 0
    (res,) = _lines(capsys)
    assert len(res["token_ids"]) == 4 and res["finish_reason"] == "length"


def test_a_router_process_imports_no_torch():
    """The parser adds `train`'s flags (which import torch) only when `baton train` parses,
    and the router's modules import none: a router starts without torch (about 2 s of CPU,
    in every cluster)."""
    import subprocess
    import sys
    from pathlib import Path

    from baton.cli import build_parser

    code = ("import sys\n"
            "from baton.cli import build_parser\n"
            "build_parser().parse_args(['router', '--port', '1'])\n"
            "import baton.cluster.roles, router.server, router.http.server\n"
            "import baton.auth.api_keys, baton.auth.tls, baton.model.chat_template\n"
            "import baton.model.quant.served, baton.model.registry, baton.model.tokenizer\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[3],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False"]
    args = build_parser().parse_args(["train", "--family", "qwen3_5", "--out", "x"])
    assert (args.family, args.batch, args.out) == ("qwen3_5", 8, "x")
