"""The model examples: the Flax Llama on jaxinfer against dense jnp attention, the serving loop
against requests served alone, generate.py end to end (greedy, sampled, tensor parallel on forced
host devices, several batch sizes in one run), serve.py tensor parallel, quickstart.py (the
README's API tour), bench_e2e.py's chunked-prefill row and the host page allocator."""
import functools
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TEST_XLA_FLAGS
from flax import nnx  # the test extra (Python >= 3.11, as jaxinfer requires)

import jaxinfer as ji
from benchmarks import bench_e2e
from planner.allocator import PageAllocator, PrefixCache, page_table, pad

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import generate  # noqa: E402
import llama  # noqa: E402
import quickstart  # noqa: E402
import mla  # noqa: E402
import serve  # noqa: E402

TINY = llama.get_config("tiny")  # float32
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--batch", "2", "--prompt-len", "3", "11", "--new-tokens", "4", "--page-size", "4", "--quiet"]
GREEDY = ("--layers", "1")
SAMPLED = ("--layers", "1", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9")
TWO_BATCHES = ("--batch", "2", "1")  # two generations on one model and cache


@functools.lru_cache(maxsize=None)
def _results(*extra):
    """generate.main(SMALL + extra)'s result dicts, one per --batch value, computed once per argument
    list (tests share runs)."""
    return tuple(generate.main(SMALL + list(extra)))


def _runs(*extra):
    """The tokens of _results(*extra), one array per --batch value."""
    return tuple(r["tokens"] for r in _results(*extra))


def _tokens(*extra):
    """The tokens of the first --batch value of _runs(*extra)."""
    return _runs(*extra)[0]


SERVE_SEED = 5
SERVE_CFG = llama.get_config("tiny", num_layers=1)


def _engine(chunk=None):
    """serve.Engine(SERVE_CFG: tiny, one layer) of the serving tests (seed SERVE_SEED, 96 pages of 8,
    batches of 6), one per chunk value: its steps compile once for the tests that share it (run()
    starts afresh), the tensor and context parallel test's one-device reference among them."""
    return _engine_of(chunk)


@functools.lru_cache(maxsize=None)
def _engine_of(chunk):
    return serve.Engine(SERVE_CFG, seed=SERVE_SEED, page_size=8, num_pages=96, max_batch=6, chunk=chunk)


def test_llama_logits_paged_equal_dense(rng):
    """Prefill then 3 decode steps, 3 requests on random non-contiguous pages: logits with jaxinfer
    (PagedAttention) equal those with plain jnp attention over a dense padded cache within
    rtol = atol = 1e-4 (float32; the observed gap is ~2e-6 on logits of size ~4). Decode steps
    alternate between the K/V append fused into the decode kernel and append_paged_kv_cache."""
    cfg, ps, steps = TINY, 4, 3
    lens = np.array([5, 13, 9])
    batch = len(lens)
    prompts = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in lens]
    need = -(-(lens + steps) // ps)
    num_pages = int(need.sum()) + 3
    perm = rng.permutation(num_pages).astype(np.int32)
    page_lists = np.split(perm[:need.sum()], np.cumsum(need)[:-1])
    graphdef, params = nnx.split(llama.Llama(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 16)))))
    forward = llama.make_forward(graphdef)
    heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, ps)

    # Prefill: ragged tokens (paged) and a [B, T] padded block (dense).
    paged = llama.paged_kv_cache(cfg, num_pages, ps)
    prefill = ji.BatchPrefillWithPagedKVCache(*heads, num_ctas=4)
    qo_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    kv_indptr, kv_indices, last = page_table(page_lists, lens, ps)
    positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    attention = llama.PagedAttention(prefill, num_pages, prefill.plan(qo_indptr, kv_indptr, kv_indices, last,
                                                                      num_pages=num_pages),
                                     np.repeat(np.arange(batch), lens).astype(np.int32), positions,
                                     kv_indptr, pad(kv_indices, num_pages))
    logits, paged = forward(params, np.concatenate(prompts), positions, paged, attention, qo_indptr[1:] - 1)

    t = int(lens.max())
    dense = llama.dense_kv_cache(cfg, batch, t + steps)
    block = np.zeros((batch, t), np.int32)
    block_pos = np.full((batch, t), -1, np.int32)
    for b, p in enumerate(prompts):
        block[b, :len(p)], block_pos[b, :len(p)] = p, np.arange(len(p))
    rows = np.arange(batch, dtype=np.int32)
    want, dense = forward(params, block.reshape(-1), np.maximum(block_pos, 0).reshape(-1), dense,
                          llama.DenseAttention(rows, block_pos, prefill=True), rows * t + lens - 1)
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)

    decode = ji.BatchDecodeWithPagedKVCache(*heads, num_ctas=4, max_batch_size=batch, max_num_pages=num_pages)
    tokens = np.asarray(jnp.argmax(want, axis=-1), np.int32)
    for s in range(steps):
        kv_lens = lens + s + 1
        pos = (kv_lens - 1).astype(np.int32)
        kv_indptr, kv_indices, last = page_table(page_lists, kv_lens, ps)
        plan = decode.plan(kv_indptr, kv_indices, last, num_pages=num_pages)
        attention = (llama.PagedAttention(decode, num_pages, plan) if s % 2 == 0  # the decode kernel appends
                     else llama.PagedAttention(decode, num_pages, plan, rows, pos, kv_indptr, pad(kv_indices, num_pages)))
        logits, paged = forward(params, tokens, pos, paged, attention)
        want, dense = forward(params, tokens, pos, dense, llama.DenseAttention(None, pos[:, None]))
        np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)
        tokens = np.asarray(jnp.argmax(want, axis=-1), np.int32)


