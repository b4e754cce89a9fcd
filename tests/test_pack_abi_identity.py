"""Issue 9 §1: the kernels' slot-layout ABI tag (kernels/layout.py ABI_TAG) enters the pack identity.
A pack built under another kernel ABI is never served: opening it is refused with the command that
builds the right one, building makes a new pack (every layer requantized, the old one untouched),
and a sidecar whose ABI tag differs under the current pack name is stale and rebuilt."""

import json

import pytest

from tierstore import slot_codec
from tierstore.checkpoint import open_checkpoint
from tierstore.checkpoint.synthetic import write_synthetic_checkpoint
from tierstore.errors import PackFormatError
from tierstore.io.pack import Pack, PackPaths
from tierstore.io.pack_build import pack_specs
from tierstore.kernels.layout import ABI_TAG
from tierstore.runtime.packs import ensure_base_pack, open_base_rows
from tierstore.slot_codec import KERNEL_SLOT_CODEC

NEXT_ABI = ABI_TAG + ",next-layout"  # what a change of the kernels' slot layout would publish


@pytest.fixture
def built(tmp_path):
    """(checkpoint, pack dir) with the base pack built under the current kernel ABI."""
    ckpt = write_synthetic_checkpoint(tmp_path / "ckpt", num_layers=2, num_experts=4, top_k=2, hidden=64,
                                      expert_inter=32, seed=6)
    assert ensure_base_pack(ckpt, tmp_path / "packs", device="cpu").written == {"base": [0, 1]}
    return ckpt, tmp_path / "packs"


def base_spec(ckpt):
    with open_checkpoint(ckpt) as c:
        return pack_specs(c, ("base",), "auto", codec=KERNEL_SLOT_CODEC)["base"]


def test_the_kernel_abi_tag_changes_the_codec_tag_and_the_pack_name(built, monkeypatch):
    """Another kernels ABI_TAG gives another codec ABI tag, spec key and pack file name."""
    ckpt, packs = built
    before = base_spec(ckpt)
    monkeypatch.setattr(slot_codec, "KERNEL_ABI_TAG", NEXT_ABI)
    after = base_spec(ckpt)
    assert after.abi_tag != before.abi_tag and after.abi_tag == KERNEL_SLOT_CODEC.abi_tag
    assert after.key() != before.key()
    assert PackPaths.for_spec(packs, after).pack != PackPaths.for_spec(packs, before).pack


def test_a_pack_of_another_kernel_abi_is_refused_then_rebuilt_beside_it(built, monkeypatch):
    """Under a new kernel ABI the existing pack is not opened (clear error with the build command),
    ensure_base_pack requantizes every layer into a new pack and leaves the old one byte for byte;
    back under the old ABI the old pack is reused without writing."""
    ckpt, packs = built
    old = Pack(packs, base_spec(ckpt)).path
    old_bytes = old.read_bytes()
    monkeypatch.setattr(slot_codec, "KERNEL_ABI_TAG", NEXT_ABI)
    with pytest.raises(PackFormatError, match="no valid base pack .* build it with: "):
        open_base_rows(ckpt, packs, direct=False)
    report = ensure_base_pack(ckpt, packs, device="cpu")
    assert report.written == {"base": [0, 1]} and report.skipped == {"base": []}
    rows = open_base_rows(ckpt, packs, direct=False)
    assert rows.pack.path != old and rows.pack.spec.abi_tag == KERNEL_SLOT_CODEC.abi_tag
    rows.close()
    assert old.read_bytes() == old_bytes
    monkeypatch.undo()
    assert ensure_base_pack(ckpt, packs, device="cpu").written == {"base": []}


def test_a_sidecar_with_another_abi_tag_under_the_current_name_is_stale(built, monkeypatch):
    """The current pack's sidecar rewritten to claim another kernel ABI: opening refuses it as stale,
    and ensure_base_pack rebuilds every layer, after which it opens with the current tag."""
    ckpt, packs = built
    spec = base_spec(ckpt)
    with monkeypatch.context() as patched:
        patched.setattr(slot_codec, "KERNEL_ABI_TAG", NEXT_ABI)
        other_tag = KERNEL_SLOT_CODEC.abi_tag
    sidecar = PackPaths.for_spec(packs, spec).sidecar
    body = json.loads(sidecar.read_bytes())
    body["spec"]["abi_tag"] = other_tag
    sidecar.write_text(json.dumps(body))
    with pytest.raises(PackFormatError, match=r"describes another configuration \(stale pack\)"):
        Pack(packs, spec)
    with pytest.raises(PackFormatError, match="stale pack"):
        open_base_rows(ckpt, packs, direct=False)
    assert ensure_base_pack(ckpt, packs, device="cpu").written == {"base": [0, 1]}
    rows = open_base_rows(ckpt, packs, direct=False)
    assert rows.pack.spec.abi_tag == spec.abi_tag != other_tag
    rows.close()
