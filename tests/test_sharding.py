"""jaxinfer.sharding: TP, CP and TP x CP on forced host devices equal one device (o and lse).

jax is already initialised in the pytest worker with one CPU device, so the multi-device checks
run this file as a script in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count
(and the LLVM opt level of tests/conftest.py); the two-process test starts two such scripts under
jax.distributed on localhost. Tolerances: float32, o relative error <= 2e-5 and lse within 1e-4.
"""
import functools
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import TEST_XLA_FLAGS

import jaxinfer as ji
from jaxinfer import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 300
_START = time.perf_counter()


def _script(args, devices=8, timeout=TIMEOUT_S, extra_env=None):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = " ".join((f"--xla_force_host_platform_device_count={devices}",) + TEST_XLA_FLAGS)
    env.update(extra_env or {})
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _check_script(args, devices=8, timeout=TIMEOUT_S):
    proc = _script(args, devices)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-6000:]
    assert "OK" in out, out[-6000:]


# ---------------------------------------------------------------------------------------------
# In-process host checks (no devices needed)


def test_split_heads():
    assert sharding.split_heads(64, 8, 4) == sharding.HeadSplit(num_qo_heads=16, num_kv_heads=2, kv_replicas=1)
    assert sharding.split_heads(64, 8, 8) == sharding.HeadSplit(num_qo_heads=8, num_kv_heads=1, kv_replicas=1)
    assert sharding.split_heads(8, 2, 8) == sharding.HeadSplit(num_qo_heads=1, num_kv_heads=1, kv_replicas=4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        sharding.split_heads(12, 3, 2)  # 3 KV heads on 2 devices: neither way
    with pytest.raises(ValueError, match="num_qo_heads"):
        sharding.split_heads(4, 2, 8)  # 2 query heads per KV head over 4 replicas
    with pytest.raises(ValueError, match="devices"):
        sharding.split_heads(8, 2, 0)


def test_split_page_table_covers_every_page_once():
    rng = np.random.default_rng(0)
    page = 4
    kv_lens = np.array([0, 1, 4, 5, 37, 130], np.int32)
    indptr, indices, last, num_pages = _table(rng, kv_lens, page)
    qo_indptr = np.concatenate([[0], np.cumsum(np.minimum(kv_lens, [0, 1, 3, 5, 9, 130]))]).astype(np.int32)
    for causal in (False, True):
        split = sharding.split_page_table(indptr, indices, last, page, 4, qo_indptr=qo_indptr, causal=causal)
        for r, n in enumerate(kv_lens):  # the shares tile [0, kv_len) in device order
            ends = split.key_offsets[:, r] + split.share_lens[:, r]
            assert split.share_lens[:, r].sum() == n
            live = split.share_lens[:, r] > 0
            np.testing.assert_array_equal(split.key_offsets[1:, r][live[1:]], ends[:-1][live[1:]])
            pages = np.concatenate([t[1][t[0][r]:t[0][r + 1]] for t in split.tables])
            np.testing.assert_array_equal(pages, indices[indptr[r]:indptr[r + 1]])
    # Causal balance: the 130-key prompt's first share is the shortest.
    assert split.share_lens[0, -1] < split.share_lens[-1, -1]
    # Page-sharded caches: pages must lie in each device's block, in device order.
    with pytest.raises(ValueError, match="device by device"):
        sharding.split_page_table(np.array([0, 2], np.int32), np.array([9, 1], np.int32),
                                  np.array([4], np.int32), page, 2, pages_per_shard=8)
    with pytest.raises(ValueError, match="num_shards"):
        sharding.split_page_table(indptr, indices, last, page, 0)


def test_split_queries_covers_every_row_once():
    """split_queries: every query row lands on exactly one device, once, in runs of its request
    whose sub-request sees the keys its rows see (causal: up to the run's last row); device
    (k + r) mod n takes request r's runs k and 2 n - 1 - k (equal causal work for a whole
    prompt; one-row requests spread over the devices); lent pages renumbered
    in the gathered cache. One shape across steps under gather_capacity, num_rows and the
    wrapper's capacities. Bad arguments are ValueErrors naming them."""
    import jax
    rng = np.random.default_rng(0)
    page, n, per = 4, 3, 40
    kv_lens = np.array([0, 1, 6, 45, 70], np.int32)
    qo_lens = np.array([0, 1, 3, 17, 70], np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    table = _sharded_table(rng, kv_lens, page, n, per)
    for causal in (True, False):
        split = sharding.split_queries(qo_indptr, *table, page, n, causal=causal, pages_per_shard=per, num_rows=100)
        rows = np.concatenate(split.rows)
        np.testing.assert_array_equal(np.sort(rows), np.arange(qo_indptr[-1]))
        for (sub_qo, sub_kv, sub_idx, sub_last), mine in zip(split.tables, split.rows):
            seen = (np.diff(sub_kv) - 1) * page + sub_last
            starts = mine[sub_qo[:-1]]
            request = np.searchsorted(qo_indptr, starts, side="right") - 1
            ends = starts + np.diff(sub_qo) - qo_indptr[request]  # run's end within its request
            want = kv_lens[request] - qo_lens[request] + ends if causal else kv_lens[request]
            np.testing.assert_array_equal(seen, want)
            for s in range(sub_qo.shape[0] - 1):  # the request's pages, as gathered
                got = sub_idx[sub_kv[s]:sub_kv[s + 1]]
                listed = table[1][table[0][request[s]]:table[0][request[s]] + got.shape[0]]
                lent = split.gather.reshape(-1)[got] + (got // split.gather.shape[1]) * per
                np.testing.assert_array_equal(lent, listed)
    # The 70-row prompt (request 4): runs of 12, 11, 12, 12, 11 and 12 rows, device (k + 4) mod 3
    # with runs k and 5 - k; the one-row request 1 on device (2 + 1) mod 3 = 0 (its row in run 2).
    rows_of = lambda r: [int(np.sum((x >= qo_indptr[r]) & (x < qo_indptr[r + 1]))) for x in split.rows]
    assert rows_of(4) == [24, 24, 22] and rows_of(1) == [1, 0, 0]
    # Only pages a run reads are lent: request 0 has no queries, so its 3 pages stay home.
    t2 = _sharded_table(rng, [9, 20], page, n, per)
    lone = sharding.split_queries(np.array([0, 0, 2], np.int32), *t2, page, n, pages_per_shard=per)
    read = np.sort(t2[1][3:])  # request 1's pages
    for k, g in enumerate(lone.gather):  # device k lends its own of them, then padding (local page 0)
        mine = read[read // per == k] % per
        np.testing.assert_array_equal(g, np.pad(mine, (0, g.shape[0] - mine.shape[0])))
    pre = ji.BatchPrefillWithPagedKVCache(4, 2, 32, page, causal=True, num_ctas=8, max_batch_size=10,
                                          max_num_tokens=40, max_num_pages=60)

    def signature(kv, qo):
        t = _sharded_table(rng, kv, page, n, per)
        qi = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
        sp = sharding.split_queries(qi, *t, page, n, pages_per_shard=per, num_rows=100, gather_capacity=30)
        leaves, tree = jax.tree.flatten(sharding.context_plan(pre, sp, num_pages=n * per))
        return tree, [np.shape(x) for x in leaves]
    assert signature([37], [37]) == signature([9, 30, 3], [2, 30, 1])
    with pytest.raises(ValueError, match="gather_capacity"):
        sharding.split_queries(qo_indptr, *table, page, n, pages_per_shard=per, gather_capacity=2)
    with pytest.raises(ValueError, match="num_rows"):
        sharding.split_queries(qo_indptr, *table, page, n, num_rows=10)
    with pytest.raises(ValueError, match="qo_indptr"):
        sharding.split_queries(np.array([0, 0, 2, 3, 17, 70], np.int32), *table, page, n)
    with pytest.raises(ValueError, match="num_shards"):
        sharding.split_queries(qo_indptr, *table, page, 0)
    with pytest.raises(ValueError, match="max_num_tokens"):
        sharding.context_plan(pre, sharding.split_queries(qo_indptr, *table, page, 2), num_pages=n * per)
    with pytest.raises(ValueError, match="num_pages"):
        sharding.context_plan(pre, sharding.split_queries(qo_indptr[:3], *_sharded_table(rng, [0, 1], page, n, per),
                                                          page, n, pages_per_shard=per), num_pages=per)
    dec = ji.BatchDecodeWithPagedKVCache(4, 2, 32, page, max_batch_size=4, max_num_pages=48)
    with pytest.raises(ValueError, match="decode"):
        sharding.context_plan(dec, split, num_pages=n * per)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("cp",))
    one = sharding.split_queries(qo_indptr[:3], *_sharded_table(rng, [0, 1], page, 1, per), page, 1,
                                 pages_per_shard=per)
    with pytest.raises(ValueError, match="ContextPlan"):
        sharding.context_partial_states(pre, mesh)(None, None, sharding.context_plan(pre, one, num_pages=per))
    small = ji.PagedKVCache(*(np.zeros((per - 1, page, 2, 32), np.float32),) * 2)  # not the split's pages
    one_plan = sharding.context_plan(pre, one, num_pages=per)
    with pytest.raises(ValueError, match="kv_cache"):
        sharding.context_parallel(pre, mesh)(np.zeros((1, 4, 32), np.float32), small, one_plan)
    whole = ji.PagedKVCache(*(np.zeros((per, page, 2, 32), np.float32),) * 2)
    with pytest.raises(ValueError, match="num_rows"):  # q of 5 rows, the split's num_rows 1
        sharding.context_parallel(pre, mesh)(np.zeros((5, 4, 32), np.float32), whole, one_plan)


def test_context_plan_mla_splits():
    """BatchMLAPagedAttention under CP: a decode split runs q in place (one sub-request a
    request); causal multi-token rows gather each device's rows (the rows before its share's end
    as one sub-request, each later row alone) and place their states; a query split and a wrapper
    without capacities are ValueErrors."""
    import jax
    import jax.numpy as jnp
    rng = np.random.default_rng(5)
    page, per, n = 4, 20, 2
    kv = np.array([3, 30], np.int32)
    table = _sharded_table(rng, kv, page, n, per)  # request 1: 8 pages, 4 a device
    mla = ji.BatchMLAPagedAttention(4, 64, 16, page, causal=True, sm_scale=0.3, max_batch_size=5,
                                    max_num_tokens=5, max_num_pages=3 * int(table[0][-1]))
    split = sharding.split_page_table(*table, page, n, pages_per_shard=per)
    plan = sharding.context_plan(mla, split, num_pages=n * per, q_data_type=jnp.float32)
    assert plan.full_rows is None and all(np.shape(x)[0] == n for x in jax.tree.leaves(plan.full))
    np.testing.assert_array_equal(plan.share_lens.sum(0), kv)
    # Request 0 (3 keys, on device 1 only) has rows 0-1 at positions 1-2; request 1 rows 2-4 at
    # positions 27-29, past device 0's share [0, 16) and inside device 1's [16, 30). Device 0 runs
    # request 1's rows as three one-row sub-requests (they see its share whole) and has none of
    # request 0's: its rows are gathered, and rows 0-1 take the empty state (row 5). Device 1
    # runs each request's rows as one causal sub-request, in order.
    mtp = sharding.split_page_table(*table, page, n, qo_indptr=np.array([0, 2, 5], np.int32), pages_per_shard=per)
    plan = sharding.context_plan(mla, mtp, num_pages=n * per, q_data_type=jnp.float32)
    np.testing.assert_array_equal(plan.full_rows[:, :3], [[2, 3, 4], [0, 1, 2]])
    np.testing.assert_array_equal(plan.src, [[5, 5, 0, 1, 2], [0, 1, 2, 3, 4]])
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("cp",))
    with pytest.raises(ValueError, match="q_nope"):  # 4 rows where the plan places 5
        sharding.context_parallel(mla, mesh)(np.zeros((4, 4, 64)), np.zeros((4, 4, 16)), None, None, plan)
    rows = sharding.split_queries(np.array([0, 1, 2], np.int32), *table, page, n, pages_per_shard=per)
    with pytest.raises(ValueError, match="split_page_table"):
        sharding.context_plan(mla, rows, num_pages=n * per)
    unbounded = ji.BatchMLAPagedAttention(4, 64, 16, page, sm_scale=0.3)
    with pytest.raises(ValueError, match="max_batch_size"):
        sharding.context_plan(unbounded, split, num_pages=n * per, q_data_type=jnp.float32)


def test_split_cascade_levels():
    """split_cascade_levels splits each level's pages as split_page_table does; context_plan pairs
    a MultiLevelCascadeAttention with a CascadeSplit only, the wrapper's level count, and (causal)
    one row per last-level group."""
    page, per, n = 4, 10, 2
    levels = [ji.CascadeLevel(np.array([0, 2], np.int32), np.array([0, 2], np.int32), np.array([0, 10], np.int32),
                              np.array([4], np.int32)),
              ji.CascadeLevel(np.array([0, 1, 2], np.int32), np.array([0, 1, 2], np.int32),
                              np.array([11, 12], np.int32), np.array([3, 1], np.int32))]
    split = sharding.split_cascade_levels(levels, page, n, pages_per_shard=per)
    assert [s.share_lens.sum(0).tolist() for s in split.splits] == [[8], [3, 1]]
    cas = ji.MultiLevelCascadeAttention(2, 4, 2, 32, page, causal=True, max_batch_size=2, max_num_tokens=2,
                                        max_num_pages=4)
    plan = sharding.context_plan(cas, split, num_pages=n * per)
    assert plan.diag is None and len(plan.full.levels) == 2
    with pytest.raises(ValueError, match="CascadeSplit"):
        sharding.context_plan(cas, split.splits[0], num_pages=n * per)
    with pytest.raises(ValueError, match="levels"):
        sharding.context_plan(ji.MultiLevelCascadeAttention(3, 4, 2, 32, page), split, num_pages=n * per)
    two_rows = [levels[0], ji.CascadeLevel(np.array([0, 2], np.int32), np.array([0, 1], np.int32),
                                           np.array([11], np.int32), np.array([3], np.int32))]
    with pytest.raises(ValueError, match="one query row"):
        sharding.context_plan(cas, sharding.split_cascade_levels(two_rows, page, n, pages_per_shard=per),
                              num_pages=n * per)


def test_head_parallel_takes_every_paged_wrapper():
    """head_parallel and context_parallel take the cascade and MLA wrappers too; anything else is
    a ValueError, as is an append_kv that is not a decode wrapper's (k, v) pair."""
    import jax
    devices = np.asarray(jax.devices()[:1])
    cascade = ji.MultiLevelCascadeAttention(2, 4, 2, 32, 4)
    sharding.head_parallel(cascade, jax.sharding.Mesh(devices, ("tp",)))
    sharding.head_parallel(ji.BatchMLAPagedAttention(4, 64, 16, 4, sm_scale=0.3), jax.sharding.Mesh(devices, ("tp",)))
    with pytest.raises(ValueError, match="tp_axis"):
        sharding.head_parallel_mla_ragged(jax.sharding.Mesh(devices, ("x",)), sm_scale=0.3)
    sharding.context_parallel(cascade, jax.sharding.Mesh(devices, ("cp",)))
    for parallel, axis in ((sharding.head_parallel, "tp"), (sharding.context_parallel, "cp")):
        with pytest.raises(ValueError, match="wrapper must be"):
            parallel(object(), jax.sharding.Mesh(devices, (axis,)))
    # append_kv: a decode wrapper's, as a (k, v) pair (a fused q's heads would split unevenly).
    tp_mesh = jax.sharding.Mesh(devices, ("tp",))
    dec = sharding.head_parallel(ji.BatchDecodeWithPagedKVCache(4, 2, 32, 4), tp_mesh)
    pre = sharding.head_parallel(ji.BatchPrefillWithPagedKVCache(4, 2, 32, 4), tp_mesh)
    for run, bad in ((dec, "from_q"), (dec, (None,)), (pre, (None, None))):
        with pytest.raises(ValueError, match="append_kv"):
            run(None, None, None, append_kv=bad)


def test_context_parallel_merge_option():
    """merge_choice gathers states of at most 4 MiB and any state on 2 devices, else merges by
    all-to-all; a merge other than auto / psum / all_gather / all_to_all is a ValueError naming
    merge."""
    import jax
    import jax.numpy as jnp
    assert [sharding.merge_choice(n, jnp.bfloat16) for n in (1, 2, 3, 4, 8)] == [
        "all_gather", "all_gather", "all_to_all", "all_to_all", "all_to_all"]
    assert [sharding.merge_choice(n, jnp.float32) for n in (1, 2, 4)] == ["all_gather", "all_gather", "all_to_all"]
    small, large = sharding.SMALL_STATE_BYTES, sharding.SMALL_STATE_BYTES + 1  # small states: latency-bound
    assert [sharding.merge_choice(8, jnp.float32, b) for b in (small, large)] == ["all_gather", "all_to_all"]
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("cp",))
    dec = ji.BatchDecodeWithPagedKVCache(4, 2, 32, 4, max_batch_size=2, max_num_pages=4)
    for merge in sharding.MERGES:
        sharding.context_parallel(dec, mesh, merge=merge)
    with pytest.raises(ValueError, match="merge"):
        sharding.context_parallel(dec, mesh, merge="allgather")


def test_context_parallel_ragged_rejects_bad_arguments():
    """context_parallel_ragged: a merge, an axis, a cache or sinks it cannot take is a ValueError
    naming it (pages out of device order: the subprocess check); head_parallel_ragged: sinks."""
    import jax
    import jax.numpy as jnp
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("cp",))
    with pytest.raises(ValueError, match="merge"):
        sharding.context_parallel_ragged(mesh, merge="allgather")
    for axes in ({"cp_axis": "seq"}, {"tp_axis": "tp"}):
        with pytest.raises(ValueError, match=next(iter(axes))):
            sharding.context_parallel_ragged(mesh, **axes)
    run = sharding.context_parallel_ragged(mesh)
    q, kv = jnp.zeros((2, 4, 32)), jnp.zeros((2, 2, 32))
    meta = (jnp.array([1, 1], jnp.int32), jnp.zeros(2, jnp.int32), jnp.array([0, 1, 2], jnp.int32),
            jnp.array([2, 2, 2], jnp.int32))
    with pytest.raises(ValueError, match="kv_cache"):
        run(q, kv, kv, jnp.zeros((4, 4, 2, 32)), *meta)
    cache = ji.PagedKVCache(jnp.zeros((4, 4, 2, 32)), jnp.zeros((4, 4, 2, 32)))
    with pytest.raises(ValueError, match="page_indices"):
        run(q, kv, kv, cache, meta[0], jnp.array([0, 4], jnp.int32), *meta[2:])
    tp_run = sharding.head_parallel_ragged(jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("tp",)))
    for bad in (jnp.zeros(3), jnp.zeros(4, jnp.int32)):  # [Hq] floats only
        for attend in (run, tp_run):
            with pytest.raises(ValueError, match="sinks"):
                attend(q, kv, kv, cache, *meta, sinks=bad)


