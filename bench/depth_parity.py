"""Logits parity by depth at real MoE geometry: stream-run vs llama.cpp vs a float64 oracle.

For each layer count N, writes the synthetic model (preset geometry, N layers, seed 0, real vocabulary) unless
it exists, and computes teacher-forced per-position logits for the same tokens with:
  sr     stream-run, in process (`Model.forward(all_logits=True)`, what `stream-run run --logits-out` does),
         with every MoE layer's top-k sets recorded;
  llama  llama.cpp through bench/llama_run.py (its own venv);
  f64    a float64 numpy forward over gguf-py dequantization (as tests/reference.py, but each routed expert is
         dequantized on demand: a 30B-A3B layer's experts would be ~5 GB of float64);
  srF    stream-run forced to f64's expert sets (weights still from its own router): numeric error alone;
  emu    (--emulate-ggml) f64 with ggml's rounding: q8_K activations before every quantized matmul, f16 Q/K/V
         and attention probabilities. Its expert sets can be counted, unlike llama.cpp's.
Prints cosine min / median and top-1 agreement per pair, and how many (token, layer) top-k sets differ from
f64's. A depth sweep tells a bug (wrong from the first layer) from chaos (near-tie routing flips that appear
and compound with depth); srF near 1 means the per-layer arithmetic is right and only routing differs.

    /opt/dev/bin/python bench/depth_parity.py --depths 1,2,4,8,16 --emulate-ggml --delete
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


# ---------------------------------------------------------------- float64 oracle
def q8k(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_K_ref per 256-value block, returned dequantized."""
    b = x.reshape(-1, 256)
    mx = b[np.arange(len(b)), np.abs(b).argmax(1)]
    out = np.zeros_like(b)
    nz = mx != 0
    iscale = (-127.0 / mx[nz]).astype(np.float32).astype(np.float64)
    q = np.minimum(127, np.rint(iscale[:, None] * b[nz]))
    out[nz] = q * (1.0 / iscale).astype(np.float32).astype(np.float64)[:, None]
    return out.reshape(x.shape)


