"""jaxinfer.dispatch: the support table, the cost model's choices, plan.impl, and no import circles."""
import ast
import itertools
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer import _backend, dispatch
from jaxinfer import variants as V

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("family, kv_format, layout, head_dim, page, mask, variant", list(itertools.product(
    ("decode", "prefill"), ("paged", "ragged", "bsr"), ("NHD", "HND", "NHD_FUSED"), (64, 96, 256), (1, 16),
    (False, True), (None, V.soft_cap(), V.rope()))))
def test_every_combination_picks_a_supported_kernel(monkeypatch, family, kv_format, layout, head_dim, page,
                                                    mask, variant):
    monkeypatch.setattr(_backend, "mosaic_available", lambda interpret: True)  # a Hopper GPU
    problem = dispatch.Problem(family, 8, 2, head_dim, kv_format, page, layout, variant, mask, interpret=False)
    if variant is not None and variant.has_query_transform and head_dim & (head_dim - 1):
        # RoPE rotates whole rows; Triton pads a head_dim that is not a power of two
        assert not dispatch.supported(problem)
        with pytest.raises(ValueError, match="head_dim must be a power of two >= 16, got 96"):
            dispatch.choose(problem, np.array([3, 300]), np.array([500, 700]), True)
        return
    choice = dispatch.choose(problem, np.array([3, 300]), np.array([500, 700]), True)
    assert choice.name in dispatch.supported(problem)
    assert choice.unsupported(problem, False) is None
    if choice.name == "prefill_mosaic":  # the Mosaic kernel's limits hold
        assert layout != "HND" and head_dim % 64 == 0 and not mask and kv_format != "bsr"


def test_unsupported_explicit_impl_raises_naming_why():
    problem = dispatch.Problem("prefill", 8, 2, 96, "paged", 16, "HND")
    with pytest.raises(ValueError, match="layout must be 'NHD'"):
        dispatch.check(problem, "mosaic")
    with pytest.raises(ValueError, match="impl must be"):
        dispatch.check(problem, "cuda")
    with pytest.raises(ValueError, match="head_dim must be a multiple of 64"):
        ji.BatchPrefillWithRaggedKVCache(4, 2, 96, impl="mosaic")


def test_cost_model_choices_match_h100_rows(monkeypatch):
    """The choices regress.py measured as faster on the H100."""
    monkeypatch.setattr(_backend, "mosaic_available", lambda interpret: True)
    monkeypatch.setattr(_backend, "num_sms", lambda default=132: 132)
    gqa = dispatch.Problem("prefill", 32, 8, 128, "paged", 16, interpret=False)
    mha = dispatch.Problem("prefill", 16, 16, 128, "paged", 16, interpret=False)
    pick = lambda p, qo, kv: dispatch.choose(p, np.array(qo), np.array(kv), True).name  # noqa: E731
    assert pick(gqa, [4] * 64, [4096] * 64) == "prefill_short"            # q4: 378 vs 409 (triton), 999
    assert pick(gqa, [64], [32768]) == "prefill_triton"                    # cascade shared level
    assert pick(gqa, [8192] * 4, [8192] * 4) == "prefill_mosaic"          # 521 vs ~420 TFLOP/s
    assert pick(mha, [4096] * 16, [4096] * 16) == "prefill_mosaic"        # 483 vs 352 TFLOP/s
    default = lambda d, **kw: dispatch.IMPLEMENTATIONS_BY_NAME["prefill_mosaic"].default_config(  # noqa: E731
        dispatch.Problem("prefill", 16, 8, d, "ragged", **kw))
    d256 = default(256)  # 64-key blocks fit shared memory; overlap: 663 vs 601 TFLOP/s
    assert (d256.block_kv, d256.pipeline) == (64, "overlap")
    d64 = default(64)  # 458 vs 413 TFLOP/s (ragged B4 S8192)
    assert (d64.compute_wgs, d64.pipeline, d64.tile_tokens) == (3, "free", 192)
    assert default(128).pipeline == "overlap"  # ragged d128: 606 vs 564 TFLOP/s (B4 S8192)
    paged128 = dispatch.IMPLEMENTATIONS_BY_NAME["prefill_mosaic"].default_config(
        dispatch.Problem("prefill", 16, 8, 128, "paged", 16))  # paged: no gain, ping-pong kept
    assert default(64, variant=V.soft_cap()) == default(128, variant=V.soft_cap()) == paged128 == \
        ji.MosaicPrefillConfig()