def test_context_plan_fixed_shapes_one_structure():
    """context_plan(fixed_shapes=True) under the wrapper's capacities: one pytree structure and one
    set of shapes for a one-prompt step (which without it takes base "diag" and no full launch)
    and a step of three requests, prefill and decode (key_offsets and share_lens padded to
    max_batch_size); past max_batch_size, or with no max_batch_size, a ValueError."""
    import jax
    rng = np.random.default_rng(4)
    devices, per, page = 2, 40, 4
    pre = ji.BatchPrefillWithPagedKVCache(4, 2, 32, page, causal=True, num_ctas=8, max_batch_size=4,
                                          max_num_tokens=64, max_num_pages=48)
    dec = ji.BatchDecodeWithPagedKVCache(4, 2, 32, page, num_ctas=8, max_batch_size=4, max_num_pages=48)

    def plans(wrapper, kv_lens, qo_lens, fixed):
        table = _sharded_table(rng, kv_lens, page, devices, per)
        qo = None if qo_lens is None else np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
        split = sharding.split_page_table(*table, page, devices, qo_indptr=qo, causal=qo is not None,
                                          pages_per_shard=per)
        return sharding.context_plan(wrapper, split, num_pages=devices * per, fixed_shapes=fixed)

    def signature(plan):
        leaves, tree = jax.tree.flatten(plan)
        return tree, [np.shape(x) for x in leaves]

    for wrapper, steps in ((pre, (([37], [37]), ([9, 30, 3], [2, 30, 1]))),
                           (dec, (([37], None), ([9, 30, 3], None)))):
        fixed = [plans(wrapper, kv, qo, True) for kv, qo in steps]
        assert signature(fixed[0]) == signature(fixed[1])
        assert fixed[0].key_offsets.shape == (devices, 4) and fixed[0].base is None
        assert signature(plans(wrapper, *steps[0], False)) != signature(plans(wrapper, *steps[1], False))
        with pytest.raises(ValueError, match="max_batch_size"):
            plans(wrapper, [5] * 5, None if wrapper is dec else [1] * 5, True)
    unbounded = ji.BatchDecodeWithPagedKVCache(4, 2, 32, page, num_ctas=8)
    with pytest.raises(ValueError, match="max_batch_size"):
        plans(unbounded, [5], None, True)


