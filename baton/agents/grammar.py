"""Constrained decoding with llguidance: grammars built on the router, masks on the workers.

Engine choice (docs/agents.md has the figures): llguidance 1.9.1 over xgrammar 0.2.8. On the
Zen 4 (2 cores) with a 151,000-token vocabulary and an openai-client pydantic schema (nested
objects, an enum, lists, optional fields) llguidance compiled in 0.8-1.2 ms (xgrammar 51-55
ms) and masked in 35 us mean / 13 us p50 / 162 us p99 per token (xgrammar 83 / 2 / 1,575 us).

Router side (`build`): response_format, tool_choice and vLLM's structured_outputs become one
Lark grammar, checked here (`LLMatcher.validate_grammar`) so a bad one is a 400 naming its
field, and carried as text in `SamplingParams.grammar`. JSON is compact unless the request asks
for flexible whitespace; every bound of the schema (lengths, minimum / maximum, enums) holds,
inside tool-call parameters too. A prompt that opened a `<think>` block lets the reasoning run
free up to `</think>` first (the mask starts when reasoning ends).

Worker side (`Grammars`): every worker that draws a token builds its own matcher from the text
(compiled once per grammar, cached, on the thread that admits the request, never the engine
step's) and replays the request's tokens drawn so far before masking: the prefill worker draws
the first token under the grammar, the decode worker replays it, a request moved to another
decode worker replays its output; no matcher state crosses the wire. Each sample of n has its
own matcher (its own request id). A request resumed on another pair (its decode worker died)
carries the tokens sent at the end of its prompt and `grammar_replay` = their count: the new
workers' matchers replay them first. Speculative decoding drafts for a constrained request too:
each verify row is masked under the drafts before it (`mask_drafts`: the matcher consumes
them and rolls back), so acceptance keeps exactly the tokens decoding without drafts draws.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from baton.errors import InvalidRequestError

if TYPE_CHECKING:  # the workers' masks import torch where they run: the router does without
    import torch

OPEN = "<tool_call>\n"
NO_TAG = "/(?s:.*)<tool_call>(?s:.*)/"
"""Text that contains a call's opening tag (free text before calls must not)."""
MAX_CALLS = 8
"""Most tool calls one constrained answer may make (a model looping on calls ends there)."""
CACHE_SIZE = 256
"""Compiled grammars kept per worker (least recently used dropped)."""


# ---- building (router) ---------------------------------------------------------------------

def _lit(s: str) -> str:
    return json.dumps(s)


def json_lark(schema: dict | bool, flexible: bool = False) -> str:
    """A `%json` lexeme of `schema`, compact unless `flexible`."""
    if schema is True or schema == {}:
        schema = {}
    if not isinstance(schema, dict):
        raise InvalidRequestError("the JSON schema must be an object")
    guidance = {"whitespace_flexible": flexible}
    if not flexible:
        guidance.update(item_separator=",", key_separator=":")
    return "%json" + json.dumps({**schema, "x-guidance": guidance}, ensure_ascii=False)


def _rule(name: str) -> str:
    return "r_" + re.sub(r"[^a-z0-9_]", "_", name.lower())


def xml_calls_lark(tools: list[dict], flexible: bool) -> list[str]:
    """Rules `fn_<i>` for each tool, in the XML call format (parameters in schema order; the
    required ones must appear)."""
    rules = []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool)
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        parts = []
        for j, (pname, pschema) in enumerate(props.items()):
            r = f"p_{i}_{j}"
            value = _xml_value(pschema if isinstance(pschema, dict) else {}, flexible)
            rules.append(f'{r}: {_lit(f"<parameter={pname}>" + chr(10))} {value}')
            parts.append(r if pname in required else f"{r}?")
        head = _lit(f"<function={fn['name']}>\n")
        rules.append(f'fn_{i}: {head} {" ".join(parts)} {_lit("</function>" + chr(10))}')
    return rules


def _xml_value(schema: dict, flexible: bool) -> str:
    """A parameter's value and its closing tag: a string raw (bounded as the schema says; no
    `<` inside), anything else as JSON."""
    end = "\\n<\\/parameter>\\n"
    kind = schema.get("type")
    if kind == "string" and ("enum" in schema or "const" in schema):
        values = schema.get("enum", [schema.get("const")])
        alts = " | ".join(_lit(str(v)) for v in values)
        return f"({alts}) {_lit(chr(10) + '</parameter>' + chr(10))}"
    if kind == "string":  # raw text, its length bounded (a pattern is not enforced here)
        lo = int(schema.get("minLength", 0))
        hi = schema.get("maxLength")
        rep = f"{{{lo},{int(hi)}}}" if hi is not None else (f"{{{lo},}}" if lo else "*")
        return f"/[^<]{rep}{end}/"
    return f"{json_lark(schema, flexible)} {_lit(chr(10) + '</parameter>' + chr(10))}"


