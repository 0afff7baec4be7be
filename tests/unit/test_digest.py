"""The content digest's definition (``_digest.py``): the reference over an in-memory tensor
against an independent reimplementation from docs/digest.md's words, and every way of
feeding pieces (random cuts, random order, threads, fragments from other holders) against
the reference. A missing or duplicated leaf is an error, never a guess."""

from __future__ import annotations

import json
import random
import threading

import blake3
import pytest
import torch

from metaseq_oneload import DigestError
from metaseq_oneload._digest import (
    LEAF,
    PREFIX,
    TensorHasher,
    digest_tensor,
    leaf_hashes,
    model_digest,
    parse_digest,
    tensor_bytes,
    tensor_digest,
)

MiB = 1 << 20


def _spec_tensor(name, t, part=None):
    """docs/digest.md's definition, written out again without _digest.py's helpers."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    h = {"name": name, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
         "nbytes": len(raw), "leaf": 1048576}
    if part is not None:
        h["part"] = part
    out = blake3.blake3(b"metaseq-oneload/tensor/v1\n")
    out.update(json.dumps(h, sort_keys=True, separators=(",", ":")).encode() + b"\n")
    for i in range(0, len(raw), 1 << 20):
        out.update(blake3.blake3(raw[i: i + (1 << 20)]).digest())
    return "blake3:" + out.hexdigest()


def _spec_model(digests):
    out = blake3.blake3(b"metaseq-oneload/model/v1\n")
    for name in sorted(digests):
        out.update(name.encode() + b"\0" + bytes.fromhex(digests[name][len("blake3:"):]))
    return "blake3:" + out.hexdigest()


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "f32.small": torch.randn(3, 5, generator=g),
        "f16.leaves": torch.randn(3 * MiB // 2 + 7, generator=g).half(),  # 3 MiB + 14 bytes
        "bf16.exact": torch.randn(2, MiB // 2, generator=g).bfloat16(),  # exactly 2 leaves
        "bool": torch.rand(MiB + 3, generator=g) > 0.5,
        "i64": torch.randint(-2**40, 2**40, (40000,), generator=g),
        "i8": torch.randint(-128, 127, (5, 7), generator=g, dtype=torch.int8),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
    }


def _cuts(n, k, rng):
    cuts = sorted(set(rng.sample(range(1, n), min(k, n - 1)))) if n > 1 else []
    return list(zip([0] + cuts, cuts + [n]))


def test_reference_equals_the_written_definition():
    ts = _tensors()
    for name, t in ts.items():
        assert digest_tensor(name, t) == _spec_tensor(name, t), name
        assert digest_tensor(name, t, part=1) == _spec_tensor(name, t, part=1), name
    digests = {n: digest_tensor(n, t) for n, t in ts.items()}
    assert model_digest(digests) == _spec_model(digests)
    assert model_digest(dict(reversed(list(digests.items())))) == model_digest(digests)
    d = digest_tensor("x", ts["f32.small"])
    assert d.startswith(PREFIX) and len(d) == len(PREFIX) + 64 and d == d.lower()


@pytest.mark.parametrize("seed", range(4))
def test_pieces_in_any_order_give_the_reference(seed):
    rng = random.Random(seed)
    for name, t in _tensors().items():
        data = tensor_bytes(t)
        h = TensorHasher(name, t.dtype, t.shape)
        pieces = _cuts(len(data), rng.choice([1, 3, 17]), rng)
        rng.shuffle(pieces)
        for a, b in pieces:
            h.update(a, data[a:b])
        assert h.digest() == digest_tensor(name, t), (name, pieces)


def test_holders_hash_apart_and_fragments_join_at_the_combiner():
    rng = random.Random(7)
    t = _tensors()["f16.leaves"]
    data = tensor_bytes(t)
    pieces = _cuts(len(data), 9, rng) + [(0, 0)]
    combiner = TensorHasher("w", "float16", t.shape)
    shipped = [leaf_hashes(a, data[a:b]) for a, b in pieces]  # what each holder sends
    rng.shuffle(shipped)
    for leaves, fragments in shipped:
        assert all(len(f) < LEAF for _, f in fragments) and len(fragments) <= 2
        combiner.add_leaves(leaves)
        for off, frag in fragments:
            combiner.add_fragment(off, frag)
    assert combiner.digest() == digest_tensor("w", t)


def test_an_in_order_stream_of_odd_pieces_holds_one_partial_leaf():
    t = torch.randn(5 * MiB // 4 + 13)  # 5 MiB + 52 bytes
    data = tensor_bytes(t)
    h = TensorHasher("w", t.dtype, t.shape)
    step = 3 * MiB // 7 + 5  # never a leaf boundary
    for a in range(0, len(data), step):
        h.update(a, data[a: a + step])
        assert sum(len(f) for fs in h._fragments.values() for _, f in fs) < LEAF
    assert h.digest() == digest_tensor("w", t)
    h.add_fragment(10, data[10:20])  # a leaf already joined, given again
    with pytest.raises(DigestError, match="leaves 0 given more than once"):
        h.digest()


def test_threads_feeding_one_hasher():
    t = torch.randn(5 * MiB // 4 * 3 + 11)  # 15 MiB + 44 bytes
    data = tensor_bytes(t)
    h = TensorHasher("w", t.dtype, t.shape)
    pieces = _cuts(len(data), 40, random.Random(3))
    threads = [threading.Thread(target=lambda p=pieces[i::4]: [h.update(a, data[a:b]) for a, b in p])
               for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert h.digest() == digest_tensor("w", t)


def test_a_missing_or_duplicated_leaf_is_an_error():
    t = torch.randn(3 * MiB // 4 + 100)  # 3 MiB + 400 bytes: 4 leaves
    data = tensor_bytes(t)
    h = TensorHasher("decoder.w", t.dtype, t.shape)
    h.update(0, data[: 2 * LEAF])
    with pytest.raises(DigestError, match=r"decoder\.w: .* need leaves 0-3; missing 2-3"):
        h.digest()
    h.update(2 * LEAF, data[2 * LEAF:])
    assert h.digest() == digest_tensor("decoder.w", t)
    h.update(LEAF, data[LEAF: 2 * LEAF])  # leaf 1 again
    with pytest.raises(DigestError, match=r"decoder\.w: leaves 1 given more than once"):
        h.digest()
    # a leaf given whole by one holder and in fragments by another
    h = TensorHasher("w", t.dtype, t.shape)
    h.update(0, data)
    h.add_fragment(10, data[10:20])
    with pytest.raises(DigestError, match="leaves 0 given more than once"):
        h.digest()
    # overlapping and missing fragment bytes
    h = TensorHasher("w", t.dtype, t.shape)
    h.update(LEAF, data[LEAF:])
    h.add_fragment(0, data[:600])
    h.add_fragment(500, data[500:LEAF])
    with pytest.raises(DigestError, match=r"leaf 0's fragments gives twice bytes \[500, 600\)"):
        h.digest()
    h = TensorHasher("w", t.dtype, t.shape)
    h.update(LEAF, data[LEAF:])
    h.add_fragment(0, data[:600])
    with pytest.raises(DigestError, match=r"leaf 0 is missing bytes \[600, 1048576\)"):
        h.digest()
    with pytest.raises(DigestError, match="crosses a leaf boundary"):
        h.add_fragment(LEAF - 4, data[LEAF - 4: LEAF + 4])
    with pytest.raises(DigestError, match=r"bytes \[3145720, 3146740\) fed to its digest"):
        h.update(3 * LEAF - 8, b"\0" * 1020)
    with pytest.raises(DigestError, match=r"missing 0-1, 3"):
        tensor_digest("w", "float32", t.shape, {2: b"\0" * 32})
    with pytest.raises(DigestError, match=r"unexpected 4"):
        tensor_digest("w", "float32", t.shape, {i: b"\0" * 32 for i in range(5)})


def test_a_flipped_bit_changes_that_tensor_and_the_model_only():
    ts = _tensors()
    before = {n: digest_tensor(n, t) for n, t in ts.items()}
    rng = random.Random(1)
    for name in ("f16.leaves", "bool", "i8", "scalar"):
        t = ts[name].clone()
        raw = t.reshape(-1).view(torch.uint8)
        i = rng.randrange(raw.numel())
        raw[i] ^= 1 << rng.randrange(8)
        after = dict(before, **{name: digest_tensor(name, t)})
        assert after[name] != before[name]
        assert model_digest(after) != model_digest(before)
        # the same flip, found by the hasher fed in pieces
        h = TensorHasher(name, t.dtype, t.shape)
        data = tensor_bytes(t)
        for a, b in _cuts(len(data), 5, rng):
            h.update(a, data[a:b])
        assert h.digest() == after[name]


def test_what_the_header_binds():
    t = torch.randn(4, 6).half()
    base = digest_tensor("w", t)
    assert digest_tensor("w", t.view(torch.bfloat16)) != base  # same bytes, other dtype
    assert digest_tensor("w", t.reshape(6, 4)) != base  # same bytes, other shape
    assert digest_tensor("v", t) != base  # other name
    assert digest_tensor("w", t, part=0) != base  # a stored tensor of a multi-part set
    assert digest_tensor("w", t.t()) == digest_tensor("w", t.t().contiguous())  # row-major
    assert digest_tensor("e", torch.zeros(0)) != digest_tensor("e", torch.zeros(0, 3))
    assert TensorHasher("e", "float32", (0, 3)).digest() == digest_tensor("e", torch.zeros(0, 3))
    assert tensor_digest("e", torch.float32, (0,), []) == digest_tensor("e", torch.zeros(0))
    assert TensorHasher("w", "half", (4, 6)).dtype == "float16"


def test_malformed_digests_and_names_are_refused():
    good = digest_tensor("w", torch.ones(2))
    assert parse_digest(good).hex() == good[len(PREFIX):]
    for bad in ("sha256:" + "0" * 64, PREFIX + "0" * 63, PREFIX + "g" * 64, 17):
        with pytest.raises(DigestError, match="expected 'blake3:' followed by 64 hex"):
            parse_digest(bad)
    with pytest.raises(DigestError, match="NUL character"):
        model_digest({"a\0b": good})
    with pytest.raises(DigestError, match="not a torch dtype"):
        TensorHasher("w", "float17", (2,))


def test_the_worked_example_in_the_docs_recomputes():
    """docs/digest.md's worked example, recomputed from the page's own numbers: with
    ``blake3`` alone (the definition) and with ``_digest`` (the package)."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "digest.md").read_text()
    block = re.search(r"### Worked example.*?```text\n(.*?)```", page, re.S).group(1)
    v = {m.group(1).strip(): m.group(2) for m in re.finditer(r"^(.{12}) (\S+)$", block, re.M)}
    assert len(v) == 10, v
    w = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.float16)
    assert bytes(tensor_bytes(w)).hex() == v["w bytes"]
    raw = bytes.fromhex(v["w bytes"])
    assert json.dumps({"name": "w", "dtype": "float16", "shape": [2, 3], "nbytes": 12, "leaf": 1048576},
                      sort_keys=True, separators=(",", ":")) == v["w H"]
    assert blake3.blake3(raw).hexdigest() == v["w leaf_0"]
    by_hand = blake3.blake3(b"metaseq-oneload/tensor/v1\n" + v["w H"].encode() + b"\n"
                            + bytes.fromhex(v["w leaf_0"])).hexdigest()
    assert "blake3:" + by_hand == v["w digest"] == digest_tensor("w", w)
    u = (torch.arange(LEAF + 3) % 251).to(torch.uint8)
    data = bytes(i % 251 for i in range(LEAF + 3))
    assert blake3.blake3(data[:LEAF]).hexdigest() == v["u leaf_0"]
    assert blake3.blake3(data[LEAF:]).hexdigest() == v["u leaf_1"]
    assert _spec_tensor("u", u) == v["u digest"] == digest_tensor("u", u)
    assert tensor_digest("u", "uint8", [LEAF + 3], [bytes.fromhex(v["u leaf_0"]), bytes.fromhex(v["u leaf_1"])]) \
        == v["u digest"]
    assert _spec_tensor("u", u, part=1) == v["u part 1"] == digest_tensor("u", u, part=1)
    assert _spec_model({"w": v["w digest"], "u": v["u digest"]}) == v["model {w, u}"] \
        == model_digest({"u": v["u digest"], "w": v["w digest"]})
    assert v["e [0, 4] f32"] == digest_tensor("e", torch.zeros(0, 4)) == _spec_tensor("e", torch.zeros(0, 4))
    # The page's reference implementation, run as written.
    code = re.search(r"```python\n(import json\nimport blake3\n.*?)```", page, re.S).group(1)
    ns: dict = {}
    exec(code, ns)
    assert ns["tensor_digest"]("w", "float16", [2, 3], raw) == v["w digest"]
    assert ns["tensor_digest"]("u", "uint8", [LEAF + 3], data, part=1) == v["u part 1"]
    assert ns["model_digest"]({"w": v["w digest"], "u": v["u digest"]}) == v["model {w, u}"]