class Oracle:
    def __init__(self, path: str, emulate_ggml: bool = False):
        from gguf import GGUFReader

        r = GGUFReader(path)
        a = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")

        def field(key):
            f = r.fields[key.format(a=a)]
            return f.parts[f.data[0]][0].item()

        self.n_layer, self.n_head = field("{a}.block_count"), field("{a}.attention.head_count")
        self.n_kv, self.hd = field("{a}.attention.head_count_kv"), field("{a}.attention.key_length")
        self.eps, self.theta = field("{a}.attention.layer_norm_rms_epsilon"), field("{a}.rope.freq_base")
        self.k = field("{a}.expert_used_count")
        self.t = {t.name: t for t in r.tensors}
        self.emu = emulate_ggml

    def _q(self, x):  # activation rounding before a quantized matmul
        return q8k(x) if self.emu else x

    def _h(self, x):  # f16 rounding (ggml's f16 KV cache and f16 attention products)
        return x.astype(np.float16).astype(np.float64) if self.emu else x

    def shape(self, name):
        return tuple(int(d) for d in reversed(self.t[name].shape.tolist()))

    def w(self, name, idx=None):
        """Dequantized float64 tensor; idx selects rows (2-D) or one expert's slab (3-D)."""
        from gguf.quants import dequantize

        t, shp = self.t[name], self.shape(name)
        data = np.asarray(t.data) if idx is None else np.asarray(t.data)[idx]
        out = dequantize(data, t.tensor_type).astype(np.float64)
        if idx is None:
            return out.reshape(shp)
        return out.reshape(shp[1:]) if np.ndim(idx) == 0 else out.reshape(len(idx), shp[-1])

    def rmsnorm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos):  # NEOX
        half = self.hd // 2
        ang = pos[:, None] * self.theta ** (-np.arange(half) * 2.0 / self.hd)[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)

    def logits(self, tokens, forced=None):
        """-> (logits (n, vocab), expert ids (n_layer, n, k)). forced (n_layer, n, k) replaces the top-k sets."""
        n, silu = len(tokens), (lambda z: z / (1.0 + np.exp(-z)))
        pos = np.arange(n, dtype=np.float64)
        x = self.w("token_embd.weight", np.asarray(tokens))
        mask = np.triu(np.full((n, n), -np.inf), 1)
        routes = []
        for i in range(self.n_layer):

            def W(s, i=i):
                return self.w(f"blk.{i}.{s}")

            h = self._q(self.rmsnorm(x, W("attn_norm.weight")))
            q = (h @ W("attn_q.weight").T).reshape(n, self.n_head, self.hd)
            k = (h @ W("attn_k.weight").T).reshape(n, self.n_kv, self.hd)
            v = self._h((h @ W("attn_v.weight").T).reshape(n, self.n_kv, self.hd))
            q = self._h(self.rope(self.rmsnorm(q, W("attn_q_norm.weight")), pos))
            k = self._h(self.rope(self.rmsnorm(k, W("attn_k_norm.weight")), pos))
            att = np.zeros((n, self.n_head, self.hd))
            for hh in range(self.n_head):
                g = hh // (self.n_head // self.n_kv)
                s = q[:, hh] @ k[:, g].T / np.sqrt(self.hd) + mask
                p = np.exp(s - s.max(axis=1, keepdims=True))
                att[:, hh] = self._h(p / p.sum(axis=1, keepdims=True)) @ v[:, g]
            x = x + self._q(att.reshape(n, -1)) @ W("attn_output.weight").T
            h = self.rmsnorm(x, W("ffn_norm.weight"))
            rl = h @ W("ffn_gate_inp.weight").T  # F32 router: ggml does not round its input
            p = np.exp(rl - rl.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            ids = np.argsort(-p, axis=1, kind="stable")[:, : self.k] if forced is None else forced[i]
            routes.append(ids)
            wts = np.take_along_axis(p, ids, 1)
            wts /= wts.sum(1, keepdims=True)
            out = np.zeros_like(h)
            for e in np.unique(ids):
                tok, slot = np.nonzero(ids == e)
                G, U, D = (self.w(f"blk.{i}.ffn_{p_}_exps.weight", int(e)) for p_ in ("gate", "up", "down"))
                ht = self._q(h[tok])
                out[tok] += wts[tok, slot][:, None] * (self._q(silu(ht @ G.T) * (ht @ U.T)) @ D.T)
            x = x + out
        xn = self._q(self.rmsnorm(x, self.w("output_norm.weight")))
        V = self.shape("output.weight")[0]
        lo = np.empty((n, V))
        for s in range(0, V, 16384):  # the head in slabs: its float64 copy would be 2.5 GB
            lo[:, s : s + 16384] = xn @ self.w("output.weight", np.arange(s, min(V, s + 16384))).T
        return lo, np.array(routes)


# ---------------------------------------------------------------- the tools
def stream_run_logits(path, tokens, threads, forced=None):
    """stream-run's all-position logits and each layer's expert sets (recorded by wrapping streamer.moe.route;
    with forced, the sets are replaced and the weights recomputed from stream-run's own router logits)."""
    import streamer.moe as moe
    from streamer.options import StreamOptions
    from streamer.session import open_model

    s = open_model(
        path, StreamOptions(stream=False, learn=False, prefetch=False), n_ctx=len(tokens) + 16, threads=threads
    )
    L, orig, calls, rec = s.cfg.n_layer, moe.route, [0], []

    def route(logits, k, top_p=1.0):
        layer = calls[0] % L
        calls[0] += 1
        ids, w = orig(logits, k, top_p)
        if forced is not None:
            ids = forced[layer].astype(ids.dtype)
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            w = np.take_along_axis(p, ids, axis=1)
            w = w / w.sum(axis=1, keepdims=True)
        rec.append(ids.copy())
        return ids, w

    moe.route = route
    try:
        lo = s.model.forward(np.asarray(tokens), s.model.new_state(), all_logits=True)
    finally:
        moe.route = orig
        s.close()
    assert calls[0] == L, "expected one routing call per layer (one prefill chunk)"
    return np.asarray(lo, np.float64), np.array(rec)


def llama_logits(path, tokens, args, out):
    cmd = [
        args.llama_python,
        str(HERE / "llama_run.py"),
        str(path),
        "--threads",
        str(args.threads),
        "--logits-tokens",
        ",".join(map(str, tokens)),
        "--logits-out",
        out,
    ] + (["--no-repack"] if args.no_repack else [])
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"llama.cpp failed (rc {p.returncode}): {p.stderr[-800:]}")
    return np.load(out).astype(np.float64)


