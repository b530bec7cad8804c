#!/usr/bin/env python
"""A 5-turn conversation through `stream-run serve` against the same 5 turns as separate `stream-run run`
calls (each given its turn's whole prompt, as a client without a server would), optionally each inside a
cgroup-v1 memory cap with the model evicted first. Reports per turn: prompt tokens prefilled (and reused from
the KV cache), prefill and decode tok/s, latency; and the cgroups' peak usage. Prints one JSON object and a
table on stderr.

    python bench/serve_turns.py MODEL.gguf --ram-budget 8G --cap 8G [--turns 5] [--max-tokens 32]

Both paths decode exactly --max-tokens per turn (ignore_eos / --ignore-eos) with greedy sampling, and both
see the same prompts: the server's replies become the assistant messages of the next turns, rendered as the
server renders them. Never run in CI; timings mean something only on a quiet machine."""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from cgroup import evict_all, run_capped  # noqa: E402
from serve_common import STREAM_RUN, Server  # noqa: E402

QUESTIONS = [
    "Tell me about the sea.",
    "And about mountains?",
    "Which of the two is older?",
    "Write a short poem about both.",
    "Summarise our conversation.",
]
SPEED = re.compile(
    r"prompt: (\d+) tok in ([\d.]+) s \(([\d.]+) tok/s\) \| generation: (\d+) tok in ([\d.]+) s "
    r"\(([\d.]+) tok/s\)"
)


def server_turns(a) -> tuple[list[dict], list[dict], dict]:
    args = ["-c", str(a.ctx_size), "--no-learn", *a.server_arg]
    if a.ram_budget:
        args += ["--ram-budget", a.ram_budget]
    srv = Server(a.model, args, cap=a.cap, log=a.log)
    msgs = [{"role": "system", "content": "You are a helpful assistant. /no_think"}]
    rows = []
    try:
        with httpx.Client(base_url=srv.url, timeout=3600) as c:
            for i in range(a.turns):
                msgs.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
                t0 = time.perf_counter()
                r = c.post(
                    "/v1/chat/completions",
                    json={"messages": msgs, "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True},
                )
                r.raise_for_status()
                j = r.json()
                t, u = j["timings"], j["usage"]
                rows.append(
                    {
                        "turn": i + 1,
                        "prompt_tokens": u["prompt_tokens"],
                        "cached": t["cache_n"],
                        "prefilled": t["prompt_n"],
                        "prefill_tok_s": t["prompt_per_second"],
                        "generated": t["predicted_n"],
                        "decode_tok_s": t["predicted_per_second"],
                        "latency_s": time.perf_counter() - t0,
                    }
                )
                msgs.append({"role": "assistant", "content": j["choices"][0]["message"]["content"]})
        rss = srv.peak_rss()
    finally:
        stats = srv.stop()
    return rows, msgs, {"load_s": srv.ready_s, "peak_rss_bytes": rss, **stats}


def run_turns(a, msgs: list[dict]) -> list[dict]:
    from streamer.chat import EMPTY_THINK
    from streamer.server.text import render_chat

    rows = []
    replies = {m["content"]: EMPTY_THINK + m["content"] for m in msgs if m["role"] == "assistant"}
    users = [k for k, m in enumerate(msgs) if m["role"] == "user"]
    for i, k in enumerate(users):
        prompt = render_chat(msgs[: k + 1], think=False, replies=replies)  # what the server was asked
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
            f.write(prompt)
        cmd = [
            STREAM_RUN,
            "run",
            a.model,
            "-f",
            f.name,
            "-n",
            str(a.max_tokens),
            "--ignore-eos",
            "--no-display-prompt",
            "--no-learn",
            "-c",
            str(a.ctx_size),
            *a.server_arg,
        ]
        if a.ram_budget:
            cmd += ["--ram-budget", a.ram_budget]
        evict_all([a.model])
        res = run_capped(cmd, a.cap, timeout=3600)
        Path(f.name).unlink()
        m = SPEED.search(res.stderr)
        row = {
            "turn": i + 1,
            "returncode": res.returncode,
            "wall_s": res.wall_s,
            "peak_bytes": res.max_usage_bytes or res.rusage_maxrss_bytes,
            "oom_killed": res.oom_killed,
        }
        if m:
            row.update(
                prefilled=int(m.group(1)),
                prefill_tok_s=float(m.group(3)),
                generated=int(m.group(4)),
                decode_tok_s=float(m.group(6)),
            )
        else:
            row["stderr_tail"] = res.stderr[-500:]
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ram-budget", default=None)
    ap.add_argument("--cap", default=None, help="memory cgroup limit for the server and for each run (root)")
    ap.add_argument("-c", "--ctx-size", type=int, default=4096)
    ap.add_argument("--server-arg", action="append", default=[], help="extra flag for serve and run, e.g. -t=2")
    ap.add_argument("--log", default="/tmp/serve_turns.log", help="the server's stderr")
    a = ap.parse_args(argv)

    srv_rows, msgs, srv_info = server_turns(a)
    run_rows = run_turns(a, msgs)
    report = {
        "model": a.model,
        "turns": a.turns,
        "max_tokens": a.max_tokens,
        "ram_budget": a.ram_budget,
        "cap": a.cap,
        "server": {"turns": srv_rows, **srv_info},
        "run": run_rows,
    }
    print(json.dumps(report, indent=1))
    print(
        f"{'turn':>4} | {'server: prefilled':>17} {'cached':>7} {'prefill t/s':>11} {'decode t/s':>10} "
        f"{'latency s':>9} | {'run: prefilled':>14} {'prefill t/s':>11} {'decode t/s':>10} {'wall s':>7}",
        file=sys.stderr,
    )
    for s, r in zip(srv_rows, run_rows):
        print(
            f"{s['turn']:>4} | {s['prefilled']:>17} {s['cached']:>7} {s['prefill_tok_s']:>11.2f} "
            f"{s['decode_tok_s']:>10.2f} {s['latency_s']:>9.2f} | {r.get('prefilled', '-'):>14} "
            f"{r.get('prefill_tok_s', 0):>11.2f} {r.get('decode_tok_s', 0):>10.2f} {r['wall_s']:>7.2f}",
            file=sys.stderr,
        )
    peak = max([r["peak_bytes"] for r in run_rows] or [0])
    srv_peak = srv_info.get("max_usage_bytes") or srv_info["peak_rss_bytes"]
    print(
        f"server: load {srv_info['load_s']:.1f} s, peak {srv_peak} bytes{' (cgroup)' if a.cap else ' (RSS)'}; "
        f"runs: peak {peak} bytes",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
