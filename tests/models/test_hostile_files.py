"""Hostile checkpoints and configs (issue 31, item 2): files built to lie are refused with one line naming the
file and the field, nothing in them is executed, and nothing is allocated beyond the file's real bytes.

The safetensors cases are written byte by byte here (an 8-byte little-endian header length, the JSON header, the
data), so each lie is exactly the one named.  The loader's own header check (``_check_safetensors_header``) runs
before the safetensors reader; ``test_a_lying_header_allocates_nothing`` proves the reader is never reached and
that reading the header costs its own bytes only.  (The pickle, shard-path and profile cases that were already
tested live in test_draft.py and test_calibrate.py; this file adds what they lacked.)"""
import json
import struct
import tracemalloc

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from test_draft import V, flat_dict, flat_state, load_error, make_draft, write_checkpoint, write_json  # noqa: E402

from heterospec.models.draft import Eagle3Config, Eagle3Draft  # noqa: E402


def safetensors_bytes(header, data=b"", length=None):
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def one_line(msg):
    assert "\n" not in msg, msg
    return msg


@pytest.fixture
def ckpt(tmp_path):
    """A checkpoint directory with a valid config, whose model.safetensors each test replaces."""
    draft = make_draft("base")
    d = write_checkpoint(tmp_path / "ck", draft)
    return d