def test_batch_family_picks_the_mixed_launch_on_the_measured_rows(monkeypatch):
    """BatchAttention's steps with short and long requests: the mixed
    launch on the mixed row (traced: 320.4 µs, one kernel, against the two classes' 373.8) and on
    60 x 4-token verify + 4 chunks; its model within 5% of the traced 320.4 µs. The two classes
    where one decode request has a long context (the mixed launch never splits KV)."""
    monkeypatch.setattr(_backend, "mosaic_available", lambda interpret: True)
    monkeypatch.setattr(_backend, "num_sms", lambda default=132: 132)
    problem = dispatch.Problem("batch", 32, 8, 128, "paged", 16, interpret=False)
    kv_decode = np.random.default_rng(0).integers(512, 4097, 60)
    qo = np.array([512] * 4 + [1] * 60)
    kv = np.concatenate([[2048] * 4, kv_decode])
    assert dispatch.supported(problem) == ["batch_classes", "batch_mosaic"]
    assert dispatch.choose(problem, qo, kv, True).name == "batch_mosaic"
    assert abs(dispatch.IMPLEMENTATIONS_BY_NAME["batch_mosaic"].cost_us(problem, qo, kv, True) - 320.4) < 16
    assert dispatch.choose(problem, np.array([4] * 60 + [512] * 4), kv, True).name == "batch_mosaic"
    assert dispatch.choose(problem, np.array([512, 1]), np.array([2048, 131072]), True).name == "batch_classes"
    assert dispatch.supported(dispatch.Problem("batch", 32, 8, 128, "paged", 16, variant=V.soft_cap(),
                                               interpret=False)) == ["batch_classes"]


def test_mosaic_config_rejects_what_the_kernel_cannot_run():
    with pytest.raises(ValueError, match="pipeline must be"):
        ji.MosaicPrefillConfig(pipeline="fast")
    with pytest.raises(ValueError, match="compute_wgs must be 2 or 3"):
        ji.MosaicPrefillConfig(compute_wgs=4, pipeline="free")
    with pytest.raises(ValueError, match="ping-pong pipeline needs compute_wgs=2"):
        ji.MosaicPrefillConfig(compute_wgs=3)


def test_every_plan_names_its_kernel(rng):
    from helpers import page_table
    indptr, indices, last, num_pages = page_table(rng, np.array([20, 5]), 4)
    qo = np.array([0, 3, 4], np.int32)
    plans = [ji.BatchDecodeWithPagedKVCache(4, 2, 32, 4).plan(indptr, indices, last, num_pages=num_pages),
             ji.BatchPrefillWithPagedKVCache(4, 2, 32, 4).plan(qo, indptr, indices, last, num_pages=num_pages),
             ji.BatchPrefillWithRaggedKVCache(4, 2, 32).plan(qo, np.array([0, 20, 25], np.int32)),
             ji.BatchAttention(4, 2, 32, 4).plan(qo, indptr, indices, last, num_pages=num_pages)]
    for plan in plans:
        assert isinstance(plan.impl, str) and plan.impl


def test_jaxinfer_has_no_import_circles():
    """Imports among jaxinfer, pallas_kernels and planner (module level or local) form no cycle."""
    graph = {}
    for pkg in ("jaxinfer", "pallas_kernels", "planner"):
        for path in (ROOT / pkg).glob("*.py"):
            name = f"{pkg}.{path.stem}" if path.stem != "__init__" else pkg
            deps = set()
            for node in ast.walk(ast.parse(path.read_text())):  # function-local imports too
                if isinstance(node, ast.ImportFrom) and node.module:
                    deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
                elif isinstance(node, ast.Import):
                    deps |= {a.name for a in node.names}
            graph[name] = deps
    internal = {n: {d for d in deps if d in graph and d != n and not n.startswith(d + ".")}
                for n, deps in graph.items() if n != "jaxinfer"}

    def visit(n, stack):
        assert n not in stack, f"import circle: {' -> '.join(stack + [n])}"
        for d in internal.get(n, ()):
            visit(d, stack + [n])

    for n in internal:
        visit(n, [])