def test_serve_batched_equals_alone(rng):
    """Continuous batching with shared system prompts, n > 1 samples and cascade decode gives
    every (greedy) request the tokens it gets when served alone."""
    engine = _engine()
    requests = serve.make_requests(TINY.vocab_size, rng, 5, max_new_tokens=(3, 6), arrivals=4)
    outputs = engine.run(requests)
    st = engine.stats
    assert st["cascade_steps"] > 0 and st["cached_prompt_tokens"] > 0
    assert st["peak_pages"] < st["peak_pages_unshared"]
    # Only the prefix cache still holds pages (one reference each).
    assert engine.allocator.num_free + len(engine.prefix_cache) == engine.num_pages
    for r in requests:
        assert len(outputs[r.rid]) == r.n and all(len(s) == r.max_new_tokens for s in outputs[r.rid])
    assert serve.mismatches_against_alone(engine, requests, outputs) == []


def test_serve_chunked_prefill_equals_unchunked(rng):
    """--chunk: one forward pass (ragged_paged_attention) per step, prompts in chunks mixed into
    decode steps, gives the tokens of the prefill-then-decode engine, and of each request alone."""
    requests = serve.make_requests(TINY.vocab_size, rng, 4, max_new_tokens=(3, 6), arrivals=3)
    want = _engine().run(requests)  # (the engine of test_serve_batched_equals_alone: compiled once)
    engine = _engine(chunk=16)
    assert engine.run(requests) == want
    assert engine.stats["steps"] > 0 and engine.stats["cascade_steps"] == 0
    assert serve.mismatches_against_alone(engine, requests, want) == []


def test_serve_rejects_requests_that_never_fit():
    engine = serve.Engine(TINY, page_size=8, num_pages=8, max_batch=2, max_len=64)
    with pytest.raises(ValueError, match="max_len"):
        engine.check(serve.Request(0, np.zeros(60, np.int32), 10))
    with pytest.raises(ValueError, match="max_batch"):
        engine.check(serve.Request(0, np.zeros(4, np.int32), 2, n=3))
    with pytest.raises(ValueError, match="token ids"):
        engine.check(serve.Request(0, np.full(4, TINY.vocab_size, np.int32), 2))
    with pytest.raises(ValueError, match="cascade"):
        serve.Engine(TINY, cascade="sometimes")


