"""jaxinfer in one page: the README's API tour, run end to end and checked against jaxinfer.reference.

    python examples/quickstart.py [--hq 32 --hkv 8 --head-dim 128 --page-size 16]

Runs on CPU (Pallas interpret mode; tiny default shapes, well under a minute) or GPU (compiled
Pallas kernels). Each section below is one paragraph of the README's "API tour", in its order;
every output is compared with the pure-jnp reference and the script fails if one is off.
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer as ji
from jaxinfer import reference


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hq", type=int, default=4, help="query heads")
    ap.add_argument("--hkv", type=int, default=2, help="KV heads (query head h reads KV head h // (hq // hkv))")
    ap.add_argument("--head-dim", type=int, default=32, help="head dimension")
    ap.add_argument("--page-size", type=int, default=8, help="tokens per KV cache page")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    ap.add_argument("--quiet", action="store_true", help="print nothing (the checks still run)")
    args = ap.parse_args(argv)
    if args.hq % args.hkv:
        ap.error(f"--hq ({args.hq}) must be a multiple of --hkv ({args.hkv})")
    return args


def rel_err(out, want):
    out, want = np.asarray(out, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(out - want) / np.linalg.norm(want))


def table(kv_lens, page_size, pages):
    """A CSR page table over the page ids `pages` (taken in order): (indptr, indices, last)."""
    n = -(-np.asarray(kv_lens) // page_size)
    indptr = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    last = (np.asarray(kv_lens) - (n - 1) * page_size).astype(np.int32)
    return indptr, np.asarray(pages[: indptr[-1]], np.int32), last


def main(argv=None):
    """Runs the tour; returns {section: relative error against the reference}."""
    args = parse_args(argv)
    hq, hkv, d, page = args.hq, args.hkv, args.head_dim, args.page_size
    rng = np.random.default_rng(args.seed)

    def randn(*shape, dtype=jnp.bfloat16):
        return jnp.asarray(rng.standard_normal(shape).astype(dtype))  # cast on the host

    errors = {}

    # Paged cache, NHD = [num_pages, page_size, num_kv_heads, head_dim]; a CSR page table.
    num_pages, batch = 24, 3
    k_pages, v_pages = randn(num_pages, page, hkv, d), randn(num_pages, page, hkv, d)
    cache = ji.PagedKVCache(k_pages, v_pages, layout="NHD")
    kv_lens = np.array([2 * page + 3, 1, 3 * page])  # a partial, a one-token and a full last page
    kv_indptr, kv_indices, kv_last_page_len = table(kv_lens, page, rng.permutation(num_pages))

    # Batch decode: plan on the host, run jitted (compiles once for every plan of these capacities).
    dec = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, page, max_batch_size=batch, max_num_pages=num_pages)
    plan = dec.plan(kv_indptr, kv_indices, kv_last_page_len, num_pages=cache.num_pages)
    step = jax.jit(lambda q, cache, plan: dec.run(q, cache, plan))
    q = randn(batch, hq, d)  # [B, Hq, D]
    o = step(q, cache, plan)
    o, lse = dec.run(q, cache, plan, return_lse=True)  # an AttentionState
    want = reference.decode(q, cache, kv_indptr, kv_indices, kv_last_page_len)
    errors["decode"] = max(rel_err(o, want.o), rel_err(lse, want.lse))

    # Prefill / append: several query tokens per request, causal bottom-right.
    qo_indptr = np.array([0, 5, 6, 14], np.int32)
    q_ragged = randn(int(qo_indptr[-1]), hq, d)  # [nnz, Hq, D]
    want = reference.paged_attention(q_ragged, cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                     causal=True)
    pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, causal=True)
    plan = pre.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_pages=cache.num_pages)
    errors["paged prefill"] = rel_err(pre.run(q_ragged, cache, plan), want.o)
    pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, causal=True, impl="triton",
                                          config=ji.PrefillConfig(block_kv=64))
    plan = pre.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_pages=cache.num_pages)
    assert plan.impl == "prefill_triton", plan.impl  # plan.impl names the kernel that will run
    errors["paged prefill (config)"] = rel_err(pre.run(q_ragged, cache, plan), want.o)
    # One call for a serving step's mixed query lengths (short rows on the decode kernel).
    attn = ji.BatchAttention(hq, hkv, d, page)
    plan = attn.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_pages=cache.num_pages)
    errors["BatchAttention"] = rel_err(attn.run(q_ragged, cache, plan), want.o)
    # ... or planned on the device with the new K/V written (RPA v3's arguments): the same three
    # requests append 5, 1 and 8 tokens, kv_lens counting them; a 4th sequence slot is padding.
    r_lens = (kv_lens + np.diff(qo_indptr)).astype(np.int32)  # after the append
    r_indptr, r_indices, r_last = table(r_lens, page, rng.permutation(num_pages))
    page_indices = np.zeros((batch + 1, int(np.diff(r_indptr).max())), np.int32)  # [sequences, pages_per_seq]
    for b in range(batch):
        page_indices[b, :r_indptr[b + 1] - r_indptr[b]] = r_indices[r_indptr[b]:r_indptr[b + 1]]
    cu_q_lens = np.append(qo_indptr, qo_indptr[-1]).astype(np.int32)
    distribution = np.array([0, batch, batch], np.int32)  # no q_len-1 rows first; 3 valid sequences
    k_new, v_new = randn(int(qo_indptr[-1]), hkv, d), randn(int(qo_indptr[-1]), hkv, d)
    rpa = jax.jit(ji.ragged_paged_attention, donate_argnums=3)  # the cache written in place
    o, written = rpa(q_ragged, k_new, v_new, ji.PagedKVCache(k_pages + 0, v_pages + 0), np.append(r_lens, 0),
                     page_indices.reshape(-1), cu_q_lens, distribution)
    want = reference.paged_attention(q_ragged, written, qo_indptr, r_indptr, r_indices, r_last, causal=True)
    pos = np.concatenate([np.arange(kv - q, kv) for q, kv in zip(np.diff(qo_indptr), r_lens)])
    slots = page_indices[np.repeat(np.arange(batch), np.diff(qo_indptr)), pos // page], pos % page
    errors["ragged_paged_attention"] = max(rel_err(o, want.o), rel_err(written.k_pages[slots], k_new))
    # ... and over contiguous K/V per request (ragged).
    kv_tok_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    k_ragged, v_ragged = randn(int(kv_tok_indptr[-1]), hkv, d), randn(int(kv_tok_indptr[-1]), hkv, d)
    rag = ji.BatchPrefillWithRaggedKVCache(hq, hkv, d)
    o = rag.run(q_ragged, k_ragged, v_ragged, rag.plan(qo_indptr, kv_tok_indptr))
    want = reference.ragged_attention(q_ragged, k_ragged, v_ragged, qo_indptr, kv_tok_indptr, causal=True)
    errors["ragged prefill"] = rel_err(o, want.o)

    # Block-sparse attention: (R, C) = (4, 8) blocks of an M x N mask.
    m_rows, n_cols = 12, 32  # 3 row blocks, 4 column blocks
    bsr = ji.BlockSparseMatrix(np.array([0, 2, 3, 5], np.int32), np.array([0, 3, 1, 2, 3], np.int32), (4, 8),
                               (m_rows, n_cols))
    bsa = ji.BlockSparseAttention(hq, hkv, d)
    qb, kb, vb = randn(m_rows, hq, d), randn(n_cols, hkv, d), randn(n_cols, hkv, d)
    o = bsa.run(qb, kb, vb, bsa.plan(bsr))
    errors["block sparse"] = rel_err(o, reference.block_sparse_attention(qb, kb, vb, bsr).o)

    # Shared prefixes: requests 0-2 begin with the same 2 pages; request 3 shares nothing.
    shared, rest = [0, 1], list(rng.permutation(np.arange(2, num_pages)))
    lens4 = np.array([2 * page + min(5, page), 3 * page, 2 * page + 1, page + min(2, page)])
    lists = [shared + rest[0:1], shared + rest[1:2], shared + rest[2:3], rest[3:5]]
    c_indptr = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int32)
    c_indices = np.concatenate(lists).astype(np.int32)
    c_last = (lens4 - (np.diff(c_indptr) - 1) * page).astype(np.int32)
    q4 = randn(4, hq, d)
    dec4 = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, page)
    want = reference.decode(q4, cache, c_indptr, c_indices, c_last)
    o = dec4.run(q4, cache, dec4.plan(c_indptr, c_indices, c_last, num_pages=cache.num_pages, cascade="auto"))
    errors["decode, cascade='auto'"] = rel_err(o, want.o)
    one_each = np.arange(5, dtype=np.int32)  # qo_indptr: one query per request
    levels, saved_pages = ji.two_level_cascade(one_each, c_indptr, c_indices, c_last, page)
    assert saved_pages == 2 * len(shared), saved_pages  # requests 1 and 2 no longer read the prefix
    cas = ji.MultiLevelCascadeAttention(2, hq, hkv, d, page)
    errors["two-level cascade"] = rel_err(cas.run(q4, cache, cas.plan(levels, num_pages=cache.num_pages)), want.o)

    # Attention variants: static jnp functions traced into the kernel; their parameters are data.
    from jaxinfer import variants
    rope = [variants.rope()] if d >= 16 and d & (d - 1) == 0 else []  # RoPE rotates whole rows: a power of two
    var = variants.compose(*rope, variants.soft_cap(), variants.sliding_window())
    pre = ji.BatchPrefillWithPagedKVCache(hq, hkv, d, page, variant=var)
    params = {"rope_theta": 5e5, "rope_scale": 1.0, "logits_soft_cap": 30.0, "window_left": page + 3}
    plan = pre.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_pages=cache.num_pages)
    o = pre.run(q_ragged, cache, plan, variant_params=params)
    want = reference.paged_attention(q_ragged, cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                     causal=True, variant=var, params=params)
    errors[f"variants ({var.name})"] = rel_err(o, want.o)

    # fp8 KV cache with per-head [Hkv] scales.
    cache8 = ji.PagedKVCache(k_pages.astype(jnp.float8_e4m3fn), v_pages.astype(jnp.float8_e4m3fn))
    k_scale, v_scale = jnp.linspace(0.5, 1.0, hkv), jnp.linspace(2.0, 1.0, hkv)
    plan = dec.plan(kv_indptr, kv_indices, kv_last_page_len, num_pages=cache.num_pages)
    o = dec.run(q, cache8, plan, k_scale=k_scale, v_scale=v_scale)
    want = reference.decode(q, cache8, kv_indptr, kv_indices, kv_last_page_len, k_scale=k_scale, v_scale=v_scale)
    errors["fp8 decode"] = rel_err(o, want.o)

    # One plan for every layer of a stacked cache (L x P pages): layer l reads pages l * P + p.
    layers = 2
    stacked_cache = ji.PagedKVCache(jnp.concatenate([k_pages, v_pages]), jnp.concatenate([v_pages, k_pages]))
    o = dec.run(q, stacked_cache, plan.with_page_offset(1 * num_pages))  # layer 1: K and V swapped
    want = reference.decode(q, ji.PagedKVCache(v_pages, k_pages), kv_indptr, kv_indices, kv_last_page_len)
    errors[f"layer 1 of {layers} stacked"] = rel_err(o, want.o)

    # Append one new K/V row per request (jitted, the cache donated: written in place).
    append_indptr, nnz = np.arange(batch + 1, dtype=np.int32), batch
    seq_lens = (kv_lens + 1).astype(np.int32)  # lengths after the append
    spare = iter(np.setdiff1d(np.arange(num_pages), kv_indices))  # a request whose last page is full
    pages = [list(kv_indices[kv_indptr[b]:kv_indptr[b + 1]]) + ([next(spare)] if kv_lens[b] % page == 0 else [])
             for b in range(batch)]  # gets a new page (request 2; at page 1 every request)
    a_indptr, a_indices, _ = table(seq_lens, page, np.concatenate(pages))
    batch_idx, pos = ji.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    k_new, v_new = randn(nnz, hkv, d), randn(nnz, hkv, d)
    appended = jax.jit(ji.append_paged_kv_cache, donate_argnums=0)(
        ji.PagedKVCache(k_pages + 0, v_pages + 0), k_new, v_new, batch_idx, pos, a_indices, a_indptr)
    rows = [(int(a_indices[a_indptr[b] + p // page]), int(p % page)) for b, p in enumerate(np.asarray(pos))]
    got = jnp.stack([appended.k_pages[pg, s] for pg, s in rows])
    errors["append"] = rel_err(got, k_new)
    # Or, in a decode step, the decode kernel writes each request's new row at its last position.
    a_last = table(seq_lens, page, a_indices)[2]
    step_plan = dec.plan(a_indptr, a_indices, a_last, num_pages=num_pages)
    o, fused = dec.run(q, ji.PagedKVCache(k_pages + 0, v_pages + 0), step_plan, append_kv=(k_new, v_new))
    want = reference.decode(q, appended, a_indptr, a_indices, a_last)
    errors["decode with append_kv"] = max(rel_err(o, want.o), rel_err(fused.k_pages, appended.k_pages),
                                          rel_err(fused.v_pages, appended.v_pages))

    # Single requests, and the exact merge of two attention states (keys [:n] and [n:]).
    n = 10
    q1, k, v = randn(7, hq, d, dtype=jnp.float32), randn(29, hkv, d, dtype=jnp.float32), \
        randn(29, hkv, d, dtype=jnp.float32)
    a = ji.single_prefill_with_kv_cache(q1, k[:n], v[:n], causal=True, return_lse=True)
    b = ji.single_prefill_with_kv_cache(q1, k[n:], v[n:], return_lse=True)
    state = ji.merge_state(a, b)
    # Causal, bottom-right aligned on k[:n]: query i sees keys j <= i + n - 7 there, all of k[n:].
    mask = np.concatenate([np.tril(np.ones((7, n), bool), n - 7), np.ones((7, 29 - n), bool)], axis=1)
    ref = ji.reference.attention(q1, k, v, mask=mask)  # the pure-jnp semantics kernels are tested against
    errors["single prefill, merge_state"] = max(rel_err(state.o, ref.o), rel_err(state.lse, ref.lse))

    # Multi-head latent attention: every head over one latent cache (ckv + kpe), small widths here.
    heads, dc, dr = 4, 64, 16
    ckv, kpe = randn(num_pages, page, dc, dtype=jnp.float32), randn(num_pages, page, dr, dtype=jnp.float32)
    mla_qo = np.array([0, 1, 4, 5], np.int32)  # a decode row and a 4-token append
    mla_lens = np.array([1 + 2 * page, 3 * page, 5], np.int32)
    mla_indptr, mla_indices, _ = table(mla_lens, page, rng.permutation(num_pages))
    mla = ji.BatchMLAPagedAttention(heads, dc, dr, page, causal=True, sm_scale=0.2)
    q_nope, q_pe = randn(5, heads, dc, dtype=jnp.float32), randn(5, heads, dr, dtype=jnp.float32)
    o = mla.run(q_nope, q_pe, ckv, kpe, mla.plan(mla_qo, mla_indptr, mla_indices, mla_lens, num_pages=num_pages))
    want = reference.mla_reference(q_nope, q_pe, ckv, kpe, mla_qo, mla_indptr, mla_indices, mla_lens,
                                   causal=True, sm_scale=0.2)
    errors["MLA"] = rel_err(o, want.o)
    # The same step for engines, planned on the device from RPA v3's metadata: the step's latent
    # rows are written first (request r's at positions kv_lens[r] - q_len + j), then attended.
    page_indices = np.zeros((3, int(np.diff(mla_indptr).max())), np.int32)  # [S, pages_per_seq], flattened below
    for r in range(3):
        own = mla_indices[mla_indptr[r]:mla_indptr[r + 1]]
        page_indices[r, :own.shape[0]] = own
    new_ckv, new_kpe = randn(5, dc, dtype=jnp.float32), randn(5, dr, dtype=jnp.float32)
    o, ckv, kpe = ji.mla_ragged_paged_attention(
        q_nope, q_pe, new_ckv, new_kpe, ckv, kpe, jnp.asarray(mla_lens), jnp.asarray(page_indices.reshape(-1)),
        jnp.asarray(mla_qo), jnp.asarray([1, 1, 3], jnp.int32), sm_scale=0.2)  # distribution: 1 decode row first
    want = reference.mla_reference(q_nope, q_pe, ckv, kpe, mla_qo, mla_indptr, mla_indices, mla_lens,
                                   causal=True, sm_scale=0.2)
    errors["MLA, device-planned"] = rel_err(o, want.o)

    # Sampling without sorting: top-k then top-p over logits / temperature; every token drawn is
    # one the filters keep (here: among each row's 3 largest logits).
    logits = randn(4, 50, dtype=jnp.float32)
    tokens = ji.sampling.top_k_top_p_sampling_from_logits(logits, 3, 0.9, key=jax.random.PRNGKey(0),
                                                          temperature=0.7)
    top3 = np.argsort(-np.asarray(logits), axis=1)[:, :3]
    errors["sampling (drawn outside top 3)"] = float(np.mean([t not in r for t, r in zip(np.asarray(tokens), top3)]))

    # Several devices: heads split over a mesh axis (here a mesh of this one device; see
    # docs/sharding.md for more devices, context parallelism and both together).
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    o_tp = jax.jit(ji.sharding.head_parallel(dec, mesh))(q, cache, plan)
    errors["decode over a device mesh"] = rel_err(o_tp, dec.run(q, cache, plan))

    tol = 2e-2  # bf16 inputs (the float32 parts are ~1e-6)
    if not args.quiet:
        print(f"jaxinfer API tour on {jax.default_backend()} (Hq={hq}, Hkv={hkv}, D={d}, page={page}):")
        for name, err in errors.items():
            print(f"  {name:40s} relative error {err:.1e}")
    bad = {name: err for name, err in errors.items() if not err < tol}
    if bad:
        raise SystemExit(f"relative errors above {tol}: {bad}")
    return errors


if __name__ == "__main__":
    main()