def test_plan_dtypes_pick_one_kernel_and_bind_the_plan(monkeypatch, rng):
    """plan(q_data_type=, kv_data_type=) (FlashInfer's arguments): on a Hopper GPU the Mosaic plan
    then carries no Triton plan beside it, a K/V dtype Mosaic cannot take plans Triton alone, and
    run() rejects other dtypes naming both."""
    from helpers import page_table, random_cache
    monkeypatch.setattr(_backend, "mosaic_available", lambda interpret: True)  # plan as on a Hopper GPU
    indptr, indices, last, num_pages = page_table(rng, np.array([4096, 4000]), 16)
    qo = np.array([0, 4096, 8192], np.int32)  # long prompts: the cost model picks Mosaic
    pre = ji.BatchPrefillWithPagedKVCache(8, 2, 128, 16)
    plain = pre.plan(qo, indptr, indices, last, num_pages=num_pages)
    assert plain.impl == "prefill_mosaic" and plain.alt is not None and plain.spec.dtypes is None
    bf16 = pre.plan(qo, indptr, indices, last, num_pages=num_pages, q_data_type="bfloat16")
    assert bf16.impl == "prefill_mosaic" and bf16.alt is None and bf16.spec.dtypes == ("bfloat16", "bfloat16")
    fp8 = pre.plan(qo, indptr, indices, last, num_pages=num_pages, q_data_type=jnp.bfloat16,
                   kv_data_type=jnp.float8_e4m3fn)
    assert fp8.impl == "prefill_triton" and fp8.alt is None
    cache = random_cache(rng, num_pages, 16, 2, 128, jnp.float32)
    q = jnp.zeros((8192, 8, 128), jnp.float32)
    with pytest.raises(ValueError, match="kv_data_type=bfloat16; got q float32, kv_cache float32"):
        pre.run(q, cache, bf16)
    rag = ji.BatchPrefillWithRaggedKVCache(8, 2, 128)
    kv_indptr = np.array([0, 4096, 8192], np.int32)
    assert rag.plan(qo, kv_indptr).alt is not None
    rag_plan = rag.plan(qo, kv_indptr, q_data_type="bfloat16")
    assert rag_plan.impl == "prefill_mosaic" and rag_plan.alt is None
    with pytest.raises(ValueError, match="got q float32, k float32"):
        rag.run(q, q[:, :2], q[:, :2], rag_plan)
    attn = ji.BatchAttention(8, 2, 128, 16)
    plan = attn.plan(qo, indptr, indices, last, num_pages=num_pages, q_data_type="float16")
    assert plan.long.alt is None
    with pytest.raises(ValueError, match="q_data_type=float16"):
        attn.run(q, cache, plan)
    with pytest.raises(ValueError, match="kv_data_type needs q_data_type"):
        pre.plan(qo, indptr, indices, last, num_pages=num_pages, kv_data_type="bfloat16")
    with pytest.raises(ValueError, match="must name dtypes"):
        pre.plan(qo, indptr, indices, last, num_pages=num_pages, q_data_type=object())
    with pytest.raises(ValueError, match="no kernel takes q / K/V of dtypes float32"):
        dispatch.candidates(dispatch.Problem("prefill", 8, 2, 64, "paged", 16, interpret=False), "mosaic",
                            (np.dtype("float32"), np.dtype("float32")))


def test_plan_dtypes_run_as_the_plan_without_them(rng):
    """A plan told the dtypes it will run gives the output of one that was not (CPU: Triton)."""
    from helpers import page_table, randn, random_cache
    indptr, indices, last, num_pages = page_table(rng, np.array([40, 23]), 8)
    qo = np.array([0, 9, 16], np.int32)
    pre = ji.BatchPrefillWithPagedKVCache(4, 2, 32, 8)
    cache = random_cache(rng, num_pages, 8, 2, 32, jnp.float32)
    q = randn(rng, (16, 4, 32), jnp.float32)
    want = pre.run(q, cache, pre.plan(qo, indptr, indices, last, num_pages=num_pages))
    got = pre.run(q, cache, pre.plan(qo, indptr, indices, last, num_pages=num_pages, q_data_type=np.float32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