# ---------------------------------------------------------------------------------------------
# Multi-device checks (subprocesses)


def test_sharded_equals_one_device():
    """In one subprocess with 8 host devices, each check against one device (float32 o and lse):
    a decode case (HND, page-sharded on 4 devices, empty shares) under one horizon plan: TP 4
    (head_parallel, KV heads replicated 2x), CP 4 in a lax.scan (traced kv_lens, merge auto: the
    all-gather), TP x CP on (2, 4) (context_partial_states merged by psum, all-gather and
    all-to-all); one prompt per step (and an empty request) on BatchAttention at CP 2, one
    reference: the diag base (the sub-batch on q itself, on a replicated cache, each merge on 2
    devices) and under fixed_shapes the general form (page-sharded cache); TP ragged_paged_attention,
    the compat RPA v3 entry point sharded as tpu-inference shards it, and TP MLA (both entry
    points) at 2, TP decode with append_kv at 2, MLA decode under TP 2 x CP 2; CP by query rows
    (split_queries) at 2 (one swap, page-sharded cache) and TP 2 x CP 3 (all-gathers,
    replicated cache). The previous default set (TP prefill at 4, CP decode and
    prefill at 4, BatchAttention TP x CP on (2, 4), the one-prompt checks on the prefill wrapper)
    runs in the slow grid below."""
    _check_script(["fast"])