FC = "fc.weight"
CASES = {
    # the header's shape says 4096 x 4096 floats, its offsets 16 bytes
    "shape-lies": ({FC: {"dtype": "F32", "shape": [4096, 4096], "data_offsets": [0, 16]}}, bytes(16), None,
                   "tensor 'fc.weight': shape [4096, 4096] of F32 is 67108864 bytes, but data_offsets [0, 16] span 16"),
    # the offsets point a terabyte past the end of the file
    "offsets-past-the-end": ({FC: {"dtype": "F32", "shape": [2**38], "data_offsets": [0, 2**40]}}, bytes(16), None,
                             "tensor 'fc.weight': data_offsets [0, 1099511627776] do not lie inside the 16 data bytes"),
    "negative-offset": ({FC: {"dtype": "F32", "shape": [4], "data_offsets": [-16, 0]}}, bytes(16), None,
                        "tensor 'fc.weight': data_offsets [-16, 0] do not lie inside"),
    # a header length of 2**62 bytes in a file of a few dozen
    "absurd-header-size": ({FC: {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(16), 2**62,
                           "the header claims 4611686018427387904 bytes, but the file has"),
    "dtype-it-does-not-hold": ({FC: {"dtype": "Q7", "shape": [4], "data_offsets": [0, 16]}}, bytes(16), None,
                               "tensor 'fc.weight': dtype 'Q7' is not one heterospec reads"),
    "shape-not-ints": ({FC: {"dtype": "F32", "shape": [2.0, "2"], "data_offsets": [0, 16]}}, bytes(16), None,
                       "tensor 'fc.weight': shape [2.0, '2'] is not a list of non-negative ints"),
    "overlapping-tensors": ({FC: {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                             "norm.weight": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, bytes(24), None,
                            "tensors 'fc.weight' and 'norm.weight' overlap in the data"),
    "header-not-an-object": ([1, 2, 3], b"", None, "the header is a JSON list, not an object"),
    "entry-not-an-object": ({FC: "F32"}, b"", None, "tensor 'fc.weight': expected an object"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_lying_safetensors_file_is_rejected_naming_the_file_and_the_tensor(ckpt, case):
    header, data, length, expected = CASES[case]
    (ckpt / "model.safetensors").write_bytes(safetensors_bytes(header, data, length))
    msg = one_line(load_error(ckpt))
    assert f"cannot read the safetensors file {ckpt / 'model.safetensors'}: " in msg and expected in msg, msg


def test_a_truncated_file_says_how_short(ckpt):
    blob = (ckpt / "model.safetensors").read_bytes()
    for cut in (0, 5, 8 + 10, len(blob) - 1):
        (ckpt / "model.safetensors").write_bytes(blob[:cut])
        msg = one_line(load_error(ckpt))
        assert "model.safetensors" in msg and ("bytes" in msg), msg


def test_a_lying_header_allocates_nothing(ckpt, monkeypatch):
    """The header claims a 1 TB tensor: the safetensors reader is never called, and reading the header costs
    about its own size."""
    import safetensors.torch

    def reader_must_not_run(*a, **k):
        raise AssertionError("the safetensors reader ran on a file whose header lies")

    monkeypatch.setattr(safetensors.torch, "load_file", reader_must_not_run)
    header = {FC: {"dtype": "F32", "shape": [2**38], "data_offsets": [0, 2**40]}}
    (ckpt / "model.safetensors").write_bytes(safetensors_bytes(header, bytes(64)))
    tracemalloc.start()
    try:
        msg = load_error(ckpt)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "do not lie inside the 64 data bytes" in msg
    assert peak < 4 << 20, peak      # the meta-device module and the JSON header only (no 1 TB, no 16 bytes x 2**38)


def test_a_pickle_in_a_shard_is_not_run(tmp_path):
    """pytorch_model.bin.index.json naming a shard that runs code when unpickled: refused, the code not run."""

    class Payload:
        def __reduce__(self):
            return (open, (str(tmp_path / "shard-code-ran"), "w"))

    draft = make_draft("base")
    d = tmp_path / "ck"
    d.mkdir()
    write_json(d / "config.json", draft.config.to_dict())
    torch.save({**flat_state(draft), "x": Payload()}, d / "part-1.bin")
    write_json(d / "pytorch_model.bin.index.json", {"weight_map": {k: "part-1.bin" for k in flat_state(draft)}})
    msg = load_error(d)
    assert "part-1.bin" in msg and "weights_only=True" in msg
    assert not (tmp_path / "shard-code-ran").exists()


@pytest.mark.parametrize("field,value,expected", [
    ("hidden_size", "32", "'hidden_size' must be an integer, got '32'"),
    ("hidden_size", [32], "'hidden_size' must be an integer, got [32]"),
    ("hidden_size", True, "'hidden_size' must be an integer, got True"),
    ("hidden_size", 1e300, "'hidden_size' must be an integer below 2**31 in size"),
    ("intermediate_size", 2**70, "'intermediate_size' must be an integer below 2**31 in size"),
    ("rms_norm_eps", "x", "'rms_norm_eps' must be a number, got 'x'"),
    ("vocab_size", 2**31 - 1, "vocab_size must be at most 16777216"),
    ("vocab_size", None, "missing required key 'vocab_size'"),
])
def test_a_config_with_wrong_types_or_fields_names_the_file_and_the_field(tmp_path, field, value, expected):
    draft = make_draft("base")
    cfg = flat_dict(**{field: value})
    d = write_checkpoint(tmp_path / "ck", draft, config=cfg)
    msg = one_line(load_error(d))
    assert msg.startswith(f"{d / 'config.json'}: invalid EAGLE-3 config: ") and expected in msg, msg


def test_a_config_that_is_not_an_object(tmp_path):
    d = write_checkpoint(tmp_path / "ck", make_draft("base"))
    (d / "config.json").write_text("[1, 2]")
    msg = one_line(load_error(d))
    assert "config.json" in msg


def test_a_vocabulary_map_pointing_outside_the_vocabulary(tmp_path):
    draft = make_draft("base")
    for bad, what in ((-10**6, "negative"), (10**6, "past the end")):
        sd = flat_state(draft)
        sd["d2t"] = sd["d2t"].clone()
        sd["d2t"][0] = bad
        d = write_checkpoint(tmp_path / what, draft, sd)
        msg = one_line(load_error(d))
        assert f"d2t maps 1 draft ids outside the target vocabulary [0, {V})" in msg and str(d) in msg, (what, msg)


def test_the_huge_config_is_rejected_before_any_module_is_built(tmp_path, monkeypatch):
    """A config asking for a 2**20-wide draft (terabytes of weights) with a small file: refused from the shapes,
    no module allocated."""
    draft = make_draft("base")
    cfg = flat_dict(hidden_size=2**20, num_attention_heads=2**10, num_key_value_heads=2**10, head_dim=1024)
    d = write_checkpoint(tmp_path / "ck", draft, config=cfg)
    monkeypatch.setattr(Eagle3Draft, "_empty", classmethod(lambda *a: pytest.fail("a module was allocated")))
    msg = load_error(d)
    assert "wrong shape for" in msg
    assert Eagle3Config.from_dict(cfg).hidden_size == 2**20   # a legal config: the weights refuse it
    # sizes whose weights torch cannot even describe: the config is refused, one line
    cfg = flat_dict(hidden_size=2**30, intermediate_size=2**31 - 1, num_attention_heads=2**20,
                    num_key_value_heads=2**20, head_dim=2**20)
    d = write_checkpoint(tmp_path / "ck2", draft, config=cfg)
    msg = one_line(load_error(d))
    assert msg.startswith(f"{d / 'config.json'}: invalid EAGLE-3 config: its sizes make a weight larger"), msg
