"""Hostile GGUF files: each loads or raises GGUFError naming the problem, fast and in little memory.

Two kinds of test: 300 deterministic fuzz cases (every mutation class of `tests/gguf_fuzz.py`,
several times), and one hand-made file per problem class that `scan` must name.  The 10,000-case
run is `python tests/gguf_fuzz.py --cases 10000 --seed 0` (docs/reliability.md).
"""
from __future__ import annotations

import math
import struct
import time
from pathlib import Path

import gguf_fuzz
import pytest
from gguf.constants import GGMLQuantizationType, GGUFValueType
from gguf_fuzz import Limits, Mutator, encode_kv, info_blobs, kv_blobs, rebuild

from engine.io import gguf_model
from engine.io.gguf_model import GGUFError, GGUFLayout

FUZZ_CASES_PER_SEED = 150  # x 2 seeds = 300 cases


@pytest.fixture(scope="module")
def base(demo_path: Path) -> tuple[bytes, GGUFLayout]:
    data = demo_path.read_bytes()
    return data, gguf_model.scan_buffer(data, demo_path)


def _put(data: bytes, at: int, fmt: str, value: int | float) -> bytes:
    buf = bytearray(data)
    struct.pack_into("<" + fmt, buf, at, value)
    return bytes(buf)


def _kv(layout: GGUFLayout, key: str):
    return next(kv for kv in layout.kvs if kv.key == key)


def _tensor(layout: GGUFLayout, name: str):
    return next(t for t in layout.tensors if t.name == name)


def expect(tmp_path: Path, data: bytes, kind: str | set[str], *words: str) -> str:
    p = tmp_path / "case.gguf"
    p.write_bytes(data)
    with pytest.raises(GGUFError) as ei:
        m = gguf_model.load(p)
        for name in m.tensor_names():
            m.tensor(name)
    msg = str(ei.value)
    assert ei.value.kind in ({kind} if isinstance(kind, str) else kind), msg
    assert msg.startswith(f"{p}: ") and len(msg) < 600, msg
    for w in words:
        assert w in msg, msg
    return msg


# ------------------------------------------------------------------------------ fuzz cases
@pytest.mark.parametrize("seed", [0, 1])
def test_fuzz_cases_load_or_raise_gguf_error(base, tmp_path, seed):
    data, layout = base
    outcomes = gguf_fuzz.run_cases(data, seed, range(FUZZ_CASES_PER_SEED), jobs=0, workdir=tmp_path)
    # no time limit per case here (a busy machine's seconds are no bug; the watchdog still stops a
    # hang): `python tests/gguf_fuzz.py` holds each case to Limits.seconds and prints the times
    no_clock = Limits(seconds=math.inf)
    summary = gguf_fuzz.Summary(len(outcomes), seed, 0, len(data), no_clock, 0.0, 0, outcomes)
    assert not summary.violations, gguf_fuzz.render(summary)
    assert {o.mutation for o in outcomes} == set(Mutator(data, layout).op_names)  # every class, 3+ times
    statuses = {o.status for o in outcomes}
    assert statuses == {gguf_fuzz.STATUS_LOADED, gguf_fuzz.STATUS_GGUF_ERROR}
    kinds = {o.kind for o in outcomes if o.status == gguf_fuzz.STATUS_GGUF_ERROR}
    assert gguf_model.KIND_READER not in kinds, "scan let through a file that gguf's reader refused"
    assert len(kinds) >= 8, kinds


def test_cases_are_deterministic(base):
    data, layout = base
    a, b = Mutator(data, layout), Mutator(data, layout)
    assert [a.case(0, i).data for i in range(60)] == [b.case(0, i).data for i in range(60)]
    assert a.case(0, 3).data != a.case(1, 3).data


