"""ShadowKV's compiled step (`native.shadowkv_select`, `native.attend_rows`) against the torch references."""
import pytest
import torch

from kvpress.kernels import REDUCTIONS, SparseIndex, merge_states, native, reference_sparse_decode, torch_shadowkv_rebuild
from kvpress.policies._shadowkv_select import select_chunks

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernels not built here (no C compiler?)")


def inputs(B=2, H=2, G=3, D=32, C=24, cs=8, R=12, seed=0, rope_start=(0, 5)):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H * G, D, generator=gen)
    landmarks = torch.randn(B, H, C, D, generator=gen)
    selectable = torch.rand(B, H, C, generator=gen) > 0.25
    selectable[:, :, :2] = False  # e.g. the row-start chunk and outliers, kept exact elsewhere
    factor = torch.randn(B, C * cs, R, generator=gen)
    basis = torch.randn(B, R, H, D, generator=gen) / R ** 0.5
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    return q, landmarks, selectable, factor, basis, inv_freq, torch.tensor(rope_start, dtype=torch.long)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shortlist", [5, 12, 24])
def test_select_equals_the_torch_path(reduction, shortlist):
    q, lm, sel, factor, basis, inv_freq, rs = inputs(seed=len(reduction) + shortlist)
    allow = torch.tensor([[5, 3], [0, 5]], dtype=torch.int32)  # per (row, KV head); one takes nothing
    kw = dict(k=5, shortlist=shortlist, scale=0.3, reduction=reduction)
    ids, keys = native.shadowkv_select(q, lm, sel, factor, basis, inv_freq, rs, allow, chunk_size=8, **kw)
    ref_ids, ref_keys = select_chunks(q, lm, sel, factor, basis, inv_freq, rs, allow, chunk_size=8, backend="torch", **kw)
    assert torch.equal(ids, ref_ids)
    assert (ids[1, 0] == -1).all() and (keys[1, 0] == 0).all()
    torch.testing.assert_close(keys, ref_keys, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shortlist", [5, 12, 24])
def test_token_select_equals_the_torch_path(reduction, shortlist):
    """``tokens``: the shortlist (here also when it is just ``k`` chunks) re-scored, its best
    ``allow * chunk_size`` single tokens chosen -- ids ``chunk * cs + offset`` ascending."""
    q, lm, sel, factor, basis, inv_freq, rs = inputs(seed=3 * len(reduction) + shortlist)
    allow = torch.tensor([[5, 3], [0, 5]], dtype=torch.int32)
    kw = dict(k=5, shortlist=shortlist, scale=0.3, reduction=reduction)
    ids, keys = native.shadowkv_select(q, lm, sel, factor, basis, inv_freq, rs, allow, chunk_size=8, tokens=True, **kw)
    ref_ids, ref_keys = select_chunks(q, lm, sel, factor, basis, inv_freq, rs, allow, chunk_size=8, backend="torch",
                                      tokens=True, **kw)
    assert ids.shape == (2, 2, 40) and torch.equal(ids, ref_ids)
    assert (ids[0, 1, 24:] == -1).all() and (ids[0, 1, :24] >= 0).all()  # allow 3: 24 tokens
    assert (ids[1, 0] == -1).all() and (keys[1, 0] == 0).all()
    torch.testing.assert_close(keys, ref_keys, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("D, cs", [(64, 8), (128, 16), (48, 32)])  # register paths for 64 / 128, the generic one for 48
def test_rebuilt_keys_follow_the_fp32_rope_at_long_positions(D, cs):
    """RoPE angles come from double rotations corrected to the reference's fp32 products: at
    positions near 100k (angles up to 1e5 rad, where fp32 rounding moves them by ~4e-3) the keys
    still equal the reference's; row 1 starts inside the chunks, so its first chunks sit at
    negative positions (computed directly, outside the tables)."""
    q, lm, sel, factor, basis, inv_freq, rs = inputs(B=2, H=2, G=2, D=D, C=20, cs=cs, R=16, seed=3,
                                                     rope_start=(-100_000, 37))
    allow = torch.full((2, 2), 20, dtype=torch.int32)
    sel[:] = True
    ids, keys = native.shadowkv_select(q, lm, sel, factor, basis, inv_freq, rs, allow, k=20, shortlist=20,
                                       chunk_size=cs, scale=0.2, reduction="max")
    assert (ids == torch.arange(20, dtype=torch.int32)).all()
    ref = torch_shadowkv_rebuild(factor, basis, ids, inv_freq, rs, chunk_size=cs)
    torch.testing.assert_close(keys, ref, atol=2e-5, rtol=2e-5)


def test_select_takes_only_selectable_chunks_and_fewer_when_few_remain():
    q, lm, sel, factor, basis, inv_freq, rs = inputs(seed=7)
    sel[:] = False
    sel[0, 0, [4, 9, 17]] = True  # three chunks for (0, 0), none for the rest
    allow = torch.full((2, 2), 5, dtype=torch.int32)
    for shortlist in (5, 10):
        ids, keys = native.shadowkv_select(q, lm, sel, factor, basis, inv_freq, rs, allow, k=5, shortlist=shortlist,
                                           chunk_size=8, scale=0.3, reduction="softmax_max")
        assert ids[0, 0].tolist() == [4, 9, 17, -1, -1]
        assert (ids[0, 1] == -1).all() and (ids[1] == -1).all()
        assert (keys[0, 0, 24:] == 0).all() and keys[0, 0, :24].abs().sum() > 0


def _attend_reference(q, sets, scale):
    out = lse = None
    for k, v, cnt, n in sets:
        B, H = k.shape[:2]
        cnt = torch.full((B, H), n, dtype=torch.int32) if cnt is None else cnt.to(torch.int32)
        slots = torch.arange(n, dtype=torch.int32)
        index = SparseIndex(1, torch.where(slots < cnt[..., None], slots, -1), cnt,
                            torch.full((B,), k.shape[2], dtype=torch.int32))
        o, l = reference_sparse_decode(q, k, v, index, scale=scale)
        out, lse = (o, l) if out is None else merge_states(out, lse, o, l)
    return out, lse


def test_attend_rows_equals_sets_attended_apart_and_merged():
    gen = torch.Generator().manual_seed(5)
    B, H, G, D = 2, 3, 3, 32
    q = torch.randn(B, H * G, D, generator=gen)
    kv = lambda n: (torch.randn(B, H, n, D, generator=gen), torch.randn(B, H, n, D, generator=gen))  # noqa: E731
    (k1, v1), (k2, v2), (k3, v3) = kv(20), kv(9), kv(16)
    cnt2 = torch.tensor([[9, 0, 4], [1, 7, 9]], dtype=torch.int32)
    cnt3 = torch.tensor([[16, 8, 0], [0, 0, 3]], dtype=torch.int32)
    sets = [(k1, v1, None, 13), (k2, v2, cnt2, 9), (k3, v3, cnt3, 16)]  # the first: 13 of 20 rows in use
    out, lse = native.attend_rows(q, sets, scale=0.25)
    ref_out, ref_lse = _attend_reference(q, sets, 0.25)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    none, none_lse = native.attend_rows(q, [(k2, v2, torch.zeros(B, H, dtype=torch.int32), 9)], scale=0.25)
    assert (none == 0).all() and (none_lse == float("-inf")).all()


@pytest.mark.parametrize("call, match", [
    (lambda k, v, q: native.attend_rows(q, [(k, v[:, :, :5], None, 3)], scale=1.0), "one shape and strides"),
    (lambda k, v, q: native.attend_rows(q, [(k, v, None, 9)], scale=1.0), "n_cap >= n=9"),
    (lambda k, v, q: native.attend_rows(q, [(k, v, torch.zeros(2, 2, dtype=torch.int32), 3)], scale=1.0),
     r"cnt must have shape \(B, H_kv\) = \(1, 2\)"),
    (lambda k, v, q: native.attend_rows(q, [], scale=1.0), "1 to 8 row sets"),
    (lambda k, v, q: native.attend_rows(q.double(), [(k, v, None, 3)], scale=1.0), "fp32 CPU"),
])
def test_attend_rows_bad_input_is_a_clear_error(call, match):
    k, v, q = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match=match):
        call(k, v, q)


def test_select_bad_input_is_a_clear_error():
    q, lm, sel, factor, basis, inv_freq, rs = inputs()
    allow = torch.full((2, 2), 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        native.shadowkv_select(q, lm, sel[:, :1], factor, basis, inv_freq, rs, allow, k=3, shortlist=3,
                               chunk_size=8, scale=1.0, reduction="max")
    with pytest.raises(ValueError, match="reduction must be one of"):
        native.shadowkv_select(q, lm, sel, factor, basis, inv_freq, rs, allow, k=3, shortlist=3,
                               chunk_size=8, scale=1.0, reduction="sum")
    with pytest.raises(ValueError, match="fp32 CPU"):
        native.shadowkv_select(q, lm.double(), sel, factor, basis, inv_freq, rs, allow, k=3, shortlist=3,
                               chunk_size=8, scale=1.0, reduction="max")


def test_shadowkv_step_is_the_same_on_any_thread_count(torch_threads):
    q, lm, sel, factor, basis, inv_freq, rs = inputs(B=2, H=3, G=3, D=64, C=40, R=16, seed=11, rope_start=(0, 3))
    allow = torch.full((2, 3), 6, dtype=torch.int32)
    got = []
    for n in (1, 2):
        torch_threads(n)
        ids, keys = native.shadowkv_select(q, lm, sel, factor, basis, inv_freq, rs, allow, k=6, shortlist=30,
                                           chunk_size=8, scale=0.125, reduction="softmax_max")
        out, lse = native.attend_rows(q, [(keys, keys.flip(-1).contiguous(), (ids >= 0).sum(-1).int() * 8, 48)],
                                      scale=0.125)
        got.append((ids, keys, out, lse))
    assert all(torch.equal(a, b) for a, b in zip(*got))
