"""`stream-run serve`: the real server (uvicorn, a free loopback port) over a tiny MoE whose experts stream
through a 12-slot cache, spoken to with the official `openai` client and raw httpx. Oracles: the same greedy
tokens from Generator on a separate resident session (streamed equals resident bit for bit), the float64
reference forward, and a fresh full prefill for prefix reuse."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from invariants import assert_cache_consistent
from reference import Reference
from serving import LOAD_TIMEOUT, Running, greedy, metrics, open_resident, open_streamed, wait_idle
from typer.testing import CliRunner

from streamer.chat import EMPTY_THINK
from streamer.cli.main import app
from streamer.options import StreamOptions
from streamer.server.schemas import Limits
from streamer.session import open_model

N_CTX, SLOTS = 512, 12
STREAM_RUN = Path(sys.executable).parent / "stream-run"
NO_CACHE = {"cache_prompt": False, "ignore_eos": True}  # prefill everything (as a fresh run), never stop early


@pytest.fixture(scope="module")
def path(synth_model):
    return synth_model("tiny-moe", "Q8_0")


@pytest.fixture(scope="module")
def resident(path):
    with open_resident(path, N_CTX) as s:
        yield s


def streamed(path, resident):
    return open_streamed(path, resident, SLOTS, N_CTX)


@pytest.fixture(scope="module")
def srv(path, resident):
    r = Running(streamed(path, resident), limits=Limits(max_body_bytes=64 << 10, max_messages=8))
    r.wait_loaded()
    yield r
    r.stop()


@pytest.fixture
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def chat_prompt(system, user, think=False):
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n" + (
        "" if think else EMPTY_THINK
    )


def slots(m):
    return {k.split('"')[1]: v for k, v in m.items() if k.startswith("streamrun_expert_slots")}


def test_models_and_health(oai, http):
    assert [m.id for m in oai.models.list().data] == ["tiny"]
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_tokens_match_generator_and_the_float64_reference(oai, resident, path, stream):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there /no_think"}]
    ids = resident.tokenizer.encode_raw(chat_prompt("be brief", "hello there /no_think"))
    want = greedy(resident, ids, 12)
    kw = dict(model="tiny", messages=msgs, max_tokens=12, temperature=0, extra_body=NO_CACHE)
    if stream:
        chunks = list(oai.chat.completions.create(stream=True, **kw))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish, usage = chunks[-1].choices[0].finish_reason, chunks[-1].usage
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    else:
        r = oai.chat.completions.create(**kw)
        text, finish, usage = r.choices[0].message.content, r.choices[0].finish_reason, r.usage
        assert r.choices[0].message.role == "assistant" and r.model == "tiny"
    assert text == resident.tokenizer.decode(want)
    assert finish == "length"
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(ids), 12, len(ids) + 12)
    assert usage.prompt_tokens_details.cached_tokens == 0
    if not stream:  # teacher-forced float64 logits: each token is the reference's argmax (up to a near-tie)
        ref = Reference(str(path)).logits(np.array(ids + want))
        for i, t in enumerate(want):
            row = ref[len(ids) - 1 + i]
            assert row[t] >= row.max() - 1e-3 * np.abs(row).max(), i


@pytest.mark.parametrize("prompt", ["Once upon a time", [5, 80, 81, 82, 83]])
def test_completions_match_generator(oai, resident, prompt):
    ids = resident.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    want = greedy(resident, ids, 10)
    r = oai.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, extra_body=NO_CACHE)
    assert r.choices[0].text == resident.tokenizer.decode(want)
    assert r.choices[0].finish_reason == "length" and r.usage.prompt_tokens == len(ids)
    chunks = list(
        oai.completions.create(
            model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True, extra_body=NO_CACHE
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sampling_is_seeded_and_stop_strings_end_the_text(oai):
    kw = dict(
        model="tiny",
        prompt=[5, 70, 71],
        max_tokens=16,
        temperature=0.9,
        seed=7,
        extra_body={"top_k": 0, "min_p": 0.0, **NO_CACHE},
    )
    a, b = (oai.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b and len(a) >= 8
    stop = a[5:8]
    cut = a[: a.find(stop)]
    r = oai.completions.create(stop=[stop, "\x00never"], **kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    chunks = list(oai.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"


def test_sse_framing(http):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        **NO_CACHE,
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    objs = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert objs[-2]["choices"][0]["finish_reason"] == "length"
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 3


class Recorder:
    """Wraps the engine's model: records (tokens, logits) of every forward."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def forward(self, ids, cache, all_logits=False, progress=None):
        out = self.model.forward(ids, cache, all_logits, progress)
        self.calls.append((list(np.asarray(ids).reshape(-1)), out.copy()))
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_second_turn_prefills_only_its_new_tokens(oai, http, srv, resident, path):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first question /no_think"}]
    kw = dict(model="tiny", max_tokens=6, temperature=0)
    r1 = oai.chat.completions.create(messages=msgs, extra_body=NO_CACHE, **kw)
    wait_idle(http, srv.url)
    eng = srv.engine
    turn1 = list(eng.gen.history)  # the prompt and all of the reply but its last token (sampled, never fed)
    assert len(turn1) == r1.usage.prompt_tokens + r1.usage.completion_tokens - 1
    msgs += [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "and a second one"},
    ]
    eng.gen.model = rec = Recorder(eng.gen.model)
    try:
        r2 = oai.chat.completions.create(messages=msgs, extra_body={"ignore_eos": True}, **kw)
        wait_idle(http, srv.url)
    finally:
        eng.gen.model = rec.model
    u = r2.usage
    assert u.prompt_tokens_details.cached_tokens == len(turn1)
    assert eng.gen.history[: len(turn1)] == turn1
    new = u.prompt_tokens - len(turn1)
    tail = "<|im_end|>\n<|im_start|>user\nand a second one<|im_end|>\n<|im_start|>assistant\n" + EMPTY_THINK
    assert new <= len(resident.tokenizer.encode_raw(tail)) + 2  # the new turn (+ the reply's last token)
    assert [len(ids) for ids, _ in rec.calls] == [new] + [1] * (u.completion_tokens - 1)  # nothing re-read
    assert r2.model_extra["timings"]["prompt_n"] == new and r2.model_extra["timings"]["cache_n"] == len(turn1)
    # its logits equal a fresh full prefill's (to float32 rounding: the split prefill rounds differently)
    got = rec.calls[0][1]
    prompt2 = eng.gen.history[: u.prompt_tokens]
    fresh = resident.model.forward(np.array(prompt2), resident.model.new_state())
    assert np.dot(got, fresh) / np.linalg.norm(got) / np.linalg.norm(fresh) > 0.99999
    assert np.abs(got - fresh).max() < 1e-3 * np.abs(fresh).max()
    ref = Reference(str(path)).logits(np.array(prompt2))[-1]
    assert np.dot(got, ref) / np.linalg.norm(got) / np.linalg.norm(ref) > 0.999