def calls_lark(tools: list[dict], call_format: str, one: bool, flexible: bool,
               free: bool = False) -> str:
    """`start` of one or more calls (`one`: exactly one; else up to MAX_CALLS) of `tools` in
    the model's format; a call names only its declared parameters (as the XML format does:
    a schema without `additionalProperties` is taken as false). `free` (`tool_choice: "auto"`
    with strict tools): free text without `<tool_call>`, or free text (maybe none) and then
    the calls."""
    rules = []
    if call_format == "xml":
        rules += xml_calls_lark(tools, flexible)
        alts = " | ".join(f"fn_{i}" for i in range(len(tools)))
        rules.append(f'body: ({alts}) {_lit("</tool_call>")}')
    else:
        options = []
        for tool in tools:
            fn = tool.get("function", tool)
            params = {"additionalProperties": False, **(fn.get("parameters") or {})}
            params.setdefault("type", "object")
            options.append({"type": "object", "properties": {
                "name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"], "additionalProperties": False})
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        rules.append(f'body: {json_lark(schema, flexible)} {_lit(chr(10) + "</tool_call>")}')
    rules.append(f'call: {_lit(OPEN)} body')
    more = "" if one else f' ({_lit(chr(10))} call){{0,{MAX_CALLS - 1}}}'
    if free:
        # one lexeme for the text and the opening tag: a lexer reading the text greedily
        # would never end it before a `<tool_call>` it has half read
        start = f"start: TEXT? | OPENER body{more}"
        rules += [f"TEXT: /(?s:.+)/ & ~{NO_TAG}", f"NOTAG: /(?s:.*)/ & ~{NO_TAG}",
                  f"OPENER: NOTAG {_lit(OPEN)}"]
    else:
        start = f"start: call{more}"
    return "\n".join([start, *rules])


def with_reasoning(lark: str) -> str:
    """`lark` after free reasoning up to `</think>` (and the newlines after it)."""
    body = lark.replace("start:", "answer:", 1)
    return "start: think NLS? answer\nthink[lazy]: /(?s:.*)<\\/think>/\nNLS: /\\n+/\n" + body