def test_the_harness_reports_what_it_must_catch(base, tmp_path):
    data, layout = base
    case = Mutator(data, layout).case(0, 0)

    def raises_key_error(path: Path) -> int:
        raise KeyError("boom")

    def slow(path: Path) -> int:
        time.sleep(0.05)
        return 0

    def spins(path: Path) -> int:
        while True:
            pass

    o = gguf_fuzz.run_case(case, tmp_path, Limits(), raises_key_error)
    assert o.status == gguf_fuzz.STATUS_EXCEPTION and o.kind == "KeyError" and o.violations(Limits())
    o = gguf_fuzz.run_case(case, tmp_path, Limits(), slow)
    assert any("took" in v for v in o.violations(Limits(seconds=0.01)))
    o = gguf_fuzz.run_case(case, tmp_path, Limits(watchdog_seconds=0.2), spins)
    assert o.status == gguf_fuzz.STATUS_TIMEOUT and o.violations(Limits())
    o = gguf_fuzz.run_case(case, tmp_path, Limits())
    assert o.violations(Limits(rss_slack_bytes=-(1 << 40))) != []  # the memory check is live


def test_cli_prints_the_table(demo_path, capsys):
    rc = gguf_fuzz.main(["--cases", "45", "--seed", "3", "--jobs", "0", "--base", str(demo_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| outcome | problem class | cases |" in out and "| loaded |" in out and "| GGUFError |" in out
    assert "violations: 0" in out and "peak RSS growth per case" in out and "| mutation |" in out


def test_cli_runs_cases_in_worker_processes(demo_path, capsys):
    rc = gguf_fuzz.main(["--cases", "12", "--seed", "0", "--jobs", "2", "--base", str(demo_path), "--format", "json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert '"cases": 12' in out and '"violations": []' in out


# --------------------------------------------------------------- one file per problem class
def test_absurd_header_counts_are_refused_before_reading(base, tmp_path):
    data, _ = base
    expect(tmp_path, _put(data, 8, "Q", 2**60), "count", "tensor_count 1152921504606846976", "cannot fit")
    expect(tmp_path, _put(data, 16, "Q", 2**64 - 1), "count", "kv_count 18446744073709551615", "cannot fit")
    expect(tmp_path, _put(data, 4, "I", 4), "version", "unsupported GGUF version 4")


def test_absurd_lengths_name_the_entry(base, tmp_path):
    data, L = base
    expect(tmp_path, _put(data, L.kvs[0].offset, "Q", 2**62), "length",
           "metadata entry #0: key length 4611686018427387904", "truncated")
    arch = _kv(L, "general.architecture")
    expect(tmp_path, _put(data, arch.value_offset, "Q", 2**62), "length",
           "general.architecture", "string value length 4611686018427387904")
    tokens = _kv(L, "tokenizer.ggml.tokens")
    expect(tmp_path, _put(data, tokens.value_offset + 4, "Q", 2**62), "count",
           "tokenizer.ggml.tokens", "array length 4611686018427387904")
    types = _kv(L, "tokenizer.ggml.token_type")
    expect(tmp_path, _put(data, types.value_offset + 4, "Q", 400_000), "count",
           "tokenizer.ggml.token_type", "array length 400000 of 4-byte items cannot fit")
    expect(tmp_path, _put(data, tokens.value_offset + 12, "Q", 2**40), "length",
           "tokenizer.ggml.tokens", "string #0 length 1099511627776")
    t = _tensor(L, "blk.0.attn_q.weight")
    expect(tmp_path, _put(data, t.offset, "Q", 2**62), "length", "tensor #", "name length 4611686018427387904")


def test_bad_value_and_item_types(base, tmp_path):
    data, L = base
    eos = _kv(L, "tokenizer.ggml.eos_token_id")
    expect(tmp_path, _put(data, eos.value_offset - 4, "I", 2**32 - 1), "type",
           "tokenizer.ggml.eos_token_id", "unknown value type 4294967295")
    types = _kv(L, "tokenizer.ggml.token_type")
    expect(tmp_path, _put(data, types.value_offset, "I", GGUFValueType.ARRAY), "type", "arrays of arrays")
    expect(tmp_path, _put(data, types.value_offset, "I", 13), "type", "unknown array item type 13")


def test_bad_tensor_entries(base, tmp_path):
    data, L = base
    q = _tensor(L, "blk.0.attn_q.weight")
    expect(tmp_path, _put(data, q.n_dims_at, "I", 5), "dims", "blk.0.attn_q.weight", "n_dims 5")
    wraps = _put(_put(data, q.dims_at, "Q", 2**32), q.dims_at + 8, "Q", 2**32)  # uint64 product wraps to 0
    expect(tmp_path, wraps, "dims", "overflow", "18446744073709551616")
    expect(tmp_path, _put(data, q.dims_at, "Q", 2**63), "dims", "above 2**63-1")
    expect(tmp_path, _put(data, q.type_at, "I", 2**32 - 1), "type", "unknown tensor type 4294967295")
    expect(tmp_path, _put(data, q.type_at, "I", GGMLQuantizationType.Q4_K), "dims", "block size 256")
    expect(tmp_path, _put(data, q.data_offset_at, "Q", q.data_offset + 1), "offset",
           "not a multiple of the alignment 32")
    expect(tmp_path, _put(data, q.data_offset_at, "Q", 2**62), "offset", "points past the end")
    other = _tensor(L, "blk.0.attn_k.weight")
    expect(tmp_path, _put(data, q.data_offset_at, "Q", other.data_offset), "offset", "overlaps")


def test_alignment_duplicates_and_encoding(base, tmp_path):
    data, L = base
    kvs, infos = kv_blobs(data, L), info_blobs(data, L)
    u32 = GGUFValueType.UINT32
    for value in (0, 3):
        f = rebuild(data, L, [encode_kv("general.alignment", u32, struct.pack("<I", value)), *kvs], infos)
        expect(tmp_path, f, "alignment", f"general.alignment {value} is not a power of two")
    f = rebuild(data, L, [encode_kv("general.alignment", GGUFValueType.UINT64, struct.pack("<Q", 32)), *kvs], infos)
    expect(tmp_path, f, "alignment", "expected 4 UINT32")
    f = rebuild(data, L, [encode_kv("general.alignment", u32, struct.pack("<I", 1 << 31)), *kvs], infos)
    expect(tmp_path, f, "truncated", "tensor data would start at byte 2147483648")
    f = rebuild(data, L, [*kvs, kvs[3]], infos)
    expect(tmp_path, f, "duplicate", "duplicate metadata key 'qwen3moe.context_length'")
    f = rebuild(data, L, kvs, [*infos, infos[0]])
    expect(tmp_path, f, "duplicate", "duplicate tensor 'token_embd.weight'")
    key = L.kvs[1]
    expect(tmp_path, _put(data, key.offset + 8, "B", 0xFF), "encoding", "metadata entry #1: key", "not valid UTF-8")


@pytest.mark.parametrize("section", ["header", "metadata", "tensor_info", "padding", "data"])
def test_truncation_in_every_section(base, tmp_path, section):
    data, L = base
    mid = {"header": 20, "metadata": L.kvs[5].offset + 3, "tensor_info": L.tensors[3].offset + 10,
           "padding": L.info_end + 1, "data": L.data_start + (L.size - L.data_start) // 2}[section]
    assert L.info_end < L.data_start  # the demo file has padding to cut into
    # a cut inside the metadata or tensor table is found as a length or count that no longer fits
    expect(tmp_path, data[:mid], {"truncated", "length", "count"}, "truncated")


def test_metadata_arrays_are_bounded_by_the_bytes_left_not_an_item_budget(base, tmp_path):
    """The item budget sized for GGUFReader is gone (issue 19): 70,000 items load; a count that
    cannot fit in the rest of the file is refused before anything walks it."""
    data, L = base
    many = encode_kv("x.many", GGUFValueType.ARRAY, struct.pack("<IQ", GGUFValueType.UINT8, 70_000) + bytes(70_000))
    f = rebuild(data, L, [*kv_blobs(data, L), many], info_blobs(data, L))
    p = tmp_path / "many.gguf"
    p.write_bytes(f)
    assert gguf_model.load(p).metadata["x.many"] is not None
    huge = encode_kv("x.huge", GGUFValueType.ARRAY, struct.pack("<IQ", GGUFValueType.STRING, 2**40))
    f = rebuild(data, L, [*kv_blobs(data, L), huge], info_blobs(data, L))
    expect(tmp_path, f, "count", "x.huge", "cannot fit")  # the count check's own message: refused before a walk


def _with_kv(data: bytes, L: GGUFLayout, key: str, vtype: int, payload: bytes) -> bytes:
    kvs = [encode_kv(key, vtype, payload) if kv.key == key else blob for kv, blob in zip(L.kvs, kv_blobs(data, L))]
    return rebuild(data, L, kvs, info_blobs(data, L))


def test_model_metadata_values_are_checked_before_use(base, tmp_path):
    """Values that the structure allows but the model cannot use (each escaped or hung before)."""
    data, L = base
    bc = _kv(L, "qwen3moe.block_count")
    shapes = []  # was: expected_shapes looping over 4 billion layers; now refused before it is called
    real_shapes = gguf_model.expected_shapes
    gguf_model.expected_shapes = lambda spec: shapes.append(spec) or real_shapes(spec)
    try:
        expect(tmp_path, _put(data, bc.value_offset, "I", 2**32 - 1), "metadata", "block_count 4294967295",
               "more layers than")
    finally:
        gguf_model.expected_shapes = real_shapes
    assert shapes == []
    rope = _kv(L, "qwen3moe.rope.freq_base")
    expect(tmp_path, _put(data, rope.value_offset, "f", math.nan), "metadata", "rope.freq_base", "finite number")
    f = _with_kv(data, L, "qwen3moe.block_count", GGUFValueType.FLOAT32, struct.pack("<f", math.nan))
    expect(tmp_path, f, "metadata", "qwen3moe.block_count is not an integer")  # was ValueError from int(nan)
    arr = struct.pack("<IQ", GGUFValueType.UINT32, 5_000) + bytes(4 * 5_000)
    f = _with_kv(data, L, "qwen3moe.block_count", GGUFValueType.ARRAY, arr)  # was a message of megabytes
    expect(tmp_path, f, "metadata", "qwen3moe.block_count is not a number: an array")
    f = _with_kv(data, L, "general.architecture", GGUFValueType.UINT32, struct.pack("<I", 7))
    expect(tmp_path, f, "metadata", "general.architecture is not a string")


def test_errors_from_gguf_itself_become_gguf_error(demo_path, monkeypatch):
    def broken_reader(*args, **kwargs):
        raise RuntimeError("unforeseen")

    monkeypatch.setattr(gguf_model, "_decode_value", broken_reader)
    with pytest.raises(GGUFError) as ei:
        gguf_model.load(demo_path)
    assert ei.value.kind == "reader" and "RuntimeError: unforeseen" in str(ei.value)
    monkeypatch.undo()

    model = gguf_model.load(demo_path)

    def broken_dequantize(*args, **kwargs):
        raise IndexError("bad blocks")

    monkeypatch.setattr(gguf_model.dequant, "dequantize", broken_dequantize)
    with pytest.raises(GGUFError) as ei:
        model.tensor("blk.0.ffn_up_exps.weight")
    assert ei.value.kind == "dequantise" and "blk.0.ffn_up_exps.weight" in str(ei.value)


def test_gguf_error_survives_pickling():
    import pickle

    e = pickle.loads(pickle.dumps(GGUFError("/x.gguf", "bad magic", "magic")))
    assert (str(e), e.kind, e.problem) == ("/x.gguf: bad magic", "magic", "bad magic")