def test_tokenize_detokenize_round_trip(http, resident):
    text = "Hello world, café 你好 😀"
    r = http.post("/tokenize", json={"content": text, "with_pieces": True})
    pieces = r.json()["tokens"]
    ids = [p["id"] for p in pieces]
    assert (
        b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
        == text.encode()
    )
    assert http.post("/tokenize", json={"content": text}).json() == {"tokens": ids}
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"content": text}
    assert http.post("/tokenize", json={"content": "<|im_start|>"}).json()["tokens"] == [
        resident.tokenizer.token_id("<|im_start|>")
    ]  # special tokens are parsed, as llama-server


BAD = [
    ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
    ("/v1/chat/completions", b"[1, 2]", 400, "invalid_type"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "invalid_type"),
    ("/v1/chat/completions", {}, 400, "missing_field"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "invalid_role"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "invalid_role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "invalid_type"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "unsupported_value",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 9}, 400, "invalid_value"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "word " * 600}]},
        400,
        "context_length_exceeded",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400, "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "invalid_value"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**12},
        400,
        "invalid_value",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"},
        400,
        "invalid_type",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
        400,
        "invalid_type",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 2}, 400, "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400, "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": 3}, 400, "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "unsupported_value"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "invalid_encoding"),
    ("/v1/chat/completions", b'{"messages": [], "pad": "' + b"x" * (65 << 10) + b'"}', 413, "request_too_large"),
    ("/v1/completions", {"prompt": [65] * 600}, 400, "context_length_exceeded"),
    ("/v1/completions", {"prompt": [1, 10**6]}, 400, "invalid_token"),
    ("/v1/completions", {"prompt": [1, -3]}, 400, "invalid_token"),
    ("/v1/completions", {"prompt": ""}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": {"a": 1}}, 400, "invalid_type"),
    ("/detokenize", {"tokens": [-1]}, 400, "invalid_token"),
    ("/detokenize", {"tokens": ["a"]}, 400, "invalid_type"),
    ("/tokenize", {"content": 5}, 400, "invalid_type"),
]


