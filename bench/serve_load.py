#!/usr/bin/env python
"""Load test of `stream-run serve` on loopback: C concurrent clients x N chat requests each, some streaming,
some disconnecting midway, the whole run bounded in time. Counts answered / refused (503) / disconnected /
errors, then checks the server: alive, no expert slot left in use (/metrics), peak RSS within the budget.
Reports p50/p95 latency, time to first token and tok/s. Prints one JSON object (and a summary on stderr).

    python bench/serve_load.py MODEL.gguf --ram-budget 8G [--cap 8G] [--clients 8] [--requests 25]

Never run in CI; timings mean something only on a quiet machine."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from cgroup import parse_size  # noqa: E402
from serve_common import Server, percentile, wait_idle  # noqa: E402

TOPICS = ["the sea", "mountains", "a city at night", "old maps", "trains", "bread", "rain", "chess"]


def one_request(c: httpx.Client, body: dict, disconnect_after: int | None) -> dict:
    """Send one chat request; for streams, time the first content and optionally hang up after n events."""
    t0 = time.perf_counter()
    rec = {"stream": body["stream"], "disconnect": disconnect_after is not None}
    try:
        if not body["stream"]:
            r = c.post("/v1/chat/completions", json=body)
            rec["status"] = r.status_code
            if r.status_code == 200:
                j = r.json()
                rec["tokens"] = j["usage"]["completion_tokens"]
                rec["decode_tps"] = j["timings"]["predicted_per_second"]
                rec["cached"] = j["usage"]["prompt_tokens_details"]["cached_tokens"]
        else:
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                rec["status"] = r.status_code
                if r.status_code == 200:
                    n = 0
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        j = json.loads(line[6:])
                        if "error" in j:
                            rec["status"] = "stream-error"
                            break
                        if j["choices"] and j["choices"][0]["delta"].get("content"):
                            n += 1
                            rec.setdefault("ttft_s", time.perf_counter() - t0)
                        if j.get("usage"):
                            rec["tokens"] = j["usage"]["completion_tokens"]
                            rec["decode_tps"] = j["timings"]["predicted_per_second"]
                            rec["cached"] = j["usage"]["prompt_tokens_details"]["cached_tokens"]
                        if disconnect_after is not None and n >= disconnect_after:
                            break
                else:
                    r.read()
    except httpx.HTTPError as e:
        rec["status"] = f"transport: {type(e).__name__}"
    rec["latency_s"] = time.perf_counter() - t0
    return rec


def client(k: int, a, base: str, deadline: float, out: list, lock) -> None:
    with httpx.Client(base_url=base, timeout=a.request_timeout) as c:
        for i in range(a.requests):
            if time.monotonic() > deadline:
                with lock:
                    out.append({"status": "not-sent (time bound)"})
                continue
            kind = (k + i) % 4  # 0, 1: stream to the end; 2: one JSON body; 3: stream, hang up midway
            body = {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {
                        "role": "user",
                        "content": f"client {k}, request {i}: tell me about {TOPICS[(k + i) % len(TOPICS)]} /no_think",
                    },
                ],
                "max_tokens": a.max_tokens,
                "temperature": 0.7,
                "seed": 1000 * k + i,
                "ignore_eos": True,
                "stream": kind != 2,
            }
            rec = one_request(c, body, a.max_tokens // 2 if kind == 3 else None)
            rec.update(client=k, request=i)
            with lock:
                out.append(rec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=25, help="requests per client")
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=16,
        help="per request (30B-A3B under 8 GiB decodes ~1.8 tok/s: 200 x 16 tokens is ~30 min)",
    )
    ap.add_argument("--ram-budget", default=None, help="passed to serve; RSS is checked against it")
    ap.add_argument("--cap", default=None, help="run the server in a memory cgroup with this limit (root)")
    ap.add_argument(
        "--queue",
        type=int,
        default=4,
        help="serve --queue: with fewer slots than clients, some requests are refused with 503, which the run counts",
    )
    ap.add_argument("-c", "--ctx-size", type=int, default=4096)
    ap.add_argument("--time-limit", type=float, default=1800, help="seconds after which no request is sent")
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--server-arg", action="append", default=[], help="extra serve flag (repeatable)")
    ap.add_argument("--log", default="/tmp/serve_load.log", help="the server's stderr")
    a = ap.parse_args(argv)

    args = ["-c", str(a.ctx_size), "--queue", str(a.queue), "--no-learn", *a.server_arg]
    if a.ram_budget:
        args += ["--ram-budget", a.ram_budget]
    srv = Server(a.model, args, cap=a.cap, log=a.log)
    out, lock = [], threading.Lock()
    t0 = time.perf_counter()
    deadline = time.monotonic() + a.time_limit
    batches, done_flag = [], threading.Event()

    def watch_batches() -> None:  # the decode steps' batch sizes, sampled from /metrics
        while not done_flag.wait(0.5):
            try:
                batches.append(srv.metrics().get("streamrun_batch_size", 0))
            except Exception:  # noqa: BLE001 - a sample missed while the server is busy
                pass

    try:
        threads = [threading.Thread(target=client, args=(k, a, srv.url, deadline, out, lock)) for k in range(a.clients)]
        watcher = threading.Thread(target=watch_batches, daemon=True)
        watcher.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        done_flag.set()
        m = wait_idle(srv)
        alive = srv.alive()
        peak_rss = srv.peak_rss()
    finally:
        stopped = srv.stop()

    done = [r for r in out if r.get("status") == 200 and not r.get("disconnect")]
    cut = [r for r in out if r.get("status") == 200 and r.get("disconnect")]
    refused = [r for r in out if r.get("status") == 503]
    errors = [r for r in out if r.get("status") not in (200, 503) and r.get("status") != "not-sent (time bound)"]
    lat = [r["latency_s"] for r in done]
    ttft = [r["ttft_s"] for r in out if "ttft_s" in r]
    tokens = sum(r.get("tokens", 0) for r in done)
    slots = {k.split('"')[1]: v for k, v in m.items() if k.startswith("streamrun_expert_slots")}
    budget = parse_size(a.ram_budget) if a.ram_budget else None
    report = {
        "model": a.model,
        "clients": a.clients,
        "requests_per_client": a.requests,
        "max_tokens": a.max_tokens,
        "ram_budget": a.ram_budget,
        "cap": a.cap,
        "load_s": srv.ready_s,
        "wall_s": wall,
        "sent": len([r for r in out if "latency_s" in r]),
        "answered": len(done),
        "disconnected_midway": len(cut),
        "refused_503": len(refused),
        "errors": len(errors),
        "not_sent": len(out) - len([r for r in out if "latency_s" in r]),
        "error_samples": [r["status"] for r in errors[:5]],
        "latency_p50_s": percentile(lat, 50),
        "latency_p95_s": percentile(lat, 95),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "completion_tokens_answered": tokens,
        "throughput_tok_s": tokens / wall if wall > 0 else None,
        "decode_tok_s_p50": percentile([r["decode_tps"] for r in done if "decode_tps" in r], 50),
        "cached_prompt_tokens": m.get("streamrun_prompt_tokens_cached_total"),
        "prefilled_prompt_tokens": m.get("streamrun_prompt_tokens_total"),
        "server_requests": {k.split('"')[1]: v for k, v in m.items() if k.startswith("streamrun_requests_total")},
        "expert_slots_after": slots,
        "leaked_slots": slots.get("in_use", 0) + slots.get("reading", 0),
        "busy_sequence_slots_after": m.get('streamrun_slots{state="busy"}', 0),
        "batch_size_max": max(batches, default=0),
        "batch_size_mean": sum(batches) / len(batches) if batches else 0.0,
        "server_alive_after": alive,
        "server_peak_rss_bytes": peak_rss,
        "rss_within_budget": None if budget is None else peak_rss <= budget,
        "server_exit": stopped,
    }
    ok = (
        alive
        and report["errors"] == 0
        and report["leaked_slots"] == 0
        and report["busy_sequence_slots_after"] == 0
        and report["answered"] + len(cut) + len(refused) == report["sent"]
        and report["rss_within_budget"] is not False
        and not stopped.get("oom_kill_count")
    )
    report["ok"] = ok
    print(json.dumps(report, indent=1))
    print(
        f"answered {len(done)}, disconnected {len(cut)}, 503 {len(refused)}, errors {len(errors)} | latency p50 "
        f"{report['latency_p50_s'] or 0:.2f} s p95 {report['latency_p95_s'] or 0:.2f} s | ttft p50 "
        f"{report['ttft_p50_s'] or 0:.2f} s | {report['throughput_tok_s'] or 0:.2f} tok/s overall | leaked slots "
        f"{report['leaked_slots']:.0f}, busy sequence slots {report['busy_sequence_slots_after']:.0f} | batch "
        f"max {report['batch_size_max']:.0f} mean {report['batch_size_mean']:.2f} | peak RSS {peak_rss / 2**30:.2f} GiB | {'OK' if ok else 'FAILED'}",
        file=sys.stderr,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
