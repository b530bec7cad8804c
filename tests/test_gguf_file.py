"""Opening and validating GGUF files: zero-copy views, and one clear error per kind of bad file, each on a
small file the test breaks on purpose."""

import shutil
import struct

import numpy as np
import pytest
from gguf import GGUFReader

from streamer.config import ModelConfig
from streamer.errors import StreamerError
from streamer.gguf_file import GGUFFile


def broken_copy(src, dst, patch=None, truncate=None):
    shutil.copy(src, dst)
    if patch is not None:
        data = bytearray(open(dst, "rb").read())
        patch(data)
        open(dst, "wb").write(data)
    if truncate is not None:
        with open(dst, "r+b") as f:
            f.truncate(truncate)
    return dst


def tensor_info_at(data: bytearray, name: str) -> int:
    """Offset just after a tensor's name in the tensor-info table (n_dims follows)."""
    key = struct.pack("<Q", len(name)) + name.encode()
    i = data.find(key)
    assert i > 0 and data.find(key, i + 1) < 0
    return i + len(key)


def open_cfg(path):
    return ModelConfig.from_gguf(GGUFFile(path))


@pytest.fixture
def good(synth_model):
    return synth_model("tiny", "Q8_0")


def test_metadata_and_tensors_agree_with_gguf_py(good):
    gf, ref = GGUFFile(good), GGUFReader(str(good))
    assert set(gf.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors:
        mine = gf.tensors[t.name]
        assert mine.qtype == t.tensor_type and mine.offset == t.data_offset and mine.nbytes == t.n_bytes
        assert np.array_equal(
            np.asarray(gf.view(t.name)).reshape(-1).view(np.uint8), np.asarray(t.data).reshape(-1).view(np.uint8)
        )
    cfg = open_cfg(good)
    assert (cfg.arch, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff) == (
        "qwen3",
        2,
        256,
        4,
        2,
        64,
        512,
    )
    assert cfg.rope_theta == 1e6 and cfg.n_ctx_train == 2048 and not cfg.tied and not cfg.is_moe
    tokens = gf.get("tokenizer.ggml.tokens")
    assert tokens == [
        str(bytes(ref.fields["tokenizer.ggml.tokens"].parts[i]), "utf-8")
        for i in ref.fields["tokenizer.ggml.tokens"].data
    ]


def test_views_are_zero_copy_and_read_only(good):
    gf = GGUFFile(good)
    for name in gf.tensors:
        v = gf.view(name)
        assert np.shares_memory(v, gf.mm) and not v.flags.writeable
    assert type(gf.fields["tokenizer.ggml.tokens"]).__name__ == "_StringArray"  # not decoded at open


def test_moe_config(synth_model):
    cfg = open_cfg(synth_model("tiny-moe", "Q8_0"))
    assert cfg.is_moe and (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp) == (16, 4, 256)


def test_not_a_gguf(tmp_path, good):
    p = broken_copy(good, tmp_path / "m.gguf", patch=lambda d: d.__setitem__(slice(0, 4), b"GGML"))
    with pytest.raises(StreamerError, match=r"m.gguf is not a GGUF file \(magic b'GGML'"):
        GGUFFile(p)
    (tmp_path / "text.gguf").write_text("hello, I am a text file and not a model at all")
    with pytest.raises(StreamerError, match="not a GGUF file"):
        GGUFFile(tmp_path / "text.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(StreamerError, match="not a GGUF file"):
        GGUFFile(tmp_path / "empty.gguf")
    with pytest.raises(StreamerError, match="cannot open .*missing.gguf"):
        GGUFFile(tmp_path / "missing.gguf")


def test_truncated_data_and_header(tmp_path, good):
    size = good.stat().st_size
    p = broken_copy(good, tmp_path / "t.gguf", truncate=size - 1000)
    with pytest.raises(StreamerError, match=r"is truncated: tensor '.+' ends at byte \d+ but the file has"):
        GGUFFile(p)
    p = broken_copy(good, tmp_path / "h.gguf", truncate=9000)
    with pytest.raises(
        StreamerError,
        match=r"truncated: the GGUF header runs past the end of the file "
        r"\(reading tensor info #8\)",
    ):
        GGUFFile(p)
    p = broken_copy(good, tmp_path / "v.gguf", truncate=2000)
    with pytest.raises(
        StreamerError,
        match=r"v.gguf is truncated or corrupt: metadata key 'tokenizer.ggml.tokens' "
        r"claims 381 array elements, more than the rest of the file can hold",
    ):
        GGUFFile(p)
    p = broken_copy(good, tmp_path / "s.gguf", truncate=200)  # too short for the counts in its header
    with pytest.raises(
        StreamerError,
        match=r"s.gguf is truncated or not a valid GGUF file \(its header claims "
        r"25 tensors, more than its 200 bytes can hold\)",
    ):
        GGUFFile(p)


def test_unsupported_arch(tmp_path, good):
    def patch(d):
        key = b"general.architecture"
        i = d.find(key) + len(key) + 4 + 8  # value type, string length
        assert d[i : i + 5] == b"qwen3"
        d[i : i + 5] = b"llama"

    p = broken_copy(good, tmp_path / "a.gguf", patch=patch)
    with pytest.raises(StreamerError, match="unsupported architecture 'llama'"):
        open_cfg(p)


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path, good):
    def patch(d):
        i = tensor_info_at(d, "blk.0.attn_q.weight")
        n_dims = struct.unpack_from("<I", d, i)[0]
        j = i + 4 + 8 * n_dims
        assert struct.unpack_from("<I", d, j)[0] == 8  # Q8_0
        struct.pack_into("<I", d, j, 35)  # TQ2_0: 256-element blocks of 66 bytes: no other check trips

    p = broken_copy(good, tmp_path / "q.gguf", patch=patch)
    with pytest.raises(
        StreamerError,
        match=r"tensor 'blk.0.attn_q.weight' has type TQ2_0, which stream-run does "
        r"not support \(supported: F32, F16, BF16, Q8_0",
    ):
        open_cfg(p)


def test_unknown_type_id(tmp_path, good):
    def patch(d):
        i = tensor_info_at(d, "blk.0.attn_k.weight")
        struct.pack_into("<I", d, i + 4 + 8 * 2, 999)

    with pytest.raises(StreamerError, match="tensor 'blk.0.attn_k.weight' has unknown GGML type id 999"):
        GGUFFile(broken_copy(good, tmp_path / "u.gguf", patch=patch))


def test_missing_tensor(tmp_path, good):
    def patch(d):
        i = tensor_info_at(d, "blk.1.ffn_up.weight")
        d[i - 6 : i] = b"uq.wei"  # rename to blk.1.ffn_uq.weight

    with pytest.raises(StreamerError, match="missing tensor 'blk.1.ffn_up.weight'"):
        open_cfg(broken_copy(good, tmp_path / "m.gguf", patch=patch))


def test_shape_mismatch(tmp_path, good):
    def patch(d):
        i = tensor_info_at(d, "blk.0.attn_k_norm.weight")
        assert struct.unpack_from("<IQ", d, i) == (1, 64)
        struct.pack_into("<Q", d, i + 4, 32)

    with pytest.raises(StreamerError, match=r"tensor 'blk.0.attn_k_norm.weight' has shape \[32\], expected \[64\]"):
        open_cfg(broken_copy(good, tmp_path / "s.gguf", patch=patch))


def test_nested_arrays_are_read_like_gguf_py(tmp_path):
    """An array of arrays: each element is itself an array value (element type, count, elements)."""
    import gguf

    path = tmp_path / "n.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_array("test.nested", [[1, 2, 3], [4, 5]])
    w.add_array("test.strings", [["a", "bc"], ["d"]])
    w.add_uint32("test.after", 7)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gf, ref = GGUFFile(path), GGUFReader(str(path))
    assert [a.tolist() for a in gf.fields["test.nested"]] == [[1, 2, 3], [4, 5]]
    assert [a.count for a in gf.fields["test.strings"]] == [2, 1]
    assert gf.fields["test.after"] == ref.fields["test.after"].contents() == 7  # both walked the same bytes


@pytest.mark.parametrize("value", [0, 3])
def test_bad_alignment(tmp_path, value):
    import gguf

    path = tmp_path / "a.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_custom_alignment(64)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    def patch(d):
        key = b"general.alignment"
        i = d.find(key) + len(key)
        assert struct.unpack_from("<I", d, i)[0] == 4  # UINT32
        struct.pack_into("<I", d, i + 4, value)

    broken_copy(path, tmp_path / "b.gguf", patch=patch)
    with pytest.raises(StreamerError, match=f"general.alignment is {value}, not a positive power of two"):
        GGUFFile(tmp_path / "b.gguf")


def test_norm_weights_must_be_f32(tmp_path, good):
    def patch(d):
        i = tensor_info_at(d, "blk.0.attn_norm.weight")
        assert struct.unpack_from("<IQI", d, i) == (1, 256, 0)  # 1-D, 256, F32
        struct.pack_into("<I", d, i + 12, 1)  # F16: half the bytes, still inside the file

    with pytest.raises(StreamerError, match="tensor 'blk.0.attn_norm.weight' has type F16; .* norm weights in F32"):
        open_cfg(broken_copy(good, tmp_path / "n.gguf", patch=patch))