def test_generate_end_to_end_and_scan_horizon():
    """generate.py runs (greedy, one layer); K decode steps per lax.scan (a horizon plan) give the
    per-step tokens, including a last scan that runs past new_tokens; two --batch values on one
    model and cache with one new token (no decode step) give the prefill's tokens. (The tensor and
    context parallel test compares its --cp run with the first run; the slow scan test runs two
    --batch values with decode steps.)"""
    (step,) = _results(*GREEDY)
    assert step["tokens"].shape == (2, 4)
    assert step["ttft_s"] > 0 and step["itl_s"] > 0 and step["itl_p50_s"] > 0
    np.testing.assert_array_equal(_tokens(*GREEDY, "--scan", "2"), step["tokens"])  # 2 scans of 2 for 3 steps
    first, single = _runs(*GREEDY, *TWO_BATCHES, "--new-tokens", "1")
    assert first.shape == (2, 1) and single.shape == (1, 1)
    np.testing.assert_array_equal(first[:, 0], step["tokens"][:, 0])
    with pytest.raises(ValueError, match="--batch"):
        generate.parse_args(["--batch", "2", "0"])


@pytest.mark.slow  # a benchmark's smoke run, 16 s
def test_bench_e2e_mixed_row_smoke(tmp_path, monkeypatch, capsys):
    """bench_e2e --smoke: the chunked-prefill row (jaxinfer-mixed: prompts split across steps that
    also carry decode rows) samples the jaxinfer row's first tokens and prints in the table; the
    jaxinfer row times the sampling call (its share of ITL)."""
    monkeypatch.setenv("OUT", str(tmp_path))
    jaxinfer, mixed = bench_e2e.main(["--smoke", "--methods", "jaxinfer,jaxinfer-mixed", "--batches", "2",
                                      "--chunk", "8", "--out-tokens", "3"])
    assert "error" not in jaxinfer and "error" not in mixed, (jaxinfer, mixed)
    assert mixed["first_tokens_match"] and mixed["first_token_mismatches"] == 0
    assert mixed["steps"] > -(-mixed["prompt_tokens"] // 8) and mixed["ttft_ms_max"] >= mixed["ttft_ms"] > 0
    assert mixed["itl_ms_p50"] > 0
    assert jaxinfer["sampling_ms"] > 0 and jaxinfer["argmax_ms"] > 0 and 0 < jaxinfer["sampling_share"] < 1
    assert "jaxinfer-mixed     2" in capsys.readouterr().out


TOUR_CALLS = ("BatchDecodeWithPagedKVCache", "BatchPrefillWithPagedKVCache", "BatchPrefillWithRaggedKVCache",
              "BatchAttention", "PrefillConfig",
              "BlockSparseMatrix", "BlockSparseAttention", "two_level_cascade", "MultiLevelCascadeAttention",
              "variants.compose", "float8_e4m3fn", "with_page_offset", "get_batch_indices_positions",
              "append_paged_kv_cache", "append_kv", "single_prefill_with_kv_cache", "merge_state",
              "reference.attention", "ragged_paged_attention")


def test_quickstart_follows_the_readme_api_tour():
    """quickstart.py holds every call of the README's API tour (its run against jaxinfer.reference
    is the slow test below; each of those calls also runs in the default suite in its own module's
    tests: test_decode, test_prefill, test_batch_attention, test_ragged_paged_attention, test_cascade,
    test_variants, test_append, test_single, test_merge, test_mla, test_mla_ragged, test_sampling,
    test_sharding and the generate.py tensor-parallel test)."""
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    tour = readme.split("## API tour")[1].split("```")[1]
    source = open(quickstart.__file__).read()
    for call in TOUR_CALLS:
        assert call in tour and call in source, call
    args = quickstart.parse_args(["--quiet"])
    assert args.quiet and args.hq % args.hkv == 0


@pytest.mark.slow  # 72 s; every API it runs is run by a default test of its module
def test_quickstart_runs_the_readme_api_tour():
    """quickstart.py runs every paragraph of the README's API tour and checks each output against
    jaxinfer.reference (it exits if one is off by more than 2e-2, bf16)."""
    errors = quickstart.main(["--quiet"])
    assert max(errors.values()) < 2e-2, errors


def test_mla_example_absorbed_decode_and_192_128_prefill_match_dense():
    """examples/mla.py (tiny, float32): the 192 / 128-form prefill (q / K of 48 here, V of 32) and
    two absorbed decode steps over the paged latent cache (one compilation) match the dense layer."""
    r = mla.main(["--batch", "2", "--prompt-len", "3", "9", "--new-tokens", "2", "--page-size", "4"])
    assert r["decode_compiles"] == 1 and len(r["decode_errs"]) == 2
    assert max([r["prefill_err"]] + r["decode_errs"]) < 1e-5


def test_page_allocator_shards():
    """A page-split cache's allocator: each shard hands out its own id range, lowest first; a
    freed page returns to its shard."""
    alloc = PageAllocator(12, num_shards=3)
    np.testing.assert_array_equal(alloc.alloc(2, shard=1), [4, 5])
    np.testing.assert_array_equal(alloc.alloc(5), [0, 1, 2, 3, 6])  # shard order, then the next shard
    np.testing.assert_array_equal(alloc.free_per_shard(), [0, 1, 4])
    alloc.free([1, 5])
    np.testing.assert_array_equal(alloc.free_per_shard(), [1, 2, 4])
    np.testing.assert_array_equal(alloc.alloc(2, shard=1), [5, 7])
    with pytest.raises(ValueError, match="n must lie"):
        alloc.alloc(2, shard=0)
    with pytest.raises(ValueError, match="shard must lie"):
        alloc.alloc(1, shard=3)
    with pytest.raises(ValueError, match="num_shards"):
        PageAllocator(10, num_shards=3)


def test_page_allocator_refcounts_and_prefix_cache():
    alloc = PageAllocator(6)
    a = alloc.alloc(3)
    alloc.ref(a[:2])
    np.testing.assert_array_equal(alloc.free(a), [a[2]])  # a[:2] still referenced
    assert alloc.num_free == 4
    with pytest.raises(ValueError, match="more references"):
        alloc.free(np.concatenate([a[:2], a[:2]]))
    with pytest.raises(ValueError, match="not allocated"):
        alloc.ref([a[2]])
    with pytest.raises(ValueError, match="outside"):
        alloc.free([6])
    with pytest.raises(ValueError, match="n must lie"):
        alloc.alloc(5)
    alloc.free(a[:2])
    assert alloc.num_free == 6

    cache = PrefixCache(alloc, 2)
    tokens = np.array([1, 2, 3, 4, 5])
    pages = alloc.alloc(2)
    cache.insert(tokens, pages)
    np.testing.assert_array_equal(cache.match([1, 2, 3, 4, 9], 2), pages)
    np.testing.assert_array_equal(cache.match([1, 2, 7, 7], 2), pages[:1])
    alloc.free(pages)  # the writer is done: the cache's reference keeps them
    cache.lock(tokens, 1)
    assert cache.evict(2) == 1 and len(cache) == 1  # the locked first page stays
    cache.lock(tokens, 1, -1)
    assert cache.evict(2) == 1 and alloc.num_free == 6


def test_page_table_and_pad():
    indptr, indices, last = page_table([np.array([7, 3, 5]), np.array([2]), np.array([4, 1])], [9, 0, 4], 4)
    np.testing.assert_array_equal(indptr, [0, 3, 3, 4])
    np.testing.assert_array_equal(indices, [7, 3, 5, 4])
    np.testing.assert_array_equal(last, [1, 1, 4])
    with pytest.raises(ValueError, match=r"page_lists\[1\]"):
        page_table([np.array([1]), np.array([2])], [3, 9], 4)
    np.testing.assert_array_equal(pad(np.array([1, 2]), 4, -1), [1, 2, -1, -1])
    with pytest.raises(ValueError, match="at most"):
        pad(np.arange(5), 4)


@pytest.mark.slow  # 13 s; generate's default path runs in the default suite
def test_layer_loops_same_weights_and_greedy_tokens():
    """layer_loop "unroll" (per-layer weights and caches) and "scan" (stacked) build the same
    weights from one seed and generate the same greedy tokens; the scan run also takes the
    --sync decode order (wait for each step's tokens, then plan the next). A cache built for
    the other loop is rejected."""
    unrolled = llama.Llama(llama.get_config("tiny", layer_loop="unroll"), rngs=nnx.Rngs(3))
    scanned = llama.Llama(llama.get_config("tiny", layer_loop="scan"), rngs=nnx.Rngs(3))
    for l, layer in enumerate(unrolled.layers):
        for name in llama.LAYER_PARAMS:
            np.testing.assert_array_equal(getattr(layer, name)[...], getattr(scanned.layers, name)[...][l])
    np.testing.assert_array_equal(unrolled.lm_head[...], scanned.lm_head[...])

    (scan,) = generate.main(SMALL + ["--layer-loop", "scan", "--sync"])
    np.testing.assert_array_equal(scan["tokens"], _tokens())  # unroll (the default)

    rows = np.zeros((1, 1), np.int32)
    stacked = llama.dense_kv_cache(scanned.cfg, 1, 4)
    with pytest.raises(ValueError, match="kv_cache"):
        unrolled(np.zeros(1, np.int32), np.zeros(1, np.int32), stacked, llama.DenseAttention(None, rows))
    with pytest.raises(ValueError, match="layer_loop"):
        llama.get_config("tiny", layer_loop="while")


def _host_devices_subprocess(code, devices):
    """Python `code` (printing 'RESULT ' + JSON) in a subprocess with `devices` forced host devices
    (jax fixes the device count when it starts): a started Popen, and its reader returning the JSON."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} " + " ".join(TEST_XLA_FLAGS))
    proc = subprocess.Popen([sys.executable, "-c", "import json, sys; sys.path.insert(0, 'examples'); " + code],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def result():
        try:
            out, _ = proc.communicate(timeout=600)
        finally:
            proc.kill()
        assert proc.returncode == 0 and "RESULT" in out, out[-6000:]
        return json.loads(out.split("RESULT ")[1])
    return result


def _tp_subprocess(runs):
    """generate.main(SMALL + run)'s tokens (one array per --batch value) for each run (each naming its
    --tp or --cp), in a subprocess with four forced host devices."""
    code = ("import generate; print('RESULT', json.dumps([[r['tokens'].tolist() for r in "
            f"generate.main({SMALL!r} + x)] for x in {runs!r}]))")
    result = _host_devices_subprocess(code, 4)
    return lambda: [[np.asarray(t) for t in run] for run in result()]


def test_generate_sampling_in_range():
    """--temperature/--top-k/--top-p: jaxinfer.sampling draws on the device inside the step, a key
    threaded from step to step: tokens lie in the vocabulary (the TP / CP test below draws the same
    tokens in another process with the same seed; the slow test draws them again per lax.scan and
    with one new token). Filters without a temperature are refused."""
    (tokens,) = _runs(*SAMPLED)
    assert tokens.shape == (2, 4) and tokens.min() >= 0 and tokens.max() < TINY.vocab_size
    with pytest.raises(ValueError, match="temperature"):
        generate.parse_args(["--top-k", "5"])
    with pytest.raises(ValueError, match="top-p"):
        generate.parse_args(["--temperature", "1", "--top-p", "0"])


def test_serve_parallel_samples_draw_through_sampling_indices(rng):
    """n > 1 sampled requests (temperature, top-k and min-p: jaxinfer.sampling from probabilities):
    a request's samples take their first token from one LM-head row (SamplingParams.indices), stay
    in the vocabulary, differ from each other and repeat for one seed. Requests using a filter
    the engine was not built with are refused."""
    cfg = llama.get_config("tiny", num_layers=1)
    engine = serve.Engine(cfg, seed=int(rng.integers(1 << 16)), page_size=8, num_pages=96, max_batch=8,
                          cascade="off", filters=("top_k", "min_p"))
    requests = serve.make_requests(cfg.vocab_size, rng, 3, max_new_tokens=(3, 5), samples=(2, 3), arrivals=2,
                                   temperature=1.0, top_k=64, min_p=0.02)
    outputs = engine.run(requests)
    assert engine.stats["shared_logits_rows"] == sum(r.n - 1 for r in requests)
    for r in requests:
        assert len(outputs[r.rid]) == r.n and len({tuple(x) for x in outputs[r.rid]}) > 1
        assert all(len(x) == r.max_new_tokens and 0 <= min(x) and max(x) < cfg.vocab_size for x in outputs[r.rid])
    assert engine.run(requests) == outputs
    with pytest.raises(ValueError, match="filters"):
        engine.check(serve.Request(0, np.zeros(4, np.int32), 2, temperature=1.0, top_p=0.5))


def test_generate_tensor_and_context_parallel_on_host_devices():
    """Sampled generate.py --tp 4 on four forced host devices (weights column/row parallel and made
    on the devices, the cache on KV heads: tiny's 2 KV heads replicated, attention through
    jaxinfer.sharding.head_parallel, logits gathered from the vocabulary-split LM head for the
    replicated sampling call), and greedy --cp 4 (the cache split on pages, each request's few pages
    spread over the devices, some of them empty; the K/V appended where each page lives; attention
    through jaxinfer.sharding.context_parallel, the prefill by query rows, the decode by keys), per
    step and with --scan 2 (horizon plans, each step's append tables), in another process, draw
    the tokens of one device with the same seed (the sampling test's run, and the end-to-end
    test's greedy one). The fused q/k/v layout for fewer KV heads than devices; --tp or --cp past
    the devices, --cp with --tp, and llama3-70b on a CPU are refused."""
    tokens = _tp_subprocess([list(SAMPLED) + ["--tp", "4"], list(GREEDY) + ["--cp", "4"],
                             list(GREEDY) + ["--cp", "4", "--scan", "2"]])
    wants = [_runs(*SAMPLED), _runs(*GREEDY), _runs(*GREEDY)]
    for run, want in zip(tokens(), wants, strict=True):
        for got, ref in zip(run, want, strict=True):
            np.testing.assert_array_equal(got, ref)
    # With fewer KV heads than devices (tiny: 2 on 4), device i holds KV head i // 2 (replicated).
    cols = llama.qkv_columns(llama.get_config("tiny", tp=4))
    np.testing.assert_array_equal(cols[::TINY.head_dim] // TINY.head_dim, [0, 4, 6, 1, 4, 6, 2, 5, 7, 3, 5, 7])
    with pytest.raises(ValueError, match="--tp"):
        generate.parse_args(["--tp", "2"])  # one device in this process
    with pytest.raises(ValueError, match="--cp"):
        generate.parse_args(["--cp", "2"])
    with pytest.raises(ValueError, match="GPUs"):
        generate.parse_args(["--config", "llama3-70b"])


@pytest.mark.parametrize("chunk", [None, pytest.param(16, marks=pytest.mark.slow)])
def test_serve_tensor_and_context_parallel_on_host_devices(chunk):
    """serve.Engine with cfg.tp = 2 on two forced host devices, in another process (weights and the
    cache split on heads; prefill, decode and two-level cascade attention through
    jaxinfer.sharding.head_parallel; with chunk, the mixed step through head_parallel_ragged), and
    with cp = 3 on three (the cache split on pages: one plan per device and step, or with chunk
    the mixed step through context_parallel_ragged; decode steps sharing prefixes through the
    cascade with its levels split), serves shared-prefix requests with n > 1 samples to the
    tokens of one device (the engine of the serving tests above, same weights and shapes). Under
    CP the greedy step compiles once for prefill and once for (cascade) decode (with chunk:
    once), and a request's pages lie on its even-split devices, device by device (after a cached
    prefix, never before its last device). tp or cp past the devices, and cp with a stacked
    (scan) cache, are refused."""
    scenario = "serve.make_requests(cfg.vocab_size, np.random.default_rng(7), 3, max_new_tokens=(2, 4), arrivals=2)"
    code = ("import numpy as np, llama, serve; cfg = llama.get_config('tiny', num_layers=1, tp=2); "
            f"engine = serve.Engine(cfg, seed={SERVE_SEED}, page_size=8, num_pages=96, max_batch=6, chunk={chunk}); "
            f"out = [engine.run({scenario})]; stats = [engine.stats['cascade_steps']]\n"
            "import jax, logging; jax.config.update('jax_log_compiles', True); compiles = []\n"
            "handler = logging.Handler(); handler.emit = lambda r: compiles.append(r.getMessage())\n"
            "logging.getLogger('jax').addHandler(handler)\n"
            "cfg = llama.get_config('tiny', num_layers=1)\n"
            f"engine = serve.Engine(cfg, seed={SERVE_SEED}, page_size=8, num_pages=96, max_batch=6, chunk={chunk}, cp=3)\n"
            f"out.append(engine.run({scenario}))\n"
            "stats.append(sum('XLA compilation of jit(step)' in m for m in compiles))\n"
            "stats.append(engine.stats['cascade_steps'])\n"
            "engine.allocator = serve.PageAllocator(96, num_shards=3)\n"
            "stats.append(engine._place(np.zeros(0, np.int32), 2, 3, 2))\n"
            "stats.append(engine._place(np.array([33], np.int32), 2, 3, 1))\n"
            "try:\n"
            "    serve.Engine(llama.get_config('tiny', num_layers=1, layer_loop='scan'), num_pages=96, cp=3)\n"
            "    stats.append('accepted')\n"
            "except ValueError as err:\n"
            "    stats.append(str(err))\n"
            "print('RESULT', json.dumps([[{str(k): v for k, v in o.items()} for o in out], stats]))")
    result = _host_devices_subprocess(code, 3)
    cfg = SERVE_CFG
    requests = eval(scenario)
    want = _engine(chunk).run(requests)  # (the serving tests' engine: its steps compiled once)
    got, stats = result()
    for run in got:
        assert run == {str(k): v for k, v in want.items()}
    assert stats[0] > 0 or chunk  # TP ran cascade steps
    # CP: one prefill and one decode program (every decode step here shares a prefix: the
    # cascade's, its levels split over the devices), or one mixed step program with chunk
    assert len(got) == 2 and stats[1] == (2 if chunk is None else 1)
    assert stats[2] > 0 or chunk  # CP ran cascade steps
    # 5 pages on 3 devices (2, 2, 1): the 2 shared ones on device 0, each sample's 3 on 1, 1, 2;
    # after a cached page on device 1, all on devices 1 and 2.
    assert stats[3] == [[0, 0], [1, 1, 2], [1, 1, 2]]
    assert stats[4] == [[1], [1, 1, 2]]
    assert "layer_loop" in stats[5]
    with pytest.raises(ValueError, match="cfg.tp"):
        serve.Engine(llama.get_config("tiny", tp=2))  # one device in this process
    with pytest.raises(ValueError, match="cp must lie"):
        serve.Engine(cfg, cp=2)


@pytest.mark.slow
def test_generate_scan_and_tensor_parallel_greedy():
    """Sampled tokens per lax.scan equal those per step (the key threaded alike); a second run with
    the same seed and one new token draws the same first tokens; two --batch values on one model
    and cache: the first draws the tokens of its own run (a run's tokens do not depend on the runs
    after it), the second's lie in the vocabulary; generate.py --tp 2, greedy, per step and per
    lax.scan (K/V appended by each device's decode kernel): one device's tokens."""
    tokens = _tp_subprocess([["--tp", "2"], ["--scan", "3", "--tp", "2"]])
    np.testing.assert_array_equal(_tokens(*SAMPLED, "--scan", "3"), _tokens(*SAMPLED))
    np.testing.assert_array_equal(_tokens(*SAMPLED, "--new-tokens", "1")[:, 0], _tokens(*SAMPLED)[:, 0])
    first, single = _runs(*SAMPLED, *TWO_BATCHES)
    np.testing.assert_array_equal(first, _tokens(*SAMPLED))
    assert single.shape == (1, 4) and single.min() >= 0 and single.max() < TINY.vocab_size
    want = _tokens()
    for (got,) in tokens():
        np.testing.assert_array_equal(got, want)