def compile_text(lark: str, field: str) -> str:
    """llguidance's grammar text for `lark`; InvalidRequestError naming `field` if it cannot
    compile."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_lark(lark)
    except ValueError as e:
        raise InvalidRequestError(f"{field}: the grammar cannot be built: {e}") from None
    bad, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if bad:
        why = messages[0].strip().splitlines()[0] if messages else "invalid"
        raise InvalidRequestError(f"{field}: the grammar engine cannot compile it: {why}")
    return grammar


# ---- masking (workers) -------------------------------------------------------------------

class _State:
    __slots__ = ("matcher", "consumed")

    def __init__(self, matcher):
        self.matcher = matcher
        self.consumed = 0


class Grammars:
    """A worker's compiled grammars and its requests' matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids) or [2]
        self._lltok = None
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self._tok_lock = threading.Lock()
        self._states: dict[str, _State] = {}
        self._buf: torch.Tensor | None = None
        self._pool = None
        self._job = None
        self._ahead: dict[str, tuple[int, np.ndarray]] = {}
        """Masks computed during the forward (`prefetch`): request id -> (tokens consumed,
        allowed)."""
        self.compile_seconds = 0.0
        self.compiles = 0
        self.mask_seconds = 0.0
        self.compute_seconds = 0.0
        """Of mask_seconds, the matchers' bitmasks (the rest: unpacking, copying, applying)."""
        self.masks = 0
        self.masks_ahead = 0
        """Of masks, those computed during the forward (`prefetch`)."""

    @property
    def tracked(self) -> int:
        return len(self._states)

    def _tokenizer(self):
        if self._lltok is None:
            import llguidance

            inner = getattr(self.tokenizer, "_tok", None)
            if inner is not None:  # a tokenizer.json
                self._lltok = llguidance.LLTokenizer(inner.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=self.eos_ids)
            else:
                self._lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(
                    _ByteVocab(self.vocab_size, self.eos_ids)))
        return self._lltok

    def prepare(self, grammar: str) -> object:
        """The compiled matcher of `grammar` (any thread; cached by its text);
        InvalidRequestError when it cannot compile. The lock covers the cache only: a thread
        compiling never holds up the engine step's look-ups."""
        if not grammar:
            return None
        with self._lock:
            hit = self._compiled.get(grammar)
            if hit is not None:
                self._compiled.move_to_end(grammar)
                return hit
        from llguidance import LLMatcher

        with self._tok_lock:  # built once, on the first constrained request's thread
            tok = self._tokenizer()
        t0 = time.perf_counter()
        m = LLMatcher(tok, grammar, log_level=0)
        spent = time.perf_counter() - t0
        if m.is_error():
            raise InvalidRequestError(
                f"grammar: the grammar engine cannot compile it: {m.get_error()}")
        with self._lock:
            self.compile_seconds += spent
            self.compiles += 1
            m = self._compiled.setdefault(grammar, m)
            self._compiled.move_to_end(grammar)
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
            return m

    def forget(self, request_id: str) -> None:
        self._wait()
        self._states.pop(request_id, None)
        self._ahead.pop(request_id, None)

    def prefetch(self, reqs: list) -> None:
        """Start computing the masks of `reqs`' next tokens on a helper thread, while the
        step's forward runs (as vLLM and SGLang overlap them): a matcher's state depends only
        on the tokens drawn so far, not on the logits. `mask` waits for it and computes only
        what it lacks; nothing else touches a matcher meanwhile."""
        todo = [r for r in reqs if r.sampling.grammar]
        if not todo:
            return
        self._wait()
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="baton-grammar-mask")
        self._job = self._pool.submit(self._compute_ahead, todo)

    def _compute_ahead(self, reqs: list) -> None:
        for r in reqs:
            try:
                st = self._sync(r)
                self._ahead[r.id] = (st.consumed, self._bits(st.matcher, r))
            except Exception:  # noqa: BLE001 - `mask` computes it again and names why
                self._ahead.pop(r.id, None)

    def _wait(self) -> None:
        if self._job is not None:
            job, self._job = self._job, None
            job.result()

    def mask(self, logits: torch.Tensor, reqs: list) -> tuple[torch.Tensor, dict[int, str]]:
        """`logits` with every constrained request's row masked to what its grammar allows
        next (a copy, valid until the next call; the same tensor when none is constrained);
        rows whose request broke its grammar, with why."""
        rows = [i for i, r in enumerate(reqs) if r.sampling.grammar]
        if not rows:
            return logits, {}
        t0 = time.perf_counter()
        self._wait()
        out, errors = self._copy(logits), {}
        for i in rows:
            req = reqs[i]
            try:
                allowed = self._allowed(req)
            except InvalidRequestError as e:
                errors[i] = str(e)
                continue
            self._apply(out, i, allowed)
        self.mask_seconds += time.perf_counter() - t0
        self.masks += len(rows)
        return out, errors

    @staticmethod
    def _apply(out: torch.Tensor, i: int, allowed: np.ndarray) -> None:
        """Row i of `out` to -inf wherever `allowed` is not (and past its vocabulary)."""
        import torch

        width = out.shape[1]
        banned = ~allowed[:width]
        if banned.shape[0] < width:  # rows past the grammar's vocabulary: never allowed
            banned = np.concatenate([banned, np.ones(width - banned.shape[0], bool)])
        if out.device.type == "cpu" and out.dtype == torch.float32:
            # numpy's boolean assignment: ~0.1 ms at 151k (torch's masked_fill_ with a
            # fresh mask took 15-80 ms here)
            out[i].numpy()[banned] = -np.inf
        else:
            out[i].masked_fill_(torch.from_numpy(banned).to(out.device), float("-inf"))

    def _copy(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` copied into a buffer kept across steps (a fresh 600 KB tensor a step took
        up to 25 ms on the shared Zen 4 VM)."""
        import torch

        buf = self._buf
        if buf is None or buf.shape[0] < logits.shape[0] or buf.shape[1] != logits.shape[1] \
                or buf.dtype != logits.dtype or buf.device != logits.device \
                or buf.is_inference() != torch.is_inference_mode_enabled():
            buf = self._buf = torch.empty(max(logits.shape[0], 8), logits.shape[1],
                                          dtype=logits.dtype, device=logits.device)
        out = buf[: logits.shape[0]]
        if out.device.type == "cpu" and out.dtype == torch.float32 and logits.is_contiguous():
            # one thread: torch's copy_ splits 600 KB over the intra-op threads, and waiting
            # for a busy core took milliseconds on the shared VM
            np.copyto(out.numpy(), logits.numpy())
        else:
            out.copy_(logits)
        return out

    def mask_drafts(self, logits: torch.Tensor, req, drafts: list[int],
                    parents: tuple[int, ...] = ()) -> torch.Tensor:
        """Speculation's verify rows of `req` ([m, vocab]: row 0 after its last token, row r
        after draft r-1) each masked to what the grammar allows after the drafts on its path
        (`parents`: a tree's, row r's parent row; none: a chain), as a copy. The matcher
        consumes each path and rolls back: only tokens kept later advance it (the next call
        replays them). A row after a draft the grammar does not allow stays as it was: the
        masked row before it never draws that draft, so acceptance never reaches it.
        InvalidRequestError when the request broke its grammar."""
        t0 = time.perf_counter()
        self._wait()
        self._ahead.pop(req.id, None)
        st = self._sync(req)
        out = logits.clone()
        m = st.matcher
        eos = set(self.eos_ids)
        masked = 0
        for r in range(out.shape[0]):
            path, p = [], r
            while p > 0:
                path.append(drafts[p - 1])
                p = parents[p - 1] if parents else p - 1
            path.reverse()
            if any(t in eos for t in path):
                continue  # past the end of the answer
            n = m.try_consume_tokens(path) if path else 0
            if n == len(path):
                self._apply(out, r, self._bits(m, req))
                masked += 1
            if n and not m.rollback(n):
                raise InvalidRequestError(f"request {req.id}: its grammar cannot roll back "
                                          f"{n} draft token(s): {m.get_error()[:200]}")
        self.mask_seconds += time.perf_counter() - t0
        self.masks += masked
        return out

    def draft_mask(self, req):
        """For the drafter (chains): (drafts so far, a logits row) -> the row masked to what
        the grammar allows after `req`'s tokens and those drafts (the matcher consumes them
        and rolls back), so the head guesses within the grammar; the row unchanged where the
        drafts left it (the verify pass then rejects them)."""
        eos = set(self.eos_ids)

        def mask(drafts: list[int], row: torch.Tensor) -> torch.Tensor:
            self._wait()
            if any(t in eos for t in drafts):
                return row
            try:
                m = self._sync(req).matcher
            except InvalidRequestError:
                return row  # the verify pass's mask names why
            n = m.try_consume_tokens(drafts) if drafts else 0
            try:
                if n < len(drafts):
                    return row
                out = row[None].clone()
                self._apply(out, 0, self._bits(m, req))
                return out[0]
            except InvalidRequestError:
                return row
            finally:
                if n and not m.rollback(n):
                    self._states.pop(req.id, None)  # rebuilt and replayed at its next mask

        return mask

    def _sync(self, req) -> _State:
        """`req`'s matcher with every token it drew so far consumed."""
        st = self._states.get(req.id)
        replay = req.sampling.grammar_replay
        if replay and replay > len(req.prompt_ids):  # a negative slice start: the wrong tokens
            raise InvalidRequestError(
                f"request {req.id}: grammar_replay={replay} exceeds its {len(req.prompt_ids)} "
                "prompt tokens")
        drawn = [*req.prompt_ids[len(req.prompt_ids) - replay:], *req.output_ids] if replay \
            else req.output_ids
        if st is None or st.consumed > len(drawn):
            st = _State(self.prepare(req.sampling.grammar).deep_copy())
            self._states[req.id] = st
        if st.consumed < len(drawn):
            new = list(drawn[st.consumed:])
            if not st.matcher.consume_tokens(new):
                raise InvalidRequestError(
                    f"request {req.id}: token(s) {new} break its grammar: "
                    f"{st.matcher.get_error()[:200]}")
            st.consumed = len(drawn)
        return st

    def _allowed(self, req) -> np.ndarray:
        st = self._sync(req)
        ahead = self._ahead.pop(req.id, None)
        if ahead is not None and ahead[0] == st.consumed:
            self.masks_ahead += 1
            return ahead[1]
        return self._bits(st.matcher, req)

    def _bits(self, matcher, req) -> np.ndarray:
        t0 = time.perf_counter()
        raw = matcher.compute_bitmask()
        self.compute_seconds += time.perf_counter() - t0
        bits = np.frombuffer(raw, dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little").astype(bool)
        if not allowed.any():
            raise InvalidRequestError(f"request {req.id}: its grammar allows no next token")
        return allowed


class _ByteVocab:
    """The byte-level fallback tokenizer as llguidance reads a vocabulary (0 pad, 1 bos,
    2 eos, 3 + b byte b, the rest unused)."""

    def __init__(self, vocab_size: int, eos_ids: list[int]):
        from baton.model.tokenizer import BYTE_OFFSET

        self.offset = BYTE_OFFSET
        self.tokens = [b"<pad>", b"<s>", b"</s>"] + [bytes([b]) for b in range(256)]
        self.tokens += [f"<unused{i}>".encode() for i in range(len(self.tokens), vocab_size)]
        self.special_token_ids = [0, 1, 2, *range(BYTE_OFFSET + 256, vocab_size)]
        self.eos_token_id = eos_ids[0]
        self.bos_token_id = 1

    def __call__(self, text) -> list[int]:
        raw = text if isinstance(text, bytes) else text.encode()
        return [b + self.offset for b in raw]