@pytest.mark.slow
def test_sharded_grid_equals_one_device():
    """Every entry point at 2, 4 and 8 devices, TP, CP and TP x CP, NHD and HND (TP cascade too),
    the three merges, one prompt per step (the diag or full sub-batch on q itself); first the
    default test's checks at wider meshes and on the prefill wrapper (_main_wide)."""
    _check_script(["grid"], timeout=3600)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_jax_distributed():
    """Two processes (2 forced host devices each) under jax.distributed.initialize on localhost
    run one CP x TP decode step over the 4 global devices, checked against one device."""
    port = _free_port()
    procs = [_script(["dist", str(port), str(i)], devices=2) for i in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "OK" in out, out[-6000:]


# ---------------------------------------------------------------------------------------------
# The script side


def _table(rng, kv_lens, page_size, extra_pages=3):
    """Random non-contiguous pages per request: (indptr, indices, last, num_pages)."""
    npages = -(-np.asarray(kv_lens) // page_size)
    num_pages = int(npages.sum()) + extra_pages
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    indices = rng.permutation(num_pages)[: indptr[-1]].astype(np.int32)
    last = np.where(npages > 0, np.asarray(kv_lens) - (npages - 1) * page_size, page_size).astype(np.int32)
    return indptr, indices, last, num_pages


def _sharded_table(rng, kv_lens, page_size, devices, pages_per_shard):
    """Pages allocated device by device (an even split of each request's pages), ids from each
    device's block [k N, (k + 1) N): the page table of a page-sharded cache."""
    npages = -(-np.asarray(kv_lens) // page_size)
    free = [list(k * pages_per_shard + rng.permutation(pages_per_shard)) for k in range(devices)]
    indices = []
    for n in npages:
        cuts = np.rint(np.linspace(0, n, devices + 1)).astype(int)
        for k in range(devices):
            indices += [free[k].pop() for _ in range(cuts[k + 1] - cuts[k])]
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    last = np.where(npages > 0, np.asarray(kv_lens) - (npages - 1) * page_size, page_size).astype(np.int32)
    return indptr, np.asarray(indices, np.int32), last


class _Case:
    """One problem: global q, cache and page table, the single-device reference state."""

    def __init__(self, rng, kind, hq, hkv, layout, devices_cp, kv_lens, qo_lens, causal=True, sharded=False):
        import jax.numpy as jnp
        self.kind, self.hq, self.hkv, self.layout, self.causal = kind, hq, hkv, layout, causal
        self.d, self.page = 32, 4
        kv_lens = np.asarray(kv_lens, np.int32)
        self.kv_lens = kv_lens
        self.batch = kv_lens.shape[0]
        if sharded:
            per = int((-(-kv_lens // self.page)).sum()) // devices_cp + self.batch + 2
            self.pages_per_shard = per
            self.num_pages = per * devices_cp
            self.table = _sharded_table(rng, kv_lens, self.page, devices_cp, per)
        else:
            self.pages_per_shard = None
            *self.table, self.num_pages = _table(rng, kv_lens, self.page)
        shape = ((self.num_pages, self.page, hkv, self.d) if layout == "NHD"
                 else (self.num_pages, hkv, self.page, self.d))
        self.k = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
        self.v = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
        self.qo_indptr = None
        self.bcap, self.pcap = self.batch, int(self.table[0][-1]) + 2
        if kind == "decode":
            rows = self.batch
        else:
            self.qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
            rows = int(self.qo_indptr[-1]) + 3  # padding rows past the batch give o = 0
        self.tcap = rows
        self.q = jnp.asarray(rng.standard_normal((rows, hq, self.d)).astype(np.float32))

    def wrapper(self, hq, hkv):
        if self.kind == "decode":
            return ji.BatchDecodeWithPagedKVCache(hq, hkv, self.d, self.page, layout=self.layout, num_ctas=8,
                                                  max_batch_size=self.bcap, max_num_pages=self.pcap)
        cls = ji.BatchPrefillWithPagedKVCache if self.kind == "prefill" else ji.BatchAttention
        return cls(hq, hkv, self.d, self.page, causal=self.causal, layout=self.layout, num_ctas=8,
                   max_batch_size=self.bcap, max_num_tokens=self.tcap, max_num_pages=self.pcap)

    def plan(self, wrapper):
        if self.kind == "decode":
            return wrapper.plan(*self.table, num_pages=self.num_pages)
        return wrapper.plan(self.qo_indptr, *self.table, num_pages=self.num_pages)

    def cache(self):
        return ji.PagedKVCache(self.k, self.v, self.layout)

    def reference(self):
        w = self.wrapper(self.hq, self.hkv)
        return w.run(self.q, self.cache(), self.plan(w), return_lse=True)


def _compare(name, state, ref):
    o, lse = (np.asarray(x, np.float64) for x in state)
    ro, rlse = (np.asarray(x, np.float64) for x in ref)
    assert not np.any(np.isnan(o)), f"{name}: NaN in o"
    err = np.linalg.norm(o - ro) / max(np.linalg.norm(ro), 1e-30)
    assert err <= 2e-5, f"{name}: o relative error {err:.2e}"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(rlse), err_msg=f"{name}: empty rows differ")
    fin = np.isfinite(rlse)
    np.testing.assert_allclose(lse[fin], rlse[fin], rtol=1e-4, atol=1e-4, err_msg=name)
    print(f"{name}: o rel err {err:.1e} ({time.perf_counter() - _START:.1f} s)", flush=True)


def _mesh(tp, cp):
    import jax
    devices = np.asarray(jax.devices()[: tp * cp])
    if cp == 1:
        return jax.sharding.Mesh(devices, ("tp",))
    if tp == 1:
        return jax.sharding.Mesh(devices, ("cp",))
    return jax.sharding.Mesh(devices.reshape(tp, cp), ("tp", "cp"))


def _check_tp(case, tp):
    import jax
    from jax.sharding import NamedSharding
    mesh = _mesh(tp, 1)
    hs = sharding.split_heads(case.hq, case.hkv, tp)
    w = case.wrapper(hs.num_qo_heads, hs.num_kv_heads)
    cache = case.cache()
    if hs.kv_replicas > 1:
        cache = sharding.replicate_kv_heads(cache, hs.kv_replicas)
    cache = sharding.put(cache, NamedSharding(mesh, sharding.cache_spec(case.layout, tp_axis="tp")))
    q = sharding.put(case.q, NamedSharding(mesh, sharding.head_spec("tp")))
    run = jax.jit(sharding.head_parallel(w, mesh, return_lse=True))
    _compare(f"TP{tp} {case.kind} {case.layout} Hq{case.hq}/Hkv{case.hkv}", run(q, cache, case.plan(w)),
             case.reference())


def _check_tp_append(case, tp):
    """TP decode with append_kv=(k, v): the decode kernel writes each request's new K/V on every
    device (its KV heads) and attends to it; o and the written cache against one device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    mesh = _mesh(tp, 1)
    hs = sharding.split_heads(case.hq, case.hkv, tp)
    rng = np.random.default_rng(7)
    new = tuple(jnp.asarray(rng.standard_normal((case.batch, case.hkv, case.d)).astype(np.float32)) for _ in "kv")
    w1 = case.wrapper(case.hq, case.hkv)
    ref_o, ref_cache = w1.run(case.q, case.cache(), case.plan(w1), append_kv=new)
    assert not np.array_equal(np.asarray(ref_cache.arrays[0]), np.asarray(case.k))  # the rows were written
    rep = (lambda x: sharding.replicate_kv_heads(x, hs.kv_replicas)) if hs.kv_replicas > 1 else (lambda x: x)
    w = case.wrapper(hs.num_qo_heads, hs.num_kv_heads)
    heads = NamedSharding(mesh, sharding.head_spec("tp"))
    cache = sharding.put(rep(case.cache()), NamedSharding(mesh, sharding.cache_spec(case.layout, tp_axis="tp")))
    run = jax.jit(sharding.head_parallel(w, mesh))
    o, cache = run(sharding.put(case.q, heads), cache, case.plan(w),
                   append_kv=tuple(sharding.put(rep(x), heads) for x in new))
    err = np.linalg.norm(np.asarray(o) - np.asarray(ref_o)) / np.linalg.norm(np.asarray(ref_o))
    assert err <= 2e-5, f"TP{tp} decode with append_kv: o relative error {err:.2e}"
    for got, want in zip(cache.arrays, rep(ref_cache).arrays):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    print(f"TP{tp} decode {case.layout} with append_kv: o rel err {err:.1e}", flush=True)


def _cp_setup(case, tp, cp, fixed_shapes=False, shard_pages=None):
    """(mesh, tp_axis, per-device wrapper, split, plan, cache, q) of a CP (or TP x CP) check, placed.
    shard_pages: the cache split on pages (default: where the case's table is page-sharded; False
    runs a page-sharded table on a replicated cache)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = _mesh(tp, cp)
    tp_axis = "tp" if tp > 1 else None
    hs = sharding.split_heads(case.hq, case.hkv, tp)
    w = case.wrapper(hs.num_qo_heads, hs.num_kv_heads)
    if shard_pages is None:
        shard_pages = case.pages_per_shard is not None
    split = sharding.split_page_table(*case.table, case.page, cp, qo_indptr=case.qo_indptr, causal=case.causal,
                                      pages_per_shard=case.pages_per_shard if shard_pages else None)
    plan = sharding.put(sharding.context_plan(w, split, num_pages=case.num_pages, fixed_shapes=fixed_shapes),
                        NamedSharding(mesh, P("cp")))
    cache = case.cache()
    if hs.kv_replicas > 1:
        cache = sharding.replicate_kv_heads(cache, hs.kv_replicas)
    spec_c = sharding.cache_spec(case.layout, tp_axis=tp_axis, cp_axis="cp" if shard_pages else None)
    cache = sharding.put(cache, NamedSharding(mesh, spec_c))
    q = sharding.put(case.q, NamedSharding(mesh, sharding.head_spec(tp_axis)))
    return mesh, tp_axis, w, split, plan, cache, q


def _cp_name(case, tp, cp, split, plan, merge):
    empty = int((split.share_lens == 0).sum())
    return (f"TP{tp}xCP{cp} {case.kind} causal={case.causal} {case.layout} "
            f"{'page-sharded' if split.pages_per_shard is not None else 'replicated'} cache ({empty} empty shares, "
            f"base {plan.base}), merge {merge}")


def _check_cp(case, tp, cp, ref=None, merge="auto", base="any", fixed_shapes=False):
    """context_parallel(merge=) against one device; base: the plan's expected base (or "any")."""
    import jax
    mesh, tp_axis, w, split, plan, cache, q = _cp_setup(case, tp, cp, fixed_shapes)
    assert base == "any" or plan.base == base, (plan.base, base)
    run = jax.jit(sharding.context_parallel(w, mesh, tp_axis=tp_axis, shard_pages=split.pages_per_shard is not None,
                                            return_lse=True, merge=merge))
    _compare(_cp_name(case, tp, cp, split, plan, merge), run(q, cache, plan),
             case.reference() if ref is None else ref)


def _check_cp_merges(case, tp, cp, base="any", ref=None, shard_pages=None):
    """The devices' partial states (context_partial_states: the kernels run once), then each merge
    of merge_over on them, against one device."""
    import jax
    mesh, tp_axis, w, split, plan, cache, q = _cp_setup(case, tp, cp, shard_pages=shard_pages)
    assert base == "any" or plan.base == base, (plan.base, base)
    local = jax.jit(sharding.context_partial_states(w, mesh, tp_axis=tp_axis,
                                                    shard_pages=split.pages_per_shard is not None))
    states = local(q, cache, plan)
    _check_merges(_cp_name(case, tp, cp, split, plan, "{}") + " on context_partial_states", mesh, tp_axis, states,
                  case.reference() if ref is None else ref)


def _poison_unlisted(case):
    """NaN in K and V of every page no request of case lists: a read of one shows in o."""
    import jax.numpy as jnp
    unlisted = np.setdiff1d(np.arange(case.num_pages), case.table[1][: case.table[0][-1]])
    case.k, case.v = (x.at[jnp.asarray(unlisted)].set(jnp.nan) for x in (case.k, case.v))


def _check_cp_rows(case, tp, cp, gather_capacity=None):
    """context_parallel with a QueryPlan (split_queries: query rows split, each device's rows
    whole over their keys, the lent pages of a page-sharded cache gathered) against one device;
    every replica of the result holds the same bits."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = _mesh(tp, cp)
    tp_axis = "tp" if tp > 1 else None
    hs = sharding.split_heads(case.hq, case.hkv, tp)
    split = sharding.split_queries(case.qo_indptr, *case.table, case.page, cp, causal=case.causal,
                                   pages_per_shard=case.pages_per_shard, num_rows=case.tcap,
                                   gather_capacity=gather_capacity)
    cls = ji.BatchPrefillWithPagedKVCache if case.kind == "prefill" else ji.BatchAttention
    w = cls(hs.num_qo_heads, hs.num_kv_heads, case.d, case.page, causal=case.causal, layout=case.layout, num_ctas=8,
            max_batch_size=split.max_requests, max_num_tokens=split.max_tokens, max_num_pages=split.max_pages)
    plan = sharding.put(sharding.context_plan(w, split, num_pages=case.num_pages), NamedSharding(mesh, P("cp")))
    _poison_unlisted(case)  # (the gather's padding lends local page 0, which may be one of them)
    cache = case.cache()
    if hs.kv_replicas > 1:
        cache = sharding.replicate_kv_heads(cache, hs.kv_replicas)
    shard_pages = case.pages_per_shard is not None
    spec_c = sharding.cache_spec(case.layout, tp_axis=tp_axis, cp_axis="cp" if shard_pages else None)
    cache = sharding.put(cache, NamedSharding(mesh, spec_c))
    q = sharding.put(case.q, NamedSharding(mesh, sharding.head_spec(tp_axis)))
    run = jax.jit(sharding.context_parallel(w, mesh, tp_axis=tp_axis, shard_pages=shard_pages, return_lse=True))
    state = run(q, cache, plan)
    _compare(f"TP{tp}xCP{cp} by rows {case.kind} causal={case.causal} {case.layout} "
             f"{'page-sharded' if shard_pages else 'replicated'} cache", state, case.reference())
    for x in state:
        first = x.addressable_shards[0]
        copies = [np.asarray(sh.data) for sh in x.addressable_shards if sh.index == first.index]
        assert len(copies) == cp and all(np.array_equal(c, copies[0], equal_nan=True) for c in copies[1:])


@functools.lru_cache(maxsize=None)
def _merge(mesh, tp_axis, merge):
    """jit(merge_over(merge=) of the devices' partial states [cp, ...] on mesh), compiled once per merge."""
    import jax
    from jax.sharding import PartitionSpec as P
    spec = ji.AttentionState(P("cp", None, tp_axis, None), P("cp", None, tp_axis))
    out = ji.AttentionState(sharding.head_spec(tp_axis), P(None, tp_axis))
    body = lambda s: sharding.merge_over(jax.tree.map(lambda x: x[0], s), "cp", merge=merge)  # noqa: E731
    return jax.jit(sharding.shard_map(body, mesh, (spec,), out))


def _check_merges(name, mesh, tp_axis, states, ref, merges=("psum", "all_gather", "all_to_all")):
    """Each merge of partial states (o [cp, T, Hq, D], lse [cp, T, Hq]) against one device's state;
    name holds "{}" for the merge."""
    cp = mesh.shape["cp"]
    assert states.o.shape[0] == cp and states.o.shape[1:] == ref.o.shape, (states.o.shape, ref.o.shape)
    for merge in merges:
        merged = _merge(mesh, tp_axis, merge)(states)
        _compare(name.format(merge), merged, ref)
        for x in merged:  # every replica holds the same bits (each merge in device order)
            copies = [np.asarray(sh.data) for sh in x.addressable_shards if sh.index == x.addressable_shards[0].index]
            assert len(copies) == cp and all(np.array_equal(c, copies[0], equal_nan=True) for c in copies[1:])


def _cp_scan_states(case, w, cp, steps, layout):
    """A CP decode loop over case's page-sharded cache on cp devices: one horizon plan, lax.scan
    over the steps (context_parallel with traced kv_lens = the final lengths less the steps to
    come). Returns (states stacked over the steps, the ContextSplit)."""
    import jax
    import jax.numpy as jnp
    from jax.lax import scan
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = _mesh(1, cp)
    split = sharding.split_page_table(*case.table, case.page, cp, pages_per_shard=case.pages_per_shard)
    plan = sharding.put(sharding.context_plan(w, split, num_pages=case.num_pages, horizon=steps),
                        NamedSharding(mesh, P("cp")))
    cache = sharding.put(case.cache(), NamedSharding(mesh, sharding.cache_spec(layout, cp_axis="cp")))
    run = sharding.context_parallel(w, mesh, return_lse=True)
    final = jnp.asarray(case.kv_lens)

    @jax.jit
    def loop(q, cache, plan):
        def step(carry, s):
            n = jnp.maximum(final - (steps - 1 - s), 0)
            return carry, run(q * (1.0 + s), cache, plan, kv_lens=n)
        return scan(step, 0, jnp.arange(steps))[1]

    return loop(case.q, cache, plan), split


def _check_cp_scan(rng, cp, steps=3):
    """A CP decode loop (_cp_scan_states) against one device's horizon plan, step by step."""
    import jax
    case = _Case(rng, "decode", 4, 2, "NHD", cp, [1, 9, 23, 40], None, sharded=True)
    states, _ = _cp_scan_states(case, case.wrapper(4, 2), cp, steps, "NHD")
    one = case.wrapper(4, 2)
    one_plan = one.plan(*case.table, num_pages=case.num_pages, horizon=steps)
    one_step = jax.jit(lambda q, c, p, n: one.run(q, c, p, kv_lens=n, return_lse=True))  # one program, every step
    for s in range(steps):
        ref = one_step(case.q * (1.0 + s), case.cache(), one_plan, one_plan.kv_lens_at(s))
        _compare(f"CP{cp} decode lax.scan step {s}", jax.tree.map(lambda x: x[s], states), ref)


def _check_decode_family(rng, steps=2, layout="HND"):
    """One decode case (8 query and 2 KV heads, a page-sharded cache on 4 devices: requests of 1 to
    10 pages, so empty shares; at step 0 the first request is empty) and one horizon plan, each
    step against one device's program (kv_lens = plan.kv_lens_at(step)): TP 4 (head_parallel, KV
    heads replicated 2x), CP 4 in a lax.scan over the steps (context_parallel with traced kv_lens,
    merge auto: the all-gather), and TP x CP on (2, 4) (context_partial_states, then merge_over by
    psum, all-gather and all-to-all)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    cp, hq, hkv = 4, 8, 2
    case = _Case(rng, "decode", hq, hkv, layout, cp, [1, 9, 23, 40], None, sharded=True)
    one = case.wrapper(hq, hkv)
    one_plan = one.plan(*case.table, num_pages=case.num_pages, horizon=steps)
    one_step = jax.jit(lambda q, c, p, n: one.run(q, c, p, kv_lens=n, return_lse=True))  # one program, every step
    qs = [case.q * (1.0 + s) for s in range(steps)]
    lens = [one_plan.kv_lens_at(s) for s in range(steps)]
    refs = [one_step(qs[s], case.cache(), one_plan, lens[s]) for s in range(steps)]

    # TP 4: 2 KV heads on 4 devices, each replicated twice.
    mesh = _mesh(4, 1)
    hs = sharding.split_heads(hq, hkv, 4)
    assert hs.kv_replicas == 2
    w = case.wrapper(hs.num_qo_heads, hs.num_kv_heads)
    plan = w.plan(*case.table, num_pages=case.num_pages, horizon=steps)
    cache = sharding.put(sharding.replicate_kv_heads(case.cache(), hs.kv_replicas),
                         NamedSharding(mesh, sharding.cache_spec(layout, tp_axis="tp")))
    run = jax.jit(sharding.head_parallel(w, mesh, return_lse=True))
    for s in range(steps):
        q = sharding.put(qs[s], NamedSharding(mesh, sharding.head_spec("tp")))
        _compare(f"TP4 decode {layout} Hq{hq}/Hkv{hkv} step {s}", run(q, cache, plan, lens[s]), refs[s])

    # CP 4: a decode loop, one horizon plan, lax.scan over the steps.
    states, split = _cp_scan_states(case, case.wrapper(hq, hkv), cp, steps, layout)
    empty = int((split.share_lens == 0).sum())
    for s in range(steps):
        _compare(f"CP{cp} decode {layout} lax.scan step {s} ({empty} empty shares)",
                 jax.tree.map(lambda x: x[s], states), refs[s])

    # TP 2 x CP 4: the devices' partial states, each merge.
    mesh = _mesh(2, cp)
    hs = sharding.split_heads(hq, hkv, 2)
    w = case.wrapper(hs.num_qo_heads, hs.num_kv_heads)
    plan = sharding.put(sharding.context_plan(w, split, num_pages=case.num_pages, horizon=steps),
                        NamedSharding(mesh, P("cp")))
    cache = sharding.put(case.cache(), NamedSharding(mesh, sharding.cache_spec(layout, tp_axis="tp", cp_axis="cp")))
    local = jax.jit(sharding.context_partial_states(w, mesh, tp_axis="tp"))
    for s in range(steps):
        states = local(sharding.put(qs[s], NamedSharding(mesh, sharding.head_spec("tp"))), cache, plan, lens[s])
        name = f"TP2xCP{cp} decode {layout} page-sharded cache step {s}, merge {{}} on context_partial_states"
        _check_merges(name, mesh, "tp", states, refs[s])


def _check_one_prompt(rng, kind="batch"):
    """One prompt per step (and an empty request whose queries see no key) on 2 devices, one
    reference: the diag sub-batch runs on q itself, the full rows scattered into its output (base
    "diag"; context_partial_states on a replicated cache, then each merge), and under fixed_shapes
    the general form (both sub-batches gathered, placed by src; context_parallel on a page-sharded
    cache)."""
    case = _Case(rng, kind, 4, 2, "NHD", 2, [45, 0], [45, 2], sharded=True)
    ref = case.reference()
    _check_cp_merges(case, 1, 2, base="diag", ref=ref, shard_pages=False)
    _check_cp(case, 1, 2, ref=ref, base=None, fixed_shapes=True)


def _check_ragged_tp(rng, tp, hq=8, hkv=2, sinks=False):
    """TP ragged_paged_attention (writes the new K/V too; with sinks, one random logit per query
    head) against one device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    d, page, pages_per_seq = 32, 4, 4
    q_lens = np.array([1, 1, 4, 8], np.int32)  # 16 tokens: the decode classes (16- and 32-row tiles; 64-row empty)
    kv_lens = np.array([3, 16, 5, 14], np.int32)
    s = q_lens.shape[0]
    num_pages = s * pages_per_seq + 2
    page_indices = rng.permutation(num_pages)[: s * pages_per_seq].astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(cu[-1]) + 2
    dist = np.array([2, 2, s], np.int32)
    mk = lambda shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    q, kn, vn = mk((t, hq, d)), mk((t, hkv, d)), mk((t, hkv, d))
    cache = ji.PagedKVCache(mk((num_pages, page, hkv, d)), mk((num_pages, page, hkv, d)))
    meta = tuple(jnp.asarray(x) for x in (kv_lens, page_indices, cu, dist))
    sink = 2 * mk((hq,)) if sinks else None
    ref_o, ref_cache = ji.ragged_paged_attention(q, kn, vn, cache, *meta, sinks=sink)
    mesh = _mesh(tp, 1)
    hs = sharding.split_heads(hq, hkv, tp)
    rep = lambda x: sharding.replicate_kv_heads(x, hs.kv_replicas)
    heads = NamedSharding(mesh, sharding.head_spec("tp"))
    run = jax.jit(sharding.head_parallel_ragged(mesh))
    o, new_cache = run(sharding.put(q, heads), sharding.put(rep(kn), heads), sharding.put(rep(vn), heads),
                       sharding.put(rep(cache), NamedSharding(mesh, sharding.cache_spec("NHD", tp_axis="tp"))),
                       *meta, sinks=sink)
    err = np.linalg.norm(np.asarray(o) - np.asarray(ref_o)) / np.linalg.norm(np.asarray(ref_o))
    assert err <= 2e-5, f"TP{tp} ragged (sinks {sinks}): o relative error {err:.2e}"
    np.testing.assert_array_equal(np.asarray(new_cache.k_pages), np.asarray(rep(ref_cache).k_pages))
    print(f"TP{tp} ragged_paged_attention: o rel err {err:.1e}", flush=True)


def _check_compat_tp(rng, tp, hq=8, hkv=2):
    """jaxinfer.compat.tpu_inference.ragged_paged_attention sharded as tpu-inference shards RPA v3
    (shard_map over KV heads: q, k, v on their head axis, the fused cache on its third, metadata
    replicated; float32, so p = 1 and each device holds its heads' K and V words) against one
    device: o and the written cache."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from jaxinfer.compat import tpu_inference as rpa
    d, page, pages_per_seq = 128, 4, 4
    q_lens = np.array([1, 3, 6], np.int32)
    kv_lens = np.array([7, 3, 13], np.int32)
    s = q_lens.shape[0]
    num_pages = s * pages_per_seq + 2
    page_indices = rng.permutation(num_pages)[: s * pages_per_seq].astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(cu[-1]) + 2
    mk = lambda shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    q, kn, vn = mk((t, hq, d)), mk((t, hkv, d)), mk((t, hkv, d))
    cache = mk(rpa.kv_cache_shape(num_pages, page, hkv, d, jnp.float32))  # [P, page, 2 Hkv, 1, D]
    meta = tuple(jnp.asarray(x) for x in (kv_lens, page_indices, cu, np.array([1, 1, s], np.int32)))
    call = lambda *args: rpa.ragged_paged_attention(*args, sm_scale=d ** -0.5, num_ctas=8)
    ref_o, ref_cache = call(q, kn, vn, jnp.copy(cache), *meta)
    heads, fused = P(None, "tp", None), P(None, None, "tp", None, None)
    sharded = jax.jit(sharding.shard_map(call, _mesh(tp, 1), (heads, heads, heads, fused) + (P(),) * 4,
                                         (heads, fused)))
    o, new_cache = sharded(q, kn, vn, cache, *meta)
    err = np.linalg.norm(np.asarray(o) - np.asarray(ref_o)) / np.linalg.norm(np.asarray(ref_o))
    assert err <= 2e-5, f"TP{tp} compat RPA v3: o relative error {err:.2e}"
    np.testing.assert_array_equal(np.asarray(new_cache), np.asarray(ref_cache))
    print(f"TP{tp} compat.tpu_inference.ragged_paged_attention: o rel err {err:.1e}", flush=True)


def _ragged_cp_step(rng, devices, pages_per_shard, hkv, d, page, q_lens, kv_lens, *, skip=()):
    """An RPA step over a page-sharded cache: sequence i's pages spread evenly over the devices in
    device order (sequences in `skip` leave out device 1), ids from device k's block, never its
    first page (a device-local id 0, unlisted: a read past a share shows); two padding sequences
    and three padding rows. Returns (kv_lens, page_indices, cu_q_lens, distribution) as
    host arrays and the cache arrays' shape."""
    s, pages_per_seq = len(q_lens) + 2, -(-max(kv_lens) // page)
    free = [list(k * pages_per_shard + 1 + rng.permutation(pages_per_shard - 1)) for k in range(devices)]
    page_indices = np.full((s, pages_per_seq), 10 ** 6, np.int32)  # never read: out of range
    for i, kv in enumerate(kv_lens):
        n = -(-kv // page)
        owners = [k for k in range(devices) if not (i in skip and k == 1)]
        cuts = np.rint(np.linspace(0, n, len(owners) + 1)).astype(int)
        page_indices[i, :n] = [free[k].pop() for j, k in enumerate(owners) for _ in range(cuts[j + 1] - cuts[j])]
    cu = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)] * 2]).astype(np.int32)
    decode = next((i for i, q in enumerate(q_lens) if q != 1), len(q_lens))
    dist = np.array([decode, decode, len(q_lens)], np.int32)
    kv = np.concatenate([kv_lens, [0, 0]]).astype(np.int32)
    return (kv, page_indices.reshape(-1), cu, dist), (devices * pages_per_shard, page, hkv, d)


def _check_ragged_cp(rng, tp, cp, causal=True, hq=8, hkv=2, window=None, soft_cap=None, sinks=False):
    """CP (x TP) ragged_paged_attention against one device: o and lse, and the written cache bit for
    bit. Decode rows on long sequences, a chunk whose rows straddle shares, a whole prompt, an
    empty q, a sequence that skips device 1, one shorter than a share; NaN in every page no
    sequence lists; with sinks, one random logit per query head. Pages listed out of device order
    raise ValueError."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    d, page = 32, 4
    q_lens = [1, 1, 0, 13, 30, 2, 5]
    kv_lens = [61, 9, 20, 40, 30, 3, 44]
    meta, shape = _ragged_cp_step(rng, cp, 48, hkv, d, page, q_lens, kv_lens, skip=(0, 6))
    t = int(meta[2][-1]) + 3
    mk = lambda shape: rng.standard_normal(shape).astype(np.float32)
    q, kn, vn = jnp.asarray(mk((t, hq, d))), jnp.asarray(mk((t, hkv, d))), jnp.asarray(mk((t, hkv, d)))
    k_pages, v_pages = mk(shape), mk(shape)
    listed = np.zeros(shape[0], bool)
    listed[meta[1][meta[1] < shape[0]]] = True
    k_pages[~listed], v_pages[~listed] = np.nan, np.nan
    cache = ji.PagedKVCache(jnp.asarray(k_pages), jnp.asarray(v_pages))
    meta = tuple(jnp.asarray(x) for x in meta)
    sink = jnp.asarray(2 * mk((hq,))) if sinks else None
    ref, ref_cache = ji.ragged_paged_attention(q, kn, vn, cache, *meta, causal=causal, sliding_window=window,
                                               soft_cap=soft_cap, sinks=sink, return_lse=True)
    mesh = _mesh(tp, cp)
    heads = NamedSharding(mesh, sharding.head_spec("tp" if tp > 1 else None))
    spec_c = sharding.cache_spec("NHD", tp_axis="tp" if tp > 1 else None, cp_axis="cp")
    run = sharding.context_parallel_ragged(mesh, tp_axis="tp" if tp > 1 else None, causal=causal, return_lse=True)
    state, new_cache = jax.jit(run)(sharding.put(q, heads), sharding.put(kn, heads), sharding.put(vn, heads),
                           sharding.put(cache, NamedSharding(mesh, spec_c)), *meta, sliding_window=window,
                           soft_cap=soft_cap, sinks=sink)
    _compare(f"CP{cp} x TP{tp} ragged (causal {causal}, window {window}, soft cap {soft_cap}, sinks {sinks})",
             state, ref)
    for got, want in ((new_cache.k_pages, ref_cache.k_pages), (new_cache.v_pages, ref_cache.v_pages)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # NaN == NaN
    if cp > 1:  # a sequence whose pages are not listed device by device (checked where concrete)
        kv_lens, page_indices = meta[0], np.asarray(meta[1]).copy()
        row = page_indices.reshape(kv_lens.shape[0], -1)[3]
        row[: -(-int(kv_lens[3]) // page)] = row[: -(-int(kv_lens[3]) // page)][::-1]
        try:
            run(q, kn, vn, cache, kv_lens, jnp.asarray(page_indices), *meta[2:])
        except ValueError as err:
            assert "out of device order" in str(err), err
        else:
            raise AssertionError("pages out of device order were accepted")


def _check_ragged_cp_scan(rng, cp, steps=3, hq=4, hkv=2):
    """CP ragged_paged_attention as a lax.scan decode loop (one new token per sequence a step, the
    page-sharded cache carried, kv_lens traced) against the same steps on one device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    d, page = 32, 4
    start = np.array([9, 30, 2], np.int32)  # cached keys before the loop
    meta, shape = _ragged_cp_step(rng, cp, 24, hkv, d, page, [1, 1, 1], list(start + steps))
    kv0, page_indices, cu, dist = meta
    mk = lambda shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    t = int(cu[-1]) + 3
    qs, ks, vs = mk((steps, t, hq, d)), mk((steps, t, hkv, d)), mk((steps, t, hkv, d))
    kv_steps = jnp.asarray([np.concatenate([start + i + 1, kv0[len(start):]]) for i in range(steps)], jnp.int32)
    cache = ji.PagedKVCache(mk(shape), mk(shape))
    fixed = tuple(jnp.asarray(x) for x in (page_indices, cu, dist))

    def loop(attend, cache):
        def body(cache, x):
            q, k, v, kv_lens = x
            o, cache = attend(q, k, v, cache, kv_lens, *fixed)
            return cache, o
        return jax.lax.scan(body, cache, (qs, ks, vs, kv_steps))

    ref_cache, ref_o = jax.jit(lambda c: loop(ji.ragged_paged_attention, c))(cache)
    mesh = _mesh(1, cp)
    run = sharding.context_parallel_ragged(mesh)
    cache_cp = sharding.put(cache, NamedSharding(mesh, sharding.cache_spec("NHD", cp_axis="cp")))
    got_cache, got_o = jax.jit(lambda c: loop(run, c))(cache_cp)
    o, want = np.asarray(got_o)[:, :int(cu[-1])], np.asarray(ref_o)[:, :int(cu[-1])]
    err = np.linalg.norm(o - want) / np.linalg.norm(want)
    assert err <= 2e-5, f"CP{cp} ragged scan: o relative error {err:.2e}"
    np.testing.assert_array_equal(np.asarray(got_cache.k_pages), np.asarray(ref_cache.k_pages))
    print(f"CP{cp} ragged_paged_attention in lax.scan ({steps} steps): o rel err {err:.1e}", flush=True)


def _check_mla_tp(rng, tp, heads=8):
    """TP MLA (heads split, latent caches replicated): BatchMLAPagedAttention (o and lse) and the
    device-planned mla_ragged_paged_attention (o and both written caches) against one device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    dc, dr, page, scale, pps = 64, 16, 4, 0.3, 4
    qo, kv = np.array([1, 3, 2], np.int32), np.array([5, 14, 9], np.int32)
    s, num_pages = qo.shape[0], 3 * pps + 2
    page_indices = rng.permutation(num_pages)[: s * pps].astype(np.int32)  # sequence i: pps pages from i pps
    kv_indptr = (np.arange(s + 1) * pps).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    t = int(cu[-1])
    mk = lambda shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    q_nope, q_pe, ckv, kpe = mk((t, heads, dc)), mk((t, heads, dr)), mk((num_pages, page, dc)), mk((num_pages, page, dr))
    mesh = _mesh(tp, 1)
    split = lambda x: sharding.put(x, NamedSharding(mesh, sharding.head_spec("tp")))  # noqa: E731
    table = (cu, kv_indptr, page_indices, kv)
    one = ji.BatchMLAPagedAttention(heads, dc, dr, page, causal=True, sm_scale=scale)
    ref = one.run(q_nope, q_pe, ckv, kpe, one.plan(*table, num_pages=num_pages), return_lse=True)
    per = ji.BatchMLAPagedAttention(heads // tp, dc, dr, page, causal=True, sm_scale=scale)
    run = jax.jit(sharding.head_parallel(per, mesh, return_lse=True))
    _compare(f"TP{tp} BatchMLAPagedAttention", run(split(q_nope), split(q_pe), ckv, kpe,
                                                    per.plan(*table, num_pages=num_pages)), ref)
    new_c, new_pe = mk((t, dc)), mk((t, dr))
    meta = tuple(jnp.asarray(x) for x in (kv, page_indices, cu, np.array([1, 1, s], np.int32)))
    ref_o, ref_ckv, ref_kpe = ji.mla_ragged_paged_attention(q_nope, q_pe, new_c, new_pe, ckv, kpe, *meta,
                                                            sm_scale=scale)
    step = jax.jit(sharding.head_parallel_mla_ragged(mesh, sm_scale=scale))
    o, new_ckv, new_kpe = step(split(q_nope), split(q_pe), new_c, new_pe, ckv, kpe, *meta)
    err = np.linalg.norm(np.asarray(o) - np.asarray(ref_o)) / np.linalg.norm(np.asarray(ref_o))
    assert err <= 2e-5, f"TP{tp} mla_ragged_paged_attention: o relative error {err:.2e}"
    np.testing.assert_array_equal(np.asarray(new_ckv), np.asarray(ref_ckv))
    np.testing.assert_array_equal(np.asarray(new_kpe), np.asarray(ref_kpe))
    print(f"TP{tp} mla_ragged_paged_attention: o rel err {err:.1e}", flush=True)


def _check_mla_cp(rng, tp, cp, heads=8, merge="auto", qo=None, causal=True):
    """BatchMLAPagedAttention under CP (the latent caches split on pages over cp, requests' pages
    device by device, one shorter than a share and one empty; heads on tp, the caches
    replicated over it): o and lse against one device. qo: rows per request (None: decode);
    causal multi-token rows take the diag / one-row sub-requests and the row gather."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    dc, dr, page, scale = 64, 16, 4, 0.3
    kv = np.array([0, 3, 37, 70], np.int32)
    b, per = kv.shape[0], 40
    qo = np.ones(b, np.int32) * (kv > 0) if qo is None else np.asarray(qo, np.int32)
    cu = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    t = int(cu[-1]) + 2  # padding rows: o = 0, lse = -inf
    table = _sharded_table(rng, kv, page, cp, per)  # (kv_indptr, kv_indices, kv_last_page_len)
    num_pages = cp * per
    mk = lambda shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    q_nope, q_pe, ckv, kpe = mk((t, heads, dc)), mk((t, heads, dr)), mk((num_pages, page, dc)), mk((num_pages, page, dr))
    unlisted = jnp.asarray(np.setdiff1d(np.arange(num_pages), table[1]))  # NaN: a read of one shows in o
    ckv, kpe = ckv.at[unlisted].set(jnp.nan), kpe.at[unlisted].set(jnp.nan)
    caps = dict(max_batch_size=t, max_num_tokens=t, max_num_pages=int(table[0][-1]) * int(qo.max()))
    one = ji.BatchMLAPagedAttention(heads, dc, dr, page, causal=causal, sm_scale=scale, **caps)
    ref = one.run(q_nope, q_pe, ckv, kpe, one.plan(cu, table[0], table[1], kv, num_pages=num_pages,
                                                   q_dtype=jnp.float32), return_lse=True)
    mesh = _mesh(tp, cp)
    tp_axis = "tp" if tp > 1 else None
    per_device = ji.BatchMLAPagedAttention(heads // tp, dc, dr, page, causal=causal, sm_scale=scale, **caps)
    split = sharding.split_page_table(*table, page, cp, qo_indptr=cu, pages_per_shard=per)
    plan = sharding.context_plan(per_device, split, num_pages=num_pages, q_data_type=jnp.float32)
    placed = sharding.put(plan, NamedSharding(mesh, P("cp")))
    heads_on = lambda x: sharding.put(x, NamedSharding(mesh, sharding.head_spec(tp_axis)))  # noqa: E731
    pages_on = lambda x: sharding.put(x, NamedSharding(mesh, P("cp", None, None)))  # noqa: E731
    run = jax.jit(sharding.context_parallel(per_device, mesh, tp_axis=tp_axis, return_lse=True, merge=merge))
    empty = int((split.share_lens == 0).sum())
    _compare(f"TP{tp}xCP{cp} BatchMLAPagedAttention rows {qo.tolist()} causal={causal} ({empty} empty shares, "
             f"rows {'gathered' if plan.full_rows is not None else 'in place'}, merge {merge})",
             run(heads_on(q_nope), heads_on(q_pe), pages_on(ckv), pages_on(kpe), placed), ref)


def _check_cascade_cp(rng, tp, cp, hq=8, hkv=2):
    """MultiLevelCascadeAttention decode under CP (split_cascade_levels: each level's pages split
    over the page-sharded cache; two shared prefixes, one across devices, and each request's own
    pages; heads on tp): o and lse against the plain decode wrapper on one device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    d, page, per = 32, 4, 12
    blocks = [list(k * per + rng.permutation(per)) for k in range(cp)]
    prefix_a = [blocks[0].pop() for _ in range(2)]                       # device 0
    prefix_b = [blocks[0].pop()] + [blocks[cp - 1].pop()]                # devices 0 and cp - 1
    own = [[blocks[cp - 1].pop() for _ in range(n)] for n in (1, 2, 3, 1)]  # on the last device
    pages = [prefix_a + own[0], prefix_a + own[1], prefix_b + own[2], prefix_b + own[3]]
    kv_lens = np.array([len(p) * page - j for p, j in zip(pages, (1, 3, 0, 2))], np.int32)
    indptr = np.concatenate([[0], np.cumsum([len(p) for p in pages])]).astype(np.int32)
    indices, last = np.concatenate(pages).astype(np.int32), (kv_lens - (np.diff(indptr) - 1) * page).astype(np.int32)
    b, num_pages = len(pages), cp * per
    levels, saved = ji.two_level_cascade(np.arange(b + 1, dtype=np.int32), indptr, indices, last, page)
    assert saved > 0
    mk = lambda shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    unlisted = jnp.asarray(np.setdiff1d(np.arange(num_pages), indices))  # NaN: a read of one shows in o
    q, cache = mk((b, hq, d)), ji.PagedKVCache(*(mk((num_pages, page, hkv, d)).at[unlisted].set(jnp.nan)
                                                 for _ in "kv"))
    one = ji.BatchDecodeWithPagedKVCache(hq, hkv, d, page, num_ctas=8)
    ref = one.run(q, cache, one.plan(indptr, indices, last, num_pages=num_pages), return_lse=True)
    mesh = _mesh(tp, cp)
    tp_axis = "tp" if tp > 1 else None
    hs = sharding.split_heads(hq, hkv, tp)
    cas = ji.MultiLevelCascadeAttention(2, hs.num_qo_heads, hs.num_kv_heads, d, page, causal=True, num_ctas=8,
                                        max_batch_size=b, max_num_tokens=b, max_num_pages=int(indptr[-1]))
    split = sharding.split_cascade_levels(levels, page, cp, pages_per_shard=per)
    plan = sharding.put(sharding.context_plan(cas, split, num_pages=num_pages), NamedSharding(mesh, P("cp")))
    spec_c = sharding.cache_spec("NHD", tp_axis=tp_axis, cp_axis="cp")
    run = jax.jit(sharding.context_parallel(cas, mesh, tp_axis=tp_axis, return_lse=True))
    _compare(f"TP{tp}xCP{cp} cascade decode ({saved} page reads saved)",
             run(sharding.put(q, NamedSharding(mesh, sharding.head_spec(tp_axis))),
                 sharding.put(cache, NamedSharding(mesh, spec_c)), plan), ref)


def _check_tp_cascade(rng, tp, hq=8, hkv=4):
    """TP MultiLevelCascadeAttention (decode rows over a shared prefix, then their own pages)
    against one device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    d, page, batch = 32, 4, 3
    num_pages = 5 + 3 * batch + 2
    perm = rng.permutation(num_pages).astype(np.int32)
    kv_indices = np.concatenate([np.concatenate([perm[:5], perm[5 + 3 * r:8 + 3 * r]]) for r in range(batch)])
    kv_indptr = (np.arange(batch + 1) * 8).astype(np.int32)
    last = np.array([4, 1, 3], np.int32)
    levels, saved = ji.two_level_cascade(np.arange(batch + 1, dtype=np.int32), kv_indptr, kv_indices, last, page,
                                         causal=False)
    assert saved > 0
    mk = lambda shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    q, cache = mk((batch, hq, d)), ji.PagedKVCache(mk((num_pages, page, hkv, d)), mk((num_pages, page, hkv, d)))
    one = ji.MultiLevelCascadeAttention(2, hq, hkv, d, page, causal=False, num_ctas=8)
    ref = one.run(q, cache, one.plan(levels, num_pages=num_pages), return_lse=True)
    mesh = _mesh(tp, 1)
    hs = sharding.split_heads(hq, hkv, tp)
    w = ji.MultiLevelCascadeAttention(2, hs.num_qo_heads, hs.num_kv_heads, d, page, causal=False, num_ctas=8)
    cache = sharding.put(sharding.replicate_kv_heads(cache, hs.kv_replicas),
                         NamedSharding(mesh, sharding.cache_spec("NHD", tp_axis="tp")))
    q = sharding.put(q, NamedSharding(mesh, sharding.head_spec("tp")))
    run = jax.jit(sharding.head_parallel(w, mesh, return_lse=True))
    _compare(f"TP{tp} cascade", run(q, cache, w.plan(levels, num_pages=num_pages)), ref)


def _short_mix(kind):
    """kv_lens, qo_lens with an empty request, requests shorter than a share, and long ones."""
    kv = [0, 1, 6, 45, 70]
    qo = [0, 1, 3, 17, 70] if kind != "decode" else None
    return kv, qo


def _main_fast():
    rng = np.random.default_rng(1)
    kv, qo = _short_mix("prefill")
    _check_cp_rows(_Case(rng, "prefill", 4, 2, "NHD", 2, kv, qo, sharded=True), 1, 2)  # one swap
    _check_cp_rows(_Case(rng, "batch", 8, 2, "HND", 2, kv, qo, causal=False), 2, 3)  # all-gathers, TP x CP
    _check_decode_family(rng)
    _check_one_prompt(rng, "batch")
    _check_ragged_tp(rng, 2)
    _check_ragged_tp(rng, 4, sinks=True)
    _check_compat_tp(rng, 2)
    _check_tp_append(_Case(rng, "decode", 8, 2, "HND", 1, [1, 6, 21, 40], None), 2)
    _check_ragged_cp(rng, 1, 3)
    _check_ragged_cp(rng, 2, 2, sinks=True)
    _check_mla_tp(rng, 2)
    _check_mla_cp(rng, 2, 2)
    _check_mla_cp(rng, 1, 3, qo=[1, 2, 3, 4])  # MTP verify rows across shares: diag and one-row sub-requests
    _check_cascade_cp(rng, 2, 2)


def _main_wide():
    """The default test's checks at wider meshes and on more kinds (part of the slow grid)."""
    rng = np.random.default_rng(1)
    kv, qo = _short_mix("prefill")
    _check_tp(_Case(rng, "prefill", 8, 2, "NHD", 1, kv, qo), 4)  # KV heads replicated 2x
    _check_cp(_Case(rng, "decode", 4, 2, "NHD", 4, *_short_mix("decode"), sharded=True), 1, 4, merge="all_gather")
    _check_cp_merges(_Case(rng, "prefill", 4, 2, "HND", 4, kv, qo), 1, 4, base=None)
    _check_cp(_Case(rng, "batch", 8, 2, "NHD", 4, kv, [0, 1, 2, 9, 30], sharded=True), 2, 4, merge="psum")
    _check_one_prompt(rng, "prefill")
    _check_cp_scan(rng, 4, steps=2)


def _main_grid():
    _main_wide()
    rng = np.random.default_rng(2)
    for kind in ("decode", "prefill", "batch"):
        kv, qo = _short_mix(kind)
        for layout in ("NHD", "HND"):
            for n in (2, 4, 8):
                _check_tp(_Case(rng, kind, 16, 4, layout, 1, kv, qo), n)
                for causal in ((True, False) if kind != "decode" else (True,)):
                    for sharded in (False, True):
                        _check_cp(_Case(rng, kind, 4, 2, layout, n, kv, qo, causal, sharded), 1, n,
                                  merge=("all_to_all" if n > 2 else "all_gather") if sharded else "psum")
                    if kind != "decode" and layout == "NHD":  # one prompt: that sub-batch on q itself
                        _check_cp(_Case(rng, kind, 4, 2, layout, n, [37], [37], causal), 1, n,
                                  base="diag" if causal else "full")
            for tp, cp in ((2, 2), (2, 4), (4, 2)):
                _check_cp(_Case(rng, kind, 8, 2, layout, cp, kv, qo, True, True), tp, cp)
    # A chunk of 7 queries over 3 pages on 4 devices (one share empty), one prompt per step.
    _check_cp(_Case(rng, "batch", 4, 2, "NHD", 4, [10], [7], sharded=True), 1, 4, merge="all_gather", base="diag")
    for kind in ("prefill", "batch"):  # context parallel by query rows
        kv, qo = _short_mix(kind)
        for n in (2, 4, 8):
            for causal in (True, False):
                for sharded in (False, True):
                    _check_cp_rows(_Case(rng, kind, 4, 2, "NHD", n, kv, qo, causal, sharded), 1, n)
        _check_cp_rows(_Case(rng, kind, 8, 2, "HND", 4, kv, qo, True, True), 2, 4, gather_capacity=40)
        _check_cp_rows(_Case(rng, kind, 4, 2, "NHD", 4, [37], [37], True, True), 1, 4)
    for tp, cp, causal in ((1, 2, True), (1, 4, False), (2, 2, True), (1, 8, True)):
        _check_ragged_cp(rng, tp, cp, causal)
    _check_ragged_cp(rng, 1, 2, window=11, soft_cap=5.0)
    _check_ragged_cp(rng, 1, 4, causal=False, sinks=True)
    _check_ragged_cp(rng, 1, 2, window=11, sinks=True)
    _check_ragged_cp_scan(rng, 4)
    _check_tp_append(_Case(rng, "decode", 8, 2, "NHD", 1, [1, 6, 21, 40], None), 4)  # KV heads replicated 2x
    for tp, cp, merge in ((1, 2, "all_gather"), (1, 4, "all_to_all"), (2, 4, "psum"), (1, 8, "auto")):
        _check_mla_cp(rng, tp, cp, merge=merge)
        _check_mla_cp(rng, tp, cp, merge=merge, qo=[0, 2, 5, 3])
    _check_mla_cp(rng, 1, 4, qo=[1, 3, 7, 2], causal=False)
    for tp, cp in ((1, 2), (1, 4), (2, 4)):
        _check_cascade_cp(rng, tp, cp)
    for n in (2, 4, 8):
        _check_ragged_tp(rng, n)
        _check_tp_cascade(rng, n)
        _check_cp_scan(rng, n)


def _main_dist(port, process_id):
    """One of two processes: a TP 2 x CP 2 decode step over both processes' devices."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=120)
    assert jax.device_count() == 4 and jax.local_device_count() == 2
    rng = np.random.default_rng(3)  # the same inputs in both processes
    case = _Case(rng, "decode", 8, 2, "NHD", 2, [1, 6, 21, 40], None, sharded=True)
    with jax.default_device(jax.local_devices()[0]):
        ref = case.reference()
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(2, 2), ("tp", "cp"))
    w = case.wrapper(4, 1)
    split = sharding.split_page_table(*case.table, case.page, 2, pages_per_shard=case.pages_per_shard)
    plan = sharding.put(sharding.context_plan(w, split, num_pages=case.num_pages), NamedSharding(mesh, P("cp")))
    cache = sharding.put(case.cache(), NamedSharding(mesh, sharding.cache_spec("NHD", tp_axis="tp", cp_axis="cp")))
    q = sharding.put(case.q, NamedSharding(mesh, sharding.head_spec("tp")))
    o, lse = jax.jit(sharding.context_parallel(w, mesh, tp_axis="tp", return_lse=True))(q, cache, plan)
    for out, full in ((o, ref.o), (lse, ref.lse)):  # this process's shards against the reference
        for shard in out.addressable_shards:
            np.testing.assert_allclose(np.asarray(shard.data), np.asarray(full)[shard.index], rtol=1e-4,
                                       atol=2e-5)
    print(f"process {process_id}: {len(o.addressable_shards)} shards match", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "fast":
        _main_fast()
    elif mode == "grid":
        _main_grid()
    else:
        _main_dist(int(sys.argv[2]), int(sys.argv[3]))
    print("OK")