# ---------------------------------------------------------------- report
def agreement(a, b) -> dict:
    cos = np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return {
        "cos_min": float(cos.min()),
        "cos_median": float(np.median(cos)),
        "top1": float((a.argmax(1) == b.argmax(1)).mean()),
    }


def set_flips(a, b) -> list[int]:
    """Per layer: how many tokens' top-k sets differ."""
    return [int(sum(set(x) != set(y) for x, y in zip(a[l], b[l]))) for l in range(len(a))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", default="1,2,4,8,16", help="comma-separated layer counts")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--qtype", default="Q4_K")
    ap.add_argument("--router-gain", type=float, default=3.0, help="SynthSpec.router_gain (writer default 3.0)")
    ap.add_argument("--models-dir", default="/work/models")
    ap.add_argument("--n-tokens", type=int, default=32, help="the first ids of stream-run bench's prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-repack", action="store_true", help="llama.cpp without weight repacking")
    ap.add_argument("--no-oracle", action="store_true", help="skip the float64 oracle (and srF, emu)")
    ap.add_argument("--emulate-ggml", action="store_true", help="also run the oracle with ggml's rounding")
    ap.add_argument("--delete", action="store_true", help="delete each model this run wrote when done with it")
    ap.add_argument("--llama-python", default=os.environ.get("LLAMA_PYTHON", "/opt/llamavenv/bin/python"))
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)

    import tempfile

    from streamer.bench import prompt_tokens
    from streamer.synth.writer import spec_for, write_model

    results = []
    for n in (int(d) for d in args.depths.split(",")):
        gain = "" if args.router_gain == 3.0 else f"-g{args.router_gain:g}"
        path = Path(args.models_dir) / f"depth-{args.preset}-{args.qtype}-L{n}{gain}.gguf"
        wrote = not path.exists()
        if wrote:
            print(f"writing {path}", file=sys.stderr)
            write_model(path, spec_for(args.preset, args.qtype, n, real_vocab=True, router_gain=args.router_gain))
        try:
            t0 = time.perf_counter()
            from streamer.gguf_file import GGUFFile

            n_vocab = GGUFFile(str(path)).tensors["token_embd.weight"].shape[0]
            tokens = [int(t) for t in prompt_tokens(n_vocab, 128)[: args.n_tokens]]
            sr, sr_ids = stream_run_logits(str(path), tokens, args.threads)
            with tempfile.TemporaryDirectory() as d:
                ll = llama_logits(path, tokens, args, os.path.join(d, "llama.npy"))
            logits = {"sr": sr, "llama": ll}
            row = {"layers": n, "path": str(path)}
            if not args.no_oracle:
                f64, f64_ids = Oracle(str(path)).logits(tokens)
                logits["f64"] = f64
                logits["srF"], _ = stream_run_logits(str(path), tokens, args.threads, forced=f64_ids)
                row["flips_sr_vs_f64"] = set_flips(sr_ids, f64_ids)
                if args.emulate_ggml:
                    logits["emu"], emu_ids = Oracle(str(path), emulate_ggml=True).logits(tokens)
                    row["flips_emu_vs_f64"] = set_flips(emu_ids, f64_ids)
            pairs = [("sr", "llama"), ("sr", "f64"), ("llama", "f64"), ("srF", "f64"), ("emu", "f64"), ("emu", "llama")]
            row["agreement"] = {
                f"{a} vs {b}": agreement(logits[a], logits[b]) for a, b in pairs if a in logits and b in logits
            }
            row["seconds"] = round(time.perf_counter() - t0, 1)
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "agreement"}), file=sys.stderr)
        finally:
            if wrote and args.delete:
                path.unlink()

    pairs = list(results[0]["agreement"]) if results else []
    print("cosine min / median / top-1, per-position logits under teacher forcing\n")
    print("| layers | " + " | ".join(pairs) + " | token-layers with other top-k than f64: sr | emu |")
    print("|---" * (len(pairs) + 3) + "|")
    for r in results:
        cells = [
            f"{m['cos_min']:.5f} / {m['cos_median']:.5f} / {100 * m['top1']:.0f}%" for m in r["agreement"].values()
        ]
        fl = [
            f"{sum(r[k])} of {len(r[k]) * args.n_tokens}" if k in r else "-"
            for k in ("flips_sr_vs_f64", "flips_emu_vs_f64")
        ]
        print(f"| {r['layers']} | " + " | ".join(cells + fl) + " |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
