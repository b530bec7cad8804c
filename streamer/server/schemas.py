"""Request validation for the server: JSON bodies in, typed requests out, or an APIError that becomes a 4xx
with OpenAI's error body {"error": {"message", "type", "code"}}. Unknown fields are ignored (clients send
many); known ones are checked for type and range."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from streamer.chat import chat_defaults
from streamer.sampler import SamplerParams
from streamer.server.text import ROLES


@dataclass(frozen=True)
class Limits:
    """What one request may ask for. max_tokens None: up to the context size."""

    max_body_bytes: int = 4 << 20
    max_tokens: int | None = None
    max_messages: int = 256
    max_stops: int = 16


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


def bad(message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", code)


def parse_json(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not valid UTF-8 (byte {e.start})", "invalid_encoding") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(f"malformed JSON: {e.msg} at line {e.lineno} column {e.colno}", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", "invalid_type")
    return body


def _typed(body: dict, key: str, kinds, what: str):
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise bad(f"'{key}' must be {what}, got {json.dumps(v)[:80]}", "invalid_type")
    if isinstance(v, float) and not math.isfinite(v):
        raise bad(f"'{key}' must be a finite number", "invalid_value")
    return v


def num(body, key, lo=None, hi=None):
    v = _typed(body, key, (int, float), "a number")
    if v is not None and (lo is not None and v < lo or hi is not None and v > hi):
        raise bad(f"'{key}' must be in [{lo}, {hi}], got {v}")
    return v


def integer(body, key, lo=None, hi=None):
    v = _typed(body, key, (int,), "an integer")
    if v is not None and (lo is not None and v < lo or hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad(f"'{key}' must be {rng}, got {v}")
    return v


def boolean(body, key, default: bool = False) -> bool:
    v = _typed(body, key, (bool,), "true or false")
    return default if v is None else v


def string(body, key):
    return _typed(body, key, (str,), "a string")


@dataclass(frozen=True)
class GenRequest:
    """One generation for the engine. text: the rendered prompt (chat), matched against the KV cache as text
    so a conversation's earlier replies are found as the tokens we generated; ids: the prompt's tokens."""

    ids: tuple
    max_tokens: int
    params: SamplerParams
    stops: tuple = ()
    text: str | None = None
    think: bool = False  # split a leading <think> block into reasoning_content
    head: str = ""  # what the prompt puts at the start of the reply (the empty think block), for replies memory
    stream: bool = False
    include_usage: bool = False
    cache_prompt: bool = True  # llama-server's: reuse the KV cache's common prefix (false: prefill it all)
    ignore_eos: bool = False  # llama-server's: generate max_tokens (or to a full context) whatever is sampled


def sampling(body: dict, defaults: dict) -> SamplerParams:
    p = dict(defaults)
    for key, v in (
        ("temperature", num(body, "temperature", 0, 100)),
        ("top_p", num(body, "top_p", 0, 1)),
        ("min_p", num(body, "min_p", 0, 1)),
        ("top_k", integer(body, "top_k")),
        ("presence_penalty", num(body, "presence_penalty", -2, 2)),
        ("frequency_penalty", num(body, "frequency_penalty", -2, 2)),
        ("repeat_penalty", num(body, "repeat_penalty", 0.01, 100)),
        ("repeat_last_n", integer(body, "repeat_last_n", -1)),
        ("seed", integer(body, "seed")),
    ):
        if v is not None:
            p[key] = v
    if p.get("seed") is not None and p["seed"] < 0:
        p["seed"] = None  # -1: random, as the CLI
    return SamplerParams(**p)


def common(body: dict, limits: Limits, n_ctx: int) -> dict:
    """max_tokens, stop, stream, n: shared by chat and completions."""
    cap = limits.max_tokens or n_ctx
    mt = integer(body, "max_completion_tokens", 1, cap)
    mt = integer(body, "max_tokens", 1, cap) if mt is None else mt
    n = integer(body, "n")
    if n not in (None, 1):
        raise bad(f"'n' must be 1 (one generation per request), got {n}", "unsupported_value")
    stop = body.get("stop")
    if stop is None:
        stops = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise bad("'stop' must be a string or a list of strings", "invalid_type")
    if len(stops) > limits.max_stops:
        raise bad(f"'stop' has {len(stops)} strings, at most {limits.max_stops} are allowed")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "invalid_type")
    return dict(
        max_tokens=cap if mt is None else mt,
        stops=tuple(s for s in stops if s),
        stream=boolean(body, "stream"),
        include_usage=boolean(opts or {}, "include_usage"),
        ignore_eos=boolean(body, "ignore_eos"),
        cache_prompt=boolean(body, "cache_prompt", True),
    )


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if c is None and m["role"] == "assistant":
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: text only
        out = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: only text parts are supported", "unsupported_value")
            out.append(part["text"])
        return "".join(out)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", "invalid_type")


def messages(body: dict, limits: Limits) -> list[dict]:
    ms = body.get("messages")
    if not isinstance(ms, list) or not ms:
        raise bad("'messages' must be a non-empty list", "invalid_type" if ms is not None else "missing_field")
    if len(ms) > limits.max_messages:
        raise bad(f"'messages' has {len(ms)} entries, at most {limits.max_messages} are allowed")
    out = []
    for i, m in enumerate(ms):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise bad(
                f"messages[{i}].role must be one of {', '.join(ROLES)}, got {json.dumps(role)[:40]}", "invalid_role"
            )
        out.append({"role": role, "content": _content(m, i)})
    return out


def enable_thinking(body: dict) -> bool | None:
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return None
    if not isinstance(kw, dict):
        raise bad("'chat_template_kwargs' must be an object", "invalid_type")
    v = kw.get("enable_thinking")
    if v is not None and not isinstance(v, bool):
        raise bad("'chat_template_kwargs.enable_thinking' must be true or false", "invalid_type")
    return v


def chat_sampling(body: dict, think: bool) -> SamplerParams:
    return sampling(body, chat_defaults(think))


def completion_sampling(body: dict) -> SamplerParams:
    """`run`'s defaults: greedy unless a temperature > 0 is given (then llama.cpp's top-k/top-p/min-p)."""
    return sampling(body, {})


def prompt(body: dict, n_vocab: int) -> str | list[int]:
    """/v1/completions' prompt: a string or a list of token ids (or a one-element list of either)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise bad("'prompt' is empty")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return token_ids(p, n_vocab, "prompt")
    if p is None:
        raise bad("'prompt' is required", "missing_field")
    raise bad("'prompt' must be a non-empty string or a non-empty list of token ids", "invalid_type")


def token_ids(ids, n_vocab: int, key: str = "tokens") -> list[int]:
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad(f"'{key}' must be a list of token ids", "invalid_type")
    for t in ids:
        if not 0 <= t < n_vocab:
            raise bad(f"token id {t} in '{key}' is out of range (vocabulary has {n_vocab} tokens)", "invalid_token")
    return ids