@pytest.mark.parametrize("route,body,status,code", BAD, ids=[f"{r}-{c}-{i}" for i, (r, _, _, c) in enumerate(BAD)])
def test_bad_input_is_a_4xx_with_an_error_body(http, route, body, status, code):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = http.post(route, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["type"] == "invalid_request_error" and err["message"]
    assert "Traceback" not in r.text


def test_bodies_over_the_limit_without_a_length_and_unknown_routes(http, oai):
    r = http.post("/v1/chat/completions", content=(b"x" * 4096 for _ in range(20)))  # chunked, no Content-Length
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    # and the server keeps serving
    assert oai.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].finish_reason


@pytest.mark.parametrize("stream", [True, False])
def test_a_disconnect_cancels_the_generation_and_releases_every_expert_slot(http, srv, stream):
    before = metrics(http, srv.url)
    body = {"prompt": [5, 6, 7], "max_tokens": 400, "stream": stream, **NO_CACHE}
    if stream:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]  # two events (data line + blank line each)
            assert got[0].startswith("data: ")
    else:  # the client gives up waiting for the whole body and hangs up
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
    m = wait_idle(http, srv.url)
    cancelled = 'streamrun_requests_total{outcome="cancelled"}'
    assert m[cancelled] == before[cancelled] + 1
    assert m["streamrun_kv_cache_tokens"] < 3 + 400  # stopped early
    s = slots(m)
    assert s["in_use"] == 0 and s["reading"] == 0 and sum(s.values()) == SLOTS
    assert_cache_consistent(srv.session.moe.source.cache)
    assert http.get("/health").status_code == 200


def test_metrics_count_tokens_and_expert_traffic_per_layer(http, oai, srv):
    before = metrics(http, srv.url)
    r = oai.completions.create(model="tiny", prompt=[5, 9, 9, 9], max_tokens=5, extra_body=NO_CACHE)
    m = wait_idle(http, srv.url)
    assert m["streamrun_tokens_predicted_total"] - before["streamrun_tokens_predicted_total"] == 5
    assert m["streamrun_prompt_tokens_total"] - before["streamrun_prompt_tokens_total"] == r.usage.prompt_tokens
    assert m["streamrun_context_size"] == N_CTX and m["streamrun_queue_size"] == 8
    for layer in range(4):
        lab = f'layer="{layer}"'
        hits = sum(m[f'streamrun_expert_hits_total{{{lab},tier="{t}"}}'] for t in ("pinned", "lru", "prefetched"))
        reqs = m[f"streamrun_expert_requests_total{{{lab}}}"]
        assert reqs > before[f"streamrun_expert_requests_total{{{lab}}}"]
        assert hits + m[f"streamrun_expert_misses_total{{{lab}}}"] == reqs
        assert m[f"streamrun_expert_demand_bytes_total{{{lab}}}"] > 0  # 12 slots for 64 experts: it streams
        assert f"streamrun_expert_stall_seconds_total{{{lab}}}" in m


def open_stream(client, body):
    """Start a streaming request; return (context, line iterator) once a content event has arrived."""
    cm = client.stream("POST", "/v1/completions", json=body)
    r = cm.__enter__()
    assert r.status_code == 200, r.read()
    return cm, r.iter_lines()


def test_queue_full_is_503_and_the_server_recovers(path, resident):
    srv = Running(streamed(path, resident), queue_size=1)
    try:
        srv.wait_loaded()
        body = {"prompt": [5, 6], "max_tokens": 400, "stream": True, **NO_CACHE}
        with (
            httpx.Client(base_url=srv.url, timeout=60) as a,
            httpx.Client(base_url=srv.url, timeout=60) as b,
            httpx.Client(base_url=srv.url, timeout=60) as c,
        ):
            cm_a, lines_a = open_stream(a, body)
            assert next(lines_a).startswith("data: ")  # running
            cm_b = b.stream("POST", "/v1/completions", json=body)
            resp_b = cm_b.__enter__()  # queued (SSE headers go out at once)
            deadline = time.monotonic() + 10
            while metrics(c, srv.url)["streamrun_queue_depth"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "unavailable_error"
            cm_a.__exit__(None, None, None)
            cm_b.__exit__(None, None, None)
            assert resp_b.status_code == 200
            m = wait_idle(c, srv.url)
            assert m['streamrun_requests_total{outcome="rejected"}'] == 1
            assert slots(m)["in_use"] == 0
            r = c.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})
            assert r.status_code == 200
    finally:
        srv.stop()


