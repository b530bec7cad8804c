"""ModelConfig: the hyper-parameters of a Qwen3 / Qwen3-MoE / Qwen2 GGUF, read from the file's own keys, and the
tensor checks (presence, type, shape) that make a bad file fail with one line before any compute."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gguf.constants import GGMLQuantizationType as T, Keys

from streamer import budget
from streamer.errors import StreamerError
from streamer.formats import FORMATS, NAMES
from streamer.gguf_file import GGUFFile
from streamer.io import human
from streamer.state import SAVED_MAX

ARCHS = ("qwen3", "qwen3moe", "qwen2", "qwen35moe", "qwen3next")
MOE_ARCHS = ("qwen3moe", "qwen35moe", "qwen3next")
HYBRID_ARCHS = ("qwen35moe", "qwen3next")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rms_eps: float
    rope_theta: float
    n_ctx_train: int
    n_vocab: int
    tied: bool
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    # hybrid (qwen35moe, qwen3next): every full_attn_interval-th layer is gated attention with RoPE on its first n_rot
    # channels, the others Gated DeltaNet (linear attention); a shared expert beside the routed ones
    n_rot: int = 0  # 0: the whole head
    full_attn_interval: int = 0  # 0: every layer is attention
    ssm_conv: int = 0  # conv1d kernel width
    ssm_head_dim: int = 0  # key and value head width (ssm.state_size)
    ssm_k_heads: int = 0  # ssm.group_count
    ssm_v_heads: int = 0  # ssm.time_step_rank
    n_ff_shexp: int = 0
    n_nextn: int = 0  # MTP blocks after the trunk (not run)

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @property
    def ffn_norm(self) -> str:
        """The name of each layer's norm before its FFN."""
        return "post_attention_norm" if self.arch in HYBRID_ARCHS else "ffn_norm"

    def is_recurrent(self, layer: int) -> bool:
        """Whether the layer's token mixer is linear attention (a recurrent state) rather than attention."""
        return self.full_attn_interval > 0 and (layer + 1) % self.full_attn_interval != 0

    @property
    def n_attn_layers(self) -> int:
        return sum(not self.is_recurrent(i) for i in range(self.n_layer))

    @property
    def ssm_conv_dim(self) -> int:
        """Channels of a linear-attention layer's conv: q and k (k-heads), v (v-heads)."""
        return (2 * self.ssm_k_heads + self.ssm_v_heads) * self.ssm_head_dim

    @property
    def recurrent_shapes(self) -> dict[str, tuple[int, ...]]:
        """One linear-attention layer's float32 state: the conv's last K-1 inputs, a (d, d) matrix per value head."""
        d = self.ssm_head_dim
        return {"conv": (self.ssm_conv - 1, self.ssm_conv_dim), "ssm": (self.ssm_v_heads, d, d)}

    @property
    def recurrent_bytes(self) -> int:
        """One copy of every linear-attention layer's state."""
        per = sum(math.prod(shape) for shape in self.recurrent_shapes.values())
        return 4 * per * (self.n_layer - self.n_attn_layers)

    def check_tokens(self, ids) -> None:
        """Every id in the vocabulary (a sequence or an integer array)."""
        bad = [int(t) for t in ids if not 0 <= t < self.n_vocab][:1]
        if bad:
            raise StreamerError(f"token id {bad[0]} is out of range (vocabulary has {self.n_vocab} tokens)")

    def context(self, n_ctx: int | None) -> int:
        """The context to allocate for -c: None -> 4096 or the model's limit if smaller; 0 -> the model's limit."""
        if n_ctx is not None and n_ctx < 0:
            raise StreamerError(f"-c/--ctx-size must be positive (0 = the model's limit), got {n_ctx}")
        n = min(4096, self.n_ctx_train) if n_ctx is None else n_ctx or self.n_ctx_train
        self._check_context_memory(n)
        return n

    def _check_context_memory(self, n_ctx: int) -> None:
        """Refuse, before allocating anything, a context whose KV cache and RoPE tables cannot fit in memory: a
        file may claim a context of 2**40 tokens, or heads so wide that even 4096 positions are too many.
        The RoPE tables are computed at once (float64 angles, cos and sin: ~16 bytes per channel at peak)."""
        need = self.state_bytes(n_ctx) + n_ctx * 16 * self.head_dim
        avail = budget.available_memory()  # the module's: tests patch it
        if need > avail:
            raise StreamerError(
                f"a context of {n_ctx} tokens needs {human(need)} for its KV cache and RoPE tables, "
                f"more than the {human(avail)} of memory available (set a smaller -c/--ctx-size)"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_attn_layers * self.n_head_kv * self.head_dim * 2  # K and V, float16

    def state_bytes(self, n_ctx: int, n_seq: int = 1) -> int:
        """The memory of n_seq sequences' states (model.new_state()) at a context of n_ctx each: the K/V rows,
        and the recurrent state twice (committed and in progress) plus its saved copies (state.SAVED_MAX)."""
        return n_seq * (n_ctx * self.kv_bytes_per_token + (2 + SAVED_MAX) * self.recurrent_bytes)

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> ModelConfig:
        arch = gf.arch
        if arch not in ARCHS:
            raise StreamerError(f"{gf.path}: unsupported architecture {arch!r} (stream-run runs {', '.join(ARCHS)})")

        def key(tmpl: str, default=None, kind=int):
            k = tmpl.format(arch=arch)
            v = gf.scalar(k, kind, default)  # a value of another type (e.g. a string) is an error naming k
            if v is None:
                raise StreamerError(f"{gf.path}: missing metadata key '{k}'")
            return v

        L = Keys.LLM
        A = Keys.Attention
        n_embd = key(L.EMBEDDING_LENGTH)
        n_head = key(A.HEAD_COUNT)
        if "token_embd.weight" not in gf.tensors:
            raise StreamerError(f"{gf.path}: missing tensor 'token_embd.weight'")
        n_vocab = gf.tensors["token_embd.weight"].shape[0]
        moe = arch in MOE_ARCHS
        hybrid = arch in HYBRID_ARCHS
        S = Keys.SSM
        head_dim = key(A.KEY_LENGTH, n_embd // max(n_head, 1))
        n_nextn = key(L.NEXTN_PREDICT_LAYERS, 0) if hybrid else 0
        cfg = cls(
            arch=arch,
            n_layer=key(L.BLOCK_COUNT) - n_nextn,
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=key(A.HEAD_COUNT_KV, n_head),
            head_dim=head_dim,
            n_ff=key(L.FEED_FORWARD_LENGTH, 0),
            rms_eps=key(A.LAYERNORM_RMS_EPS, 1e-6, float),
            rope_theta=key(Keys.Rope.FREQ_BASE, 1e6, float),
            n_ctx_train=key(L.CONTEXT_LENGTH, 40960),
            n_vocab=n_vocab,
            tied="output.weight" not in gf.tensors,
            n_expert=key(L.EXPERT_COUNT) if moe else 0,
            n_expert_used=key(L.EXPERT_USED_COUNT) if moe else 0,
            n_ff_exp=key(L.EXPERT_FEED_FORWARD_LENGTH) if moe else 0,
            n_rot=key(Keys.Rope.DIMENSION_COUNT, head_dim) if hybrid else 0,
            full_attn_interval=key(L.FULL_ATTENTION_INTERVAL, 4) if hybrid else 0,
            ssm_conv=key(S.CONV_KERNEL) if hybrid else 0,
            ssm_head_dim=key(S.STATE_SIZE) if hybrid else 0,
            ssm_k_heads=key(S.GROUP_COUNT) if hybrid else 0,
            ssm_v_heads=key(S.TIME_STEP_RANK) if hybrid else 0,
            n_ff_shexp=key(L.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0) if hybrid else 0,
            n_nextn=n_nextn,
        )
        cfg._check_geometry(gf.path)
        if cfg.n_layer > len(gf.tensors):  # checked before expected_shapes() lists every layer's tensors
            raise StreamerError(
                f"{gf.path}: {arch}.block_count is {cfg.n_layer}, but the file has only {len(gf.tensors)} tensors"
            )
        cfg.check_tensors(gf)
        n_tokens = gf.array_len(Keys.Tokenizer.LIST)
        if n_tokens is not None and n_tokens != cfg.n_vocab:
            raise StreamerError(
                f"{gf.path}: the vocabulary has {n_tokens} tokens but 'token_embd.weight' has {cfg.n_vocab} rows"
            )
        return cfg

    def _check_geometry(self, path: str) -> None:
        bad = [
            n
            for n in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_vocab", "n_ctx_train")
            if getattr(self, n) <= 0
        ]
        # the kernels divide by sqrt(mean(x^2) + eps): eps must be positive; RoPE needs theta^(-2j/d) finite
        for n in ("rms_eps", "rope_theta"):
            if not 0.0 < getattr(self, n) < math.inf:
                bad.append(f"{n} {getattr(self, n)!r}")
        if self.n_head_kv > 0 and self.n_head % self.n_head_kv:
            bad.append("n_head % n_head_kv")
        if self.head_dim % 2:
            bad.append("head_dim (must be even for RoPE)")
        moe = self.arch in MOE_ARCHS  # not is_moe: an expert_count of 0 must not turn the file into a dense model
        if moe and not (0 < self.n_expert_used <= self.n_expert and self.n_ff_exp > 0):
            bad.append("expert_count/expert_used_count/expert_feed_forward_length")
        if not moe and self.n_ff <= 0:
            bad.append("feed_forward_length")
        if self.arch in HYBRID_ARCHS:
            if not (0 < self.n_rot <= self.head_dim and self.n_rot % 2 == 0):
                bad.append(f"rope.dimension_count {self.n_rot} (must be even, at most the head width)")
            if self.full_attn_interval < 1:
                bad.append("full_attention_interval")
            if min(self.ssm_conv, self.ssm_head_dim, self.ssm_k_heads, self.ssm_v_heads) < 1:
                bad.append("ssm.conv_kernel/state_size/group_count/time_step_rank")
            elif self.ssm_v_heads % self.ssm_k_heads:
                bad.append("ssm.time_step_rank % ssm.group_count")
        if bad:
            raise StreamerError(f"{path}: bad model geometry in metadata: {', '.join(bad)}")

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the forward pass reads, GGUF name -> logical numpy shape."""
        E, hd = self.n_embd, self.head_dim
        s: dict[str, tuple[int, ...]] = {"token_embd.weight": (self.n_vocab, E), "output_norm.weight": (E,)}
        if not self.tied:
            s["output.weight"] = (self.n_vocab, E)
        for i in range(self.n_layer):
            b = f"blk.{i}."
            if self.arch in HYBRID_ARCHS:
                s.update(self._hybrid_shapes(i))
                continue
            s.update(
                {
                    b + "attn_norm.weight": (E,),
                    b + "attn_q.weight": (self.n_head * hd, E),
                    b + "attn_k.weight": (self.n_head_kv * hd, E),
                    b + "attn_v.weight": (self.n_head_kv * hd, E),
                    b + "attn_output.weight": (E, self.n_head * hd),
                    b + "ffn_norm.weight": (E,),
                }
            )
            if self.arch == "qwen2":  # q/k/v biases, no per-head q/k norm
                s.update(
                    {
                        b + "attn_q.bias": (self.n_head * hd,),
                        b + "attn_k.bias": (self.n_head_kv * hd,),
                        b + "attn_v.bias": (self.n_head_kv * hd,),
                    }
                )
            else:
                s.update({b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)})
            if self.is_moe:
                X, F = self.n_expert, self.n_ff_exp
                s.update(
                    {
                        b + "ffn_gate_inp.weight": (X, E),
                        b + "ffn_gate_exps.weight": (X, F, E),
                        b + "ffn_up_exps.weight": (X, F, E),
                        b + "ffn_down_exps.weight": (X, E, F),
                    }
                )
            else:
                s.update(
                    {
                        b + "ffn_gate.weight": (self.n_ff, E),
                        b + "ffn_up.weight": (self.n_ff, E),
                        b + "ffn_down.weight": (E, self.n_ff),
                    }
                )
        return s

    def _hybrid_shapes(self, i: int) -> dict[str, tuple[int, ...]]:
        """One hybrid layer: gated attention or Gated DeltaNet, then routed experts and a shared expert. qwen3next
        files project the linear attention's q, k, v and z in one matrix (ssm_in, grouped by key head) and its
        beta and alpha in another (ssm_ba); qwen35moe's in four. (Newer qwen3next files split ssm_in in two:
        _file_layout.)"""
        E, hd, b = self.n_embd, self.head_dim, f"blk.{i}."
        X, F, Fs = self.n_expert, self.n_ff_exp, self.n_ff_shexp
        s = {b + "attn_norm.weight": (E,), b + "post_attention_norm.weight": (E,)}
        if self.is_recurrent(i):
            d, nv = self.ssm_head_dim, self.ssm_v_heads
            s.update(
                {
                    b + "ssm_conv1d.weight": (self.ssm_conv_dim, self.ssm_conv),
                    b + "ssm_dt.bias": (nv,),
                    b + "ssm_a": (nv,),
                    b + "ssm_norm.weight": (d,),
                    b + "ssm_out.weight": (E, nv * d),
                }
            )
            if self.arch == "qwen3next":
                s[b + "ssm_in.weight"] = (self.ssm_conv_dim + nv * d, E)
                s[b + "ssm_ba.weight"] = (2 * nv, E)
            else:
                s[b + "attn_qkv.weight"] = (self.ssm_conv_dim, E)
                s[b + "attn_gate.weight"] = (nv * d, E)
                s[b + "ssm_beta.weight"] = (nv, E)
                s[b + "ssm_alpha.weight"] = (nv, E)
        else:
            s.update(
                {
                    b + "attn_q.weight": (2 * self.n_head * hd, E),  # query and output gate, per head
                    b + "attn_k.weight": (self.n_head_kv * hd, E),
                    b + "attn_v.weight": (self.n_head_kv * hd, E),
                    b + "attn_output.weight": (E, self.n_head * hd),
                    b + "attn_q_norm.weight": (hd,),
                    b + "attn_k_norm.weight": (hd,),
                }
            )
        s.update(
            {
                b + "ffn_gate_inp.weight": (X, E),
                b + "ffn_gate_exps.weight": (X, F, E),
                b + "ffn_up_exps.weight": (X, F, E),
                b + "ffn_down_exps.weight": (X, E, F),
            }
        )
        if Fs:
            s.update(
                {
                    b + "ffn_gate_inp_shexp.weight": (E,),
                    b + "ffn_gate_shexp.weight": (Fs, E),
                    b + "ffn_up_shexp.weight": (Fs, E),
                    b + "ffn_down_shexp.weight": (E, Fs),
                }
            )
        return s

    def check_tensors(self, gf: GGUFFile) -> None:
        for name, shape in _file_layout(self.expected_shapes(), gf).items():
            t = gf.tensors.get(name)
            if t is None:
                raise StreamerError(f"{gf.path}: missing tensor '{name}'")
            if t.qtype not in FORMATS:
                raise StreamerError(
                    f"tensor '{name}' has type {t.qtype.name}, which stream-run does not support (supported: {NAMES})"
                )
            in_place = len(shape) == 1 or name.endswith("ssm_conv1d.weight")  # used as float32 arrays in place
            if in_place and t.qtype != T.F32:
                raise StreamerError(
                    f"tensor '{name}' has type {t.qtype.name}; "
                    "stream-run needs norm weights in F32 (biases, conv kernels too)"
                )
            if t.shape != shape:
                raise StreamerError(
                    f"{gf.path}: tensor '{name}' has shape {list(t.shape)}, "
                    f"expected {list(shape)} from the model's metadata"
                )


def _file_layout(shapes: dict, gf: GGUFFile) -> dict:
    """The expected shapes in the layout the file chose where llama.cpp's converters write one of two:
    - each layer's experts' gate and up as one `ffn_gate_up_exps` tensor (gate rows, then up rows, per expert;
      convert_hf_to_gguf.py --fuse-gate-up-exps);
    - a qwen3next linear-attention layer's ssm_in as attn_qkv (q, k, v of every head) and attn_gate (z), as
      newer converters write them (ssm_ba stays)."""
    out = {}
    for name, shape in shapes.items():
        merged = name.replace("ffn_gate_exps", "ffn_gate_up_exps")
        qkv = name.replace("ssm_in.weight", "attn_qkv.weight")
        if merged in gf.tensors and merged != name:
            out[merged] = (shape[0], 2 * shape[1], shape[2])
        elif name.endswith("ffn_up_exps.weight") and name.replace("ffn_up_exps", "ffn_gate_up_exps") in gf.tensors:
            continue
        elif qkv != name and name not in gf.tensors and qkv in gf.tensors:
            value = shapes[name.replace("ssm_in", "ssm_out")][1]
            out[qkv] = (shape[0] - value, shape[1])
            out[name.replace("ssm_in", "attn_gate")] = (value, shape[1])
        else:
            out[name] = shape
    return out
