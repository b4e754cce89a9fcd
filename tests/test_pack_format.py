"""Pack spec and sidecar: layout arithmetic, identity keys, strict parsing of hostile sidecars."""

import json

import pytest

from tierstore.errors import PackFormatError
from tierstore.io.layout import PackSpec, RowSegment, round_up_to_page
from tierstore.io.sidecar import Sidecar, parse_sidecar


def make_spec(**overrides) -> PackSpec:
    fields = dict(tag="base", num_layers=3, num_experts=4, row_bytes=5000, checkpoint_id="ckpt-a",
                  abi_tag="w2-test", zero_mode="auto")
    return PackSpec(**{**fields, **overrides})


def test_stride_is_row_rounded_up_to_4096():
    assert round_up_to_page(1) == 4096
    assert round_up_to_page(4096) == 4096
    assert round_up_to_page(4097) == 8192
    spec = make_spec(row_bytes=(1 << 20) + 4096)
    assert spec.stride == (1 << 20) + 4096
    assert make_spec().stride == 8192


def test_row_offsets_are_layer_major_and_bounds_checked():
    spec = make_spec()
    assert spec.row_offset(0, 0) == 0
    assert spec.row_offset(1, 2) == (1 * 4 + 2) * 8192
    assert spec.file_bytes == 3 * 4 * 8192
    for layer, expert in ((3, 0), (0, 4), (-1, 0)):
        with pytest.raises(PackFormatError, match="outside"):
            spec.row_offset(layer, expert)


def test_any_spec_field_changes_the_key():
    base = make_spec()
    variants = [make_spec(tag="fp4"), make_spec(checkpoint_id="ckpt-b"), make_spec(abi_tag="w2-other"),
                make_spec(zero_mode="sign"), make_spec(row_bytes=5001), make_spec(rank=1, world=2),
                make_spec(segments=(RowSegment("w13", 0, 100, (10, 10)),))]
    keys = {base.key()} | {v.key() for v in variants}
    assert len(keys) == 1 + len(variants)
    assert base.file_stem() == f"base.v1.{base.key()}.rank0of1"


@pytest.mark.parametrize("bad", [
    dict(tag="../etc"), dict(tag="a/b"), dict(tag=""), dict(tag="Base"), dict(num_layers=0),
    dict(num_layers=True), dict(num_experts=10**9), dict(row_bytes=-5), dict(checkpoint_id=""),
    dict(checkpoint_id="a b"), dict(rank=2, world=2), dict(zero_mode="x/y"),
    dict(segments=(RowSegment("a", 0, 4000, (4000,)), RowSegment("b", 3999, 10, (10,)))),
    dict(segments=(RowSegment("a", 0, 5001, (5001,)),)),
])
def test_invalid_specs_are_refused(bad):
    with pytest.raises(PackFormatError):
        make_spec(**bad)


def test_sidecar_round_trip():
    spec = make_spec(segments=(RowSegment("w13", 0, 4000, (40, 100)), RowSegment("w2", 4096, 900, (900,))))
    sidecar = Sidecar(spec).with_layer(2, tuple(f"{i:016x}" for i in range(4)))
    parsed = parse_sidecar(sidecar.to_json())
    assert parsed == sidecar
    assert parsed.layers == frozenset({2})


def _valid_body() -> dict:
    return json.loads(Sidecar(make_spec()).with_layer(1, ("0" * 16,) * 4).to_json())


def _mutations():
    def put(path, value):
        def apply(body):
            target = body
            for part in path[:-1]:
                target = target[part]
            target[path[-1]] = value
            return body
        return apply
    return {
        "version string": put(["version"], "1"),
        "version bool": put(["version"], True),
        "huge layer count": put(["spec", "num_layers"], 10**30),
        "negative layer": lambda b: {**b, "layers": [-1], "checksums": {"-1": ["0" * 16] * 4}},
        "layer out of range": lambda b: {**b, "layers": [3], "checksums": {"3": ["0" * 16] * 4}},
        "duplicate layers": lambda b: {**b, "layers": [1, 1]},
        "layer as string": put(["layers"], ["1"]),
        "float layer": put(["layers"], [1.0]),
        "tag with separator": put(["spec", "tag"], "../../x"),
        "stride lie": put(["stride"], 4096),
        "file size lie": put(["file_bytes"], 1),
        "short checksum list": put(["checksums", "1"], ["0" * 16]),
        "non-hex checksum": put(["checksums", "1"], ["z" * 16] * 4),
        "checksum for unlisted layer": put(["checksums", "0"], ["0" * 16] * 4),
        "extra field": put(["evil"], 1),
        "spec not an object": put(["spec"], [1, 2]),
        "segments not a list": put(["spec", "segments"], {"a": 1}),
    }


@pytest.mark.parametrize("name", sorted(_mutations()))
def test_hostile_sidecars_raise_clear_errors(name):
    body = _mutations()[name](_valid_body())
    with pytest.raises(PackFormatError):
        parse_sidecar(json.dumps(body).encode())


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b"null", b"\xff\xfe", b"[" * 100000 + b"]" * 100000,
                                 b'{"version": 1' + b"1" * 5000 + b"}"])
def test_garbage_sidecars_raise_clear_errors(raw):
    with pytest.raises(PackFormatError):
        parse_sidecar(raw)