def test_api_key_and_health_while_loading(path, resident):
    gate = threading.Event()
    session = streamed(path, resident)

    def load():
        from streamer.server.engine import Engine

        gate.wait(30)
        return Engine(session)

    srv = Running(session, load=load, api_key="sekret")
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.get("/health")
            assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"
            auth = {"Authorization": "Bearer sekret"}
            r = c.post("/v1/completions", json={"prompt": "x"}, headers=auth)
            assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
            gate.set()
            srv.wait_loaded()
            assert c.get("/health").status_code == 200  # open without a key
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
                r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert c.get("/metrics").status_code == 401
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        assert client.completions.create(model="tiny", prompt="x", max_tokens=1).usage.completion_tokens == 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        gate.set()
        srv.stop()


def test_concurrent_clients_are_answered_or_refused_and_leak_nothing(http, srv):
    outcomes, lock = [], threading.Lock()

    def client(k):
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            for i in range(5):
                body = {"prompt": [5, 20 + k, 30 + i], "max_tokens": 6 + i, "ignore_eos": True, "stream": i % 3 != 2}
                if i % 3 == 1:  # disconnect after the first event
                    with c.stream("POST", "/v1/completions", json=body) as r:
                        status = r.status_code
                        if status == 200:
                            next(r.iter_lines())
                else:
                    r = c.post("/v1/completions", json=body)
                    status = r.status_code
                    if status == 200 and body["stream"]:
                        assert r.text.endswith("data: [DONE]\n\n")
                    elif status == 200:
                        assert r.json()["usage"]["completion_tokens"] == body["max_tokens"]
                with lock:
                    outcomes.append(status)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(outcomes) == 20 and set(outcomes) <= {200, 503}
    m = wait_idle(http, srv.url)
    assert slots(m)["in_use"] == 0 and slots(m)["reading"] == 0
    assert http.get("/health").status_code == 200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_command_end_to_end(path):
    """The installed command: binds, loads, answers with --api-key, stops cleanly on Ctrl-C."""
    port = free_port()
    p = subprocess.Popen(
        [
            str(STREAM_RUN),
            "serve",
            str(path),
            "--port",
            str(port),
            "--api-key",
            "k",
            "-c",
            "256",
            "--alias",
            "tiny-served",
            "--no-learn",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline, status = time.monotonic() + LOAD_TIMEOUT, None
        while status != 200:
            assert time.monotonic() < deadline and p.poll() is None, p.stderr.read().decode() if p.poll() else ""
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code
            except httpx.TransportError:
                pass
            assert status in (None, 200, 503)
            time.sleep(0.05)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-served"]
        r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.usage.completion_tokens <= 3
        client.close()
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
        stopped_in = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    err = err.decode()
    assert p.returncode == 130 and err.splitlines()[-1] == "interrupted", err  # Ctrl-C, as every command
    assert "Traceback" not in err and f"listening on http://127.0.0.1:{port}/v1" in err
    assert "4 parallel, used in place" in err  # the file's pages, as every command unless --no-mmap
    assert stopped_in < 10, stopped_in


@pytest.mark.parametrize(
    "args,message",
    [
        (["/nonexistent/model.gguf"], "error: "),
        (["MODEL", "--io", "sideways"], "error: --io must be auto, direct or buffered"),
        (["MODEL", "--max-body", "lots"], "error: cannot read size 'lots'"),
        (["MODEL", "--queue", "-1"], "error: --queue must be >= 0"),
    ],
)
def test_serve_refuses_bad_flags_before_binding(path, args, message):
    args = [str(path) if a == "MODEL" else a for a in args]
    r = CliRunner().invoke(app, ["serve", *args, "--port", str(free_port())])
    assert r.exit_code == 2 and r.stderr.startswith(message) and len(r.stderr.splitlines()) == 1, r.stderr


def test_a_model_that_fails_to_load_stops_the_server_with_one_error_line(path):
    """The budget is checked when the model opens, in the background: the server then stops, exit 2."""
    r = subprocess.run(
        [str(STREAM_RUN), "serve", str(path), "--port", str(free_port()), "--ram-budget", "1M"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    last = r.stderr.splitlines()[-1]
    assert r.returncode == 2 and last.startswith("error: ") and "Traceback" not in r.stderr, r.stderr


def test_serve_without_the_extra_says_how_to_install_it(path):
    code = (
        "import sys; sys.modules['uvicorn'] = None\n"  # as if the [serve] extra were not installed
        "from streamer.cli.main import app\n"
        f"app(['serve', {str(path)!r}])"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert r.returncode == 2
    assert r.stderr == "error: stream-run serve needs the server extra: pip install 'stream-run[serve]'\n"


class Scripted:
    """A model whose logits spell a fixed reply, one token per step (it still fills the KV cache's count)."""

    def __init__(self, model, script):
        self.model, self.script, self.step, self.end = model, script, 0, -1

    def forward(self, ids, cache, all_logits=False, progress=None):
        cache.check_room(len(ids))
        if len(ids) > 1 or cache.n != self.end:  # a prompt, not the next step of a reply: start over
            self.step = 0
        cache.n = self.end = cache.n + len(ids)
        logits = np.zeros(self.model.cfg.n_vocab, np.float32)
        logits[self.script[min(self.step, len(self.script) - 1)]] = 1.0
        self.step += 1
        return logits

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_think_block_comes_back_as_reasoning_content(resident):
    from types import SimpleNamespace

    from streamer.server.engine import Engine

    tok = resident.tokenizer
    script = tok.encode_raw("<think>\nI think so.\n</think>\n\nYes, café.<|im_end|>")
    fake = SimpleNamespace(
        model=Scripted(resident.model, script),
        cfg=resident.cfg,
        tokenizer=tok,
        moe=None,
        traffic=None,
        close=lambda: None,
    )
    srv = Running(fake, load=lambda: Engine(fake))
    try:
        srv.wait_loaded()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "is it?"}]
        r = client.chat.completions.create(model="tiny", messages=msgs, temperature=0)
        m = r.choices[0].message
        assert (m.content, m.model_extra["reasoning_content"]) == ("Yes, café.", "I think so.")
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == len(script) - 1
        chunks = list(client.chat.completions.create(model="tiny", messages=msgs, temperature=0, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "I think so."
        assert "".join(d.content or "" for d in deltas) == "Yes, café."
        # a stop string inside the answer: held back, never sent, and the reply ends there
        r = client.chat.completions.create(model="tiny", messages=msgs, temperature=0, stop=["caf"])
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("Yes, ", "stop")
        # the next turn finds the reply, think block included, in the cache: only the new turn is prefilled
        msgs += [{"role": "assistant", "content": "Yes, café."}, {"role": "user", "content": "sure?"}]
        client.chat.completions.create(model="tiny", messages=msgs[:1], temperature=0)  # the reply to extend
        r = client.chat.completions.create(model="tiny", messages=msgs, temperature=0)
        tail = tok.encode_raw("<|im_end|>\n<|im_start|>user\nsure?<|im_end|>\n<|im_start|>assistant\n")
        assert r.model_extra["timings"]["prompt_n"] == len(tail)
    finally:
        srv.stop()


def test_a_dense_model_serves_the_same_tokens_as_generator(synth_model):
    path = synth_model("tiny", "Q8_0")
    with open_model(path, StreamOptions(learn=False), n_ctx=N_CTX) as ref:
        want = greedy(ref, [5, 40, 41], 8)
        text = ref.tokenizer.decode(want)
    srv = Running(open_model(path, StreamOptions(learn=False), n_ctx=N_CTX))
    try:
        srv.wait_loaded()
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.post("/v1/completions", json={"prompt": [5, 40, 41], "max_tokens": 8, "ignore_eos": True})
            assert r.json()["choices"][0]["text"] == text
            assert "streamrun_expert_hits_total" not in c.get("/metrics").text  # nothing to stream
    finally:
        srv.stop()


@pytest.mark.slow  # a second model's warm-up in the server, 68 s of first compiles (2026-12-05); the state's
# saved points are in test_hybrid's fast tier
def test_a_hybrid_model_reuses_only_saved_prefixes_and_answers_as_fresh(synth_model):
    """qwen35moe's recurrent state returns only to saved points (a prompt's end): a request that extends the
    last prompt reuses it; one that shares part of it prefills again. Each answer equals a fresh run's."""
    path = synth_model("tiny-qwen35moe", "Q8_0")
    first, extended, partial = [5, 40, 41, 7, 300, 12, 9], [5, 40, 41, 7, 300, 12, 9, 77, 78], [5, 40, 41, 99]
    with open_resident(path, N_CTX) as ref:
        want = {tuple(p): ref.tokenizer.decode(greedy(ref, p, 6)) for p in (first, extended, partial)}
    srv = Running(open_model(path, StreamOptions(learn=False), n_ctx=N_CTX))
    try:
        srv.wait_loaded()
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for prompt, cached in ((first, 0), (extended, len(first)), (partial, 0)):
                r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "ignore_eos": True}).json()
                assert r["choices"][0]["text"] == want[tuple(prompt)]
                assert r["timings"]["cache_n"] == cached, prompt
    finally:
        srv.stop()
