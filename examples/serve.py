"""Continuous batching with prefix sharing: a small serving loop on jaxinfer.

    python examples/serve.py                     # CPU: tiny random model, a scenario of requests
    python examples/serve.py --check             # also run every request alone and compare
    python examples/serve.py --config llama3-8b --page-size 16 --num-pages 4096 --max-batch 64
    python examples/serve.py --chunk 32 --check  # chunked prefill mixed into decode steps
    python examples/serve.py --temperature 0.8 --top-p 0.9 --min-p 0.05   # sampled requests
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python examples/serve.py --tp 2 --check   # 2 devices
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python examples/serve.py --cp 2 --check   # context parallel

Requests arrive over time (some share a system prompt; some ask for n > 1 parallel samples),
join the running batch after their prefill and leave when done. The host side is NumPy:
a PageAllocator (free list, reference counts) and a PrefixCache (planner.prefix.RadixTree
over prompt pages, found again by content). Samples of a request, and requests with a
cached system prompt, reference the same full pages: nothing is copied. A decode step whose
batch shares pages runs two-level cascade attention (shared pages read once per group).
A greedy request's output is identical to running it alone (--check, tests/test_examples.py).

Sampling (--temperature > 0, with --top-k, --top-p, --min-p) runs on the device inside the step
through jaxinfer.sampling, with a jax.random key threaded from step to step (sampled tokens
depend on the seed and on the batch they run in). The n samples of a request take their first
token from one LM-head row of its prompt: each draws from it through jaxinfer.sampling's
`indices`. A step whose requests are all greedy takes an argmax only.

With --chunk N, each engine step is one forward pass, one attention call per layer
(ji.ragged_paged_attention, which also writes the step's K/V): a decode row for every
sequence past its prompt, plus up to N prompt tokens of the sequences still prefilling
(chunked prefill, in admission order).

--tp N shards the model over N devices (llama.py: weights column/row parallel and made on the
devices, the cache on KV heads): prefill, decode and cascade attention through
jaxinfer.sharding.head_parallel, the --chunk step through sharding.head_parallel_ragged; plans and
the step's other inputs replicated. The host side (allocator, prefix cache, plans) is unchanged.

--cp N splits every layer's cache on pages over N devices (llama.py; the weights replicated): a
request's pages are spread evenly over the devices at admission, listed device by device (a
shared prefix's pages first, then each sample's own on the same or later devices), and prefill
and decode attend through jaxinfer.sharding.context_parallel with one plan per device
(context_plan(fixed_shapes=True): the steps compile once, as without CP), the --chunk step
through sharding.context_parallel_ragged (device-planned: each device writes the rows of its
pages and attends over its share). Decode steps that share prefixes run the two-level cascade
with each level's pages split over the devices (sharding.split_cascade_levels; --cascade always);
--cp runs without --tp.
"""
import argparse
import dataclasses
import functools
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxinfer as ji
import llama
from jaxinfer import sharding
from planner.allocator import PageAllocator, PrefixCache, page_table, pad

CASCADE_MODES = ("always", "auto", "off")
FILTERS = ("top_k", "top_p", "min_p")  # the sampling filters (llama.Sampler's switches)


@dataclasses.dataclass(frozen=True)
class Request:
    """prompt int32[n]; n samples of max_new_tokens tokens each; arrives at engine step `arrival`.
    temperature 0 is greedy; otherwise top_k (0: off), top_p (1: off) and min_p (0: off) filter
    the draws (llama.Sampler: top-k, then top-p, then min-p)."""
    rid: int
    prompt: np.ndarray
    max_new_tokens: int
    n: int = 1
    temperature: float = 0.0
    arrival: int = 0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


@dataclasses.dataclass
class Sequence:
    """One sample of a request: its page list (shared prefix pages first) and KV length."""
    request: Request
    sample: int
    pages: np.ndarray
    shared_pages: int       # leading pages shared through the prefix cache (locked there)
    length: int             # tokens whose K/V are in the cache (or written by this step's prefill)
    prefill_from: int       # first prompt position this sequence's prefill computes
    tokens: list = dataclasses.field(default_factory=list)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["kv_lens", "page_indices", "cu_q_lens", "distribution"],
                   meta_fields=["pages_per_layer", "num_ctas", "mesh"])
@dataclasses.dataclass(frozen=True)
class RaggedAttention:
    """One mixed step's attention for every layer: ji.ragged_paged_attention writes the step's
    K/V and attends (the arguments as RPA v3's; page ids of one layer). pages_per_layer: a
    stacked cache (scan) holds layer l's page p at l * pages_per_layer + p. mesh: tensor
    parallel over its "tp" axis (sharding.head_parallel_ragged; q, k, v and the cache on heads),
    or context parallel over its "cp" axis (sharding.context_parallel_ragged; the cache on pages,
    each sequence's pages device by device)."""
    kv_lens: Any
    page_indices: Any
    cu_q_lens: Any
    distribution: Any
    pages_per_layer: int
    num_ctas: Any = None
    mesh: Any = None

    def __call__(self, layer, q, k, v, kv_cache):
        pages = self.page_indices if layer is None else self.page_indices + layer * self.pages_per_layer
        if self.mesh is None:
            run = functools.partial(ji.ragged_paged_attention, num_ctas=self.num_ctas)
        elif "cp" in self.mesh.axis_names:
            run = sharding.context_parallel_ragged(self.mesh, num_ctas=self.num_ctas)
        else:
            run = sharding.head_parallel_ragged(self.mesh, num_ctas=self.num_ctas)
        return run(q, k, v, kv_cache, self.kv_lens, pages, self.cu_q_lens, self.distribution)


class Engine:
    """Continuous batching over one paged KV cache. Compiles three steps once (prefill, decode,
    cascade decode), or with chunk one mixed step, and reuses them for every run().

    page_size, num_pages: the cache (pages per layer). max_batch: sequences decoded together;
    max_prefill_tokens: prompt tokens prefilled per step; max_len: KV tokens per sequence.
    cascade: "always" (two-level cascade whenever pages are shared), "auto" (decode plan's
    cost estimate decides) or "off". chunk N: every step is one forward pass (decode rows plus up
    to N prompt tokens, see _mixed_step); cascade does not apply. filters: the sampling filters
    that requests may use (a subset of FILTERS; each one compiled into the sampling step).
    seed: of the weights and of the sampling key. cfg.tp > 1: tensor parallel over the first
    cfg.tp devices; cp > 1: context parallel over the first cp devices, num_pages / cp pages on
    each (see the module docstring).
    """

    def __init__(self, cfg, *, seed=0, page_size=8, num_pages=128, max_batch=8,
                 max_prefill_tokens=256, max_len=128, cascade="always", chunk=None, filters=(), cp=1):
        if cascade not in CASCADE_MODES:
            raise ValueError(f"cascade must be one of {CASCADE_MODES}, got {cascade!r}")
        if not set(filters) <= set(FILTERS):
            raise ValueError(f"filters must be drawn from {FILTERS}, got {filters!r}")
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        for name, value in (("page_size", page_size), ("num_pages", num_pages), ("max_batch", max_batch),
                            ("max_prefill_tokens", max_prefill_tokens), ("max_len", max_len)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.cfg, self.page_size, self.num_pages = cfg, page_size, num_pages
        self.max_batch, self.max_prefill_tokens, self.max_len = max_batch, max_prefill_tokens, max_len
        self.cascade_mode, self.chunk, self.seed, self.filters = cascade, chunk, seed, tuple(filters)
        self.index_cap = max_batch * -(-max_len // page_size)  # page-table entries of a batch
        if not 1 <= cfg.tp <= len(jax.devices()):
            raise ValueError(f"cfg.tp must lie in [1, {len(jax.devices())}] (the devices there are), got {cfg.tp}")
        if not 1 <= cp <= len(jax.devices()):
            raise ValueError(f"cp must lie in [1, {len(jax.devices())}] (the devices there are), got {cp}")
        if cp > 1 and (cfg.tp > 1 or cfg.layer_loop != "unroll"):
            raise ValueError("cp > 1 runs with cfg.tp = 1 and cfg.layer_loop 'unroll' (a stacked cache's layers "
                             "would not keep each device's pages)")
        if num_pages % cp:
            raise ValueError(f"num_pages ({num_pages}) must be a multiple of cp ({cp}): each device holds a share")
        self.cp, self.local_pages = cp, num_pages // cp  # a device's pages (all of them without CP)
        self.mesh = None
        if cfg.tp > 1:
            self.mesh = Mesh(np.asarray(jax.devices()[:cfg.tp]), ("tp",))
        elif cp > 1:
            self.mesh = Mesh(np.asarray(jax.devices()[:cp]), ("cp",))
        graphdef, self.params = llama.build(cfg, seed, self.mesh)
        # By greedy: an argmax only when every row of the step is greedy, else jaxinfer.sampling.
        self.step_fns = {True: llama.make_step(graphdef, mesh=self.mesh),
                         False: llama.make_step(graphdef, llama.Sampler(False, **{f: True for f in filters}),
                                                self.mesh)}
        hs = cfg.heads  # per-device heads (all of them without TP)
        heads = (hs.num_qo_heads, hs.num_kv_heads, cfg.head_dim, page_size)
        opts = {} if jax.default_backend() == "gpu" else {"num_ctas": 8}  # interpret mode: small grid
        self.num_ctas = opts.get("num_ctas")
        self.prefill = ji.BatchPrefillWithPagedKVCache(
            *heads, causal=True, max_batch_size=max_batch, max_num_tokens=max_prefill_tokens,
            max_num_pages=self.index_cap, tile_rows=32, **opts)
        self.decode = ji.BatchDecodeWithPagedKVCache(
            *heads, max_batch_size=max_batch, max_num_pages=self.index_cap, **opts)
        self.cascade = ji.MultiLevelCascadeAttention(
            2, *heads, causal=False, max_batch_size=max_batch, max_num_tokens=max_batch,
            max_num_pages=self.index_cap, tile_rows=16, **opts)

    def check(self, request):
        """Raises ValueError if the request can never run on this engine."""
        total = len(request.prompt) + request.max_new_tokens - 1
        if len(request.prompt) < 1 or request.max_new_tokens < 1 or request.n < 1:
            raise ValueError(f"request {request.rid}: prompt, max_new_tokens and n must be >= 1")
        if total > self.max_len:
            raise ValueError(f"request {request.rid}: prompt + max_new_tokens - 1 = {total} > max_len={self.max_len}")
        if request.n > self.max_batch:
            raise ValueError(f"request {request.rid}: n={request.n} > max_batch={self.max_batch}")
        if request.n * len(request.prompt) > self.max_prefill_tokens:
            raise ValueError(f"request {request.rid}: n * prompt tokens > max_prefill_tokens={self.max_prefill_tokens}")
        pages = -(-total // self.page_size)
        if request.n * pages > self.num_pages:
            raise ValueError(f"request {request.rid}: needs more pages than num_pages={self.num_pages}")
        if request.n * -(-pages // self.cp) > self.local_pages:  # an even spread on an empty cache
            raise ValueError(f"request {request.rid}: needs more pages than a device holds ({self.local_pages})")
        if np.any((request.prompt < 0) | (request.prompt >= self.cfg.vocab_size)):
            raise ValueError(f"request {request.rid}: prompt holds token ids outside [0, {self.cfg.vocab_size})")
        r = request
        if r.temperature < 0 or r.top_k < 0 or not 0 < r.top_p <= 1 or not 0 <= r.min_p <= 1:
            raise ValueError(f"request {r.rid}: need temperature >= 0, top_k >= 0, 0 < top_p <= 1, 0 <= min_p <= 1")
        used = [f for f, on in zip(FILTERS, (r.top_k > 0, r.top_p < 1, r.min_p > 0)) if on]
        if not set(used) <= set(self.filters):
            raise ValueError(f"request {r.rid}: uses sampling filters {used}; this engine has {self.filters}")

    def run(self, requests, log=None):
        """Serves `requests` to completion. Returns {rid: [n token lists]}; self.stats holds counters.
        log: optional callable taking one line per engine step."""
        for r in requests:
            self.check(r)
        if len({r.rid for r in requests}) != len(requests):
            raise ValueError("requests must have distinct rid")
        self.allocator = PageAllocator(self.num_pages, num_shards=self.cp)
        self.prefix_cache = PrefixCache(self.allocator, self.page_size)
        self.kv_cache = llama.paged_kv_cache(self.cfg, self.num_pages, self.page_size, self.mesh)
        self.key = self._put(jax.random.key(self.seed))
        self.stats = dict(steps=0, prefill_tokens=0, cached_prompt_tokens=0, cascade_steps=0,
                          page_reads_saved=0, peak_pages=0, peak_pages_unshared=0, shared_logits_rows=0)
        pending = sorted(requests, key=lambda r: (r.arrival, r.rid))
        waiting, running, outputs = [], [], {}
        step = 0
        while pending or waiting or running:
            while pending and pending[0].arrival <= step:
                waiting.append(pending.pop(0))
            admitted = self._admit(waiting, running)
            notes = [f"+r{s.request.rid}" for s in admitted if s.sample == 0]
            if self.chunk is not None:
                running.extend(admitted)  # admission order: prompts are chunked in this order
                if running:
                    notes.append(self._mixed_step(running))
                running, finished = self._retire(running, outputs)
            else:
                if admitted:
                    self._prefill(admitted)
                    running.extend(admitted)
                running, finished = self._retire(running, outputs)
                if running:
                    notes.append(self._decode(running))
                    running, done = self._retire(running, outputs)
                    finished += done
            notes += [f"-r{rid}" for rid in finished]
            self._count_pages(running)
            if log is not None and notes:
                log(f"step {step:3d} | batch {len(running):2d} | free pages {self.allocator.num_free:4d} | "
                    + " ".join(notes))
            step += 1
        self.stats["steps"] = step
        return outputs

    def _admit(self, waiting, running):
        """Admits waiting requests (in arrival order) while batch slots, prefill tokens and pages
        last. Returns the new sequences."""
        ps, new, budget = self.page_size, [], self.max_prefill_tokens
        while waiting:
            r = waiting[0]
            plen = len(r.prompt)
            shared = (plen - 1) // ps  # full pages before the last prompt token: shareable
            cached = self.prefix_cache.match(r.prompt, shared)
            tail_from = shared * ps
            prefill_tokens = (plen - len(cached) * ps) + (r.n - 1) * (plen - tail_from)
            own = -(-(plen + r.max_new_tokens - 1) // ps) - shared  # each sample's own pages
            need = shared - len(cached) + r.n * own
            if len(running) + len(new) + r.n > self.max_batch or prefill_tokens > budget:
                break
            self.prefix_cache.lock(r.prompt, len(cached))  # keep the matched pages through eviction
            places = self._place(cached, shared, own, r.n)
            if places is None:
                self.prefix_cache.evict(need if self.cp > 1 else need - self.allocator.num_free)
                places = self._place(cached, shared, own, r.n)
            if places is None:
                self.prefix_cache.lock(r.prompt, len(cached), -1)
                break
            waiting.pop(0)
            budget -= prefill_tokens
            prefix = np.concatenate([cached, self._alloc(places[0])])
            self.allocator.ref(np.repeat(cached, r.n))        # every sample references the cached pages
            self.allocator.ref(np.repeat(prefix[len(cached):], r.n - 1))  # and the new shared ones
            self.prefix_cache.insert(r.prompt, prefix)
            self.prefix_cache.lock(r.prompt, shared, r.n)      # one lock per sample
            self.prefix_cache.lock(r.prompt, len(cached), -1)
            self.stats["cached_prompt_tokens"] += len(cached) * ps
            for j in range(r.n):
                pages = np.concatenate([prefix, self._alloc(places[1 + j])])
                start = len(cached) * ps if j == 0 else tail_from
                new.append(Sequence(r, j, pages, shared, plen, start))
        return new

    def _place(self, cached, shared, own, n):
        """Where a new request's pages go: [its new shared pages, then each of its n samples' own
        pages], or None where they do not fit. Page counts; under CP, each page's device: position
        i of a sample's shared + own pages on its even-split device, or the next one with a free
        page, never before the previous page's (split_page_table wants them device by device)."""
        if self.cp == 1:
            fits = self.allocator.num_free >= shared - len(cached) + n * own
            return [shared - len(cached)] + [own] * n if fits else None
        free, total = self.allocator.free_per_shard(), shared + own
        base, extra = divmod(total, self.cp)
        ends = np.cumsum(base + (np.arange(self.cp) < extra))  # the even split's last positions + 1

        def spread(start, stop, floor):
            shards = []
            for i in range(start, stop):
                floor = max(floor, int(np.searchsorted(ends, i, side="right")))
                while floor < self.cp and free[floor] == 0:
                    floor += 1
                if floor == self.cp:
                    return None
                free[floor] -= 1
                shards.append(floor)
            return shards

        first = int(cached[-1]) // self.local_pages if len(cached) else 0
        places = [spread(len(cached), shared, first)]
        if places[0] is not None:
            floor = places[0][-1] if places[0] else first
            places += [spread(shared, total, floor) for _ in range(n)]
        return None if any(p is None for p in places) else places

    def _alloc(self, place):
        """Fresh pages of one _place entry (a count, or each page's device, ascending)."""
        if not isinstance(place, list):
            return self.allocator.alloc(place)
        shards, counts = np.unique(np.asarray(place, np.int64), return_counts=True)
        return np.concatenate([self.allocator.alloc(int(c), shard=int(k)) for k, c in zip(shards, counts)]
                              + [np.zeros(0, np.int32)])

    def _context_attention(self, wrapper, kv_indptr, kv_indices, last, rows, positions, levels=None, **plan_args):
        """PagedAttention of one CP step: the page table split on the devices' pages, one plan
        per device (one shape for every step; levels: the cascade's, each split the same way),
        each device's append table (rows, positions: padded host int32[cap], -1 for padding rows)."""
        split = sharding.split_page_table(kv_indptr, kv_indices, last, self.page_size, self.cp,
                                          pages_per_shard=self.local_pages, **plan_args)
        if levels is not None:
            levels = sharding.split_cascade_levels(levels, self.page_size, self.cp, pages_per_shard=self.local_pages)
            plan = sharding.context_plan(wrapper, levels, num_pages=self.num_pages)
        else:
            plan = sharding.context_plan(wrapper, split, num_pages=self.num_pages, fixed_shapes=True,
                                         **({"q_data_type": self.cfg.dtype} if "qo_indptr" in plan_args else {}))
        rows, positions, indptr, indices = llama.context_append_tables(split, rows, positions, self.index_cap)
        indptr = np.pad(indptr, ((0, 0), (0, self.max_batch + 1 - indptr.shape[1])), mode="edge")
        return llama.PagedAttention(wrapper, self.num_pages, plan, rows, positions, indptr, indices, mesh=self.mesh)

    def _prefill(self, seqs):
        """One prefill call: each sequence computes prompt[prefill_from:] and samples its first token."""
        qo_lens = np.array([s.length - s.prefill_from for s in seqs])
        qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
        nnz = int(qo_indptr[-1])
        kv_indptr, kv_indices, last = page_table([s.pages for s in seqs], [s.length for s in seqs], self.page_size)
        tokens = np.concatenate([s.request.prompt[s.prefill_from:] for s in seqs]).astype(np.int32)
        positions = np.concatenate([np.arange(s.prefill_from, s.length) for s in seqs]).astype(np.int32)
        rows = np.repeat(np.arange(len(seqs)), qo_lens).astype(np.int32)
        cap, bcap = self.max_prefill_tokens, self.max_batch
        if self.cp > 1:
            attention = self._context_attention(self.prefill, kv_indptr, kv_indices, last, pad(rows, cap, -1),
                                                pad(positions, cap, -1), qo_indptr=qo_indptr, causal=True)
        else:
            plan = self.prefill.plan(qo_indptr, kv_indptr, kv_indices, last, num_pages=self.num_pages,
                                     q_data_type=self.cfg.dtype)
            attention = llama.PagedAttention(
                self.prefill, self.num_pages, plan, pad(rows, cap, -1), pad(positions, cap, -1),
                pad(kv_indptr, bcap + 1, kv_indptr[-1]), pad(kv_indices, self.index_cap), mesh=self.mesh)
        first = self._step(seqs, pad(tokens, cap), pad(positions, cap, -1), attention, qo_indptr[1:] - 1)
        for s, t in zip(seqs, first):
            s.tokens.append(int(t))
        self.stats["prefill_tokens"] += nnz

    def _mixed_step(self, running):
        """One forward pass for the step (chunk mode): a decode row for each sequence past its
        prompt (first, as ragged_paged_attention's distribution wants), then prompt chunks of at
        most self.chunk tokens in all, in admission order. A sequence's chunk runs only once every
        earlier sequence's prompt is written (in an earlier step or this one): it may read their
        pages (a sample's shared prefix, the prefix cache). A chunk that ends its prompt samples the
        first token."""
        decoding = [s for s in running if s.tokens]
        chunks, budget = [], self.chunk
        for s in running:
            if s.tokens:
                continue
            n = min(s.length - s.prefill_from, budget)
            if n == 0:
                break
            chunks.append((s, s.prefill_from, s.prefill_from + n))
            budget -= n
            if s.prefill_from + n < s.length:
                break  # later prompts wait for this one
        q_lens = [1] * len(decoding) + [b - a for _, a, b in chunks]
        kv_lens = [s.length + 1 for s in decoding] + [b for _, _, b in chunks]
        seqs = decoding + [s for s, _, _ in chunks]
        tokens = [s.tokens[-1] for s in decoding] + [t for s, a, b in chunks for t in s.request.prompt[a:b]]
        positions = [s.length for s in decoding] + [p for _, a, b in chunks for p in range(a, b)]
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        sampled = decoding + [s for s, _, b in chunks if b == s.length]  # rows that sample a token
        last_rows = [cu[i + 1] - 1 for i in range(len(decoding))] + [
            cu[len(decoding) + j + 1] - 1 for j, (s, _, b) in enumerate(chunks) if b == s.length]
        pages_per_seq = -(-self.max_len // self.page_size)
        page_indices = np.zeros((self.max_batch, pages_per_seq), np.int32)
        for i, s in enumerate(seqs):
            page_indices[i, :len(s.pages)] = s.pages
        bcap, tcap = self.max_batch, self.max_batch + self.chunk
        attention = RaggedAttention(
            pad(np.asarray(kv_lens, np.int32), bcap), page_indices.reshape(-1), pad(cu, bcap + 1, cu[-1]),
            np.array([len(decoding), len(decoding), len(seqs)], np.int32), self.num_pages, self.num_ctas, self.mesh)
        out = self._step(sampled, pad(np.asarray(tokens, np.int32), tcap),
                         pad(np.asarray(positions, np.int32), tcap, -1), attention, last_rows)
        for s in decoding:
            s.length += 1
        for s, _, b in chunks:
            s.prefill_from = b
        for s, t in zip(sampled, out):
            s.tokens.append(int(t))
        self.stats["prefill_tokens"] += int(sum(b - a for _, a, b in chunks))
        return f"mixed ({len(decoding)} decode, {len(chunks)} prompt chunk(s))"

    def _decode(self, running):
        """One decode step for every running sequence (sorted so that shared prefixes are adjacent)."""
        running.sort(key=lambda s: (tuple(s.pages[:s.shared_pages]), s.request.rid, s.sample))
        batch = len(running)
        lens = np.array([s.length + 1 for s in running])  # after appending the last sampled token
        kv_indptr, kv_indices, last = page_table([s.pages for s in running], lens, self.page_size)
        positions = (lens - 1).astype(np.int32)
        bcap = self.max_batch
        rows = pad(np.arange(batch, dtype=np.int32), bcap, -1)
        if self.cp > 1:  # (cascade "auto" is the decode wrapper's choice, which has no CP path)
            levels, note = self._shared_levels(kv_indptr, kv_indices, last)
            wrapper, note = (self.decode, "decode") if levels is None else (self.cascade, note)
            attention = self._context_attention(wrapper, kv_indptr, kv_indices, last, rows, pad(positions, bcap, -1),
                                                levels=levels)
        else:
            plan, wrapper, note = self._decode_plan(kv_indptr, kv_indices, last)
            attention = llama.PagedAttention(
                wrapper, self.num_pages, plan, rows, pad(positions, bcap, -1), pad(kv_indptr, bcap + 1, kv_indptr[-1]),
                pad(kv_indices, self.index_cap), mesh=self.mesh)
        tokens = np.array([s.tokens[-1] for s in running], np.int32)
        out = self._step(running, pad(tokens, bcap), pad(positions, bcap, -1), attention, None)
        for s, t in zip(running, out):
            s.length += 1
            s.tokens.append(int(t))
        return note

    def _shared_levels(self, kv_indptr, kv_indices, last):
        """(the two cascade levels, the step's note) of a decode step whose batch shares pages
        (cascade "always"), counted in self.stats; else (None, None)."""
        if self.cascade_mode != "always":
            return None, None
        batch = kv_indptr.shape[0] - 1
        levels, saved = ji.two_level_cascade(np.arange(batch + 1, dtype=np.int32), kv_indptr, kv_indices, last,
                                             self.page_size, causal=False)
        if not saved:
            return None, None
        self.stats["cascade_steps"] += 1
        self.stats["page_reads_saved"] += saved
        groups = int(np.count_nonzero(np.diff(levels[0].kv_indptr)))
        return levels, f"cascade ({groups} shared prefix group(s), {saved} page reads saved)"

    def _decode_plan(self, kv_indptr, kv_indices, last):
        """(plan, wrapper, note): a two-level cascade where the batch shares pages (per cascade mode)."""
        levels, note = self._shared_levels(kv_indptr, kv_indices, last)
        if levels is not None:
            return self.cascade.plan(levels, num_pages=self.num_pages), self.cascade, note
        plan = self.decode.plan(kv_indptr, kv_indices, last, num_pages=self.num_pages,
                                cascade="auto" if self.cascade_mode == "auto" else None)
        if isinstance(plan, ji.CascadePlan):
            self.stats["cascade_steps"] += 1
            return plan, self.decode, "cascade (auto)"
        return plan, self.decode, "decode"

    def _step(self, seqs, tokens, positions, attention, last_rows):
        """One call of the jitted step, sampling a token for each of seqs (host int32[len(seqs)]).
        last_rows[i]: the token row of seqs[i]'s logits (None: row i, decode). Samples of one
        request that end their prompt in this step share one LM-head row (the same logits):
        each draws from it through SamplingParams.indices. The step is greedy (argmax only)
        when every sequence is; the sampling key is threaded on the device."""
        bcap, reqs = self.max_batch, [s.request for s in seqs]
        logits_index, indices, row_of = None, np.arange(len(seqs)), {}
        if last_rows is not None:
            rows = []
            for i, (s, row) in enumerate(zip(seqs, last_rows)):
                owner = (s.request.rid, s.sample if s.tokens else -1)  # samples share the prompt's row
                if owner not in row_of:
                    row_of[owner] = len(rows)
                    rows.append(row)
                indices[i] = row_of[owner]
            self.stats["shared_logits_rows"] += len(seqs) - len(rows)
            logits_index = pad(np.asarray(rows, np.int32), bcap)
        sampling = llama.SamplingParams(
            pad(np.array([r.temperature for r in reqs], np.float32), bcap),
            pad(np.array([r.top_k for r in reqs], np.int32), bcap),
            pad(np.array([r.top_p for r in reqs], np.float32), bcap, 1.0),
            pad(np.array([r.min_p for r in reqs], np.float32), bcap), pad(indices.astype(np.int32), bcap))
        step_fn = self.step_fns[all(r.temperature == 0 for r in reqs)]
        inputs = self._put((tokens, positions, attention, logits_index, sampling))
        out, self.kv_cache, self.key = step_fn(self.params, *inputs[:2], self.kv_cache, *inputs[2:], self.key)
        return np.asarray(out)[:len(seqs)]

    def _put(self, tree):
        """Host inputs as the step takes them: as they are on one device, replicated over the mesh under TP."""
        return tree if self.mesh is None else jax.device_put(tree, NamedSharding(self.mesh, P()))

    def _retire(self, running, outputs):
        """Removes finished sequences (freeing their page references and prefix locks). Returns
        (still running, rids of requests whose last sample finished)."""
        keep, finished = [], []
        for s in running:
            if len(s.tokens) < s.request.max_new_tokens:
                keep.append(s)
                continue
            self.allocator.free(s.pages)
            self.prefix_cache.lock(s.request.prompt, s.shared_pages, -1)
            samples = outputs.setdefault(s.request.rid, [None] * s.request.n)
            samples[s.sample] = s.tokens
            if all(x is not None for x in samples):
                finished.append(s.request.rid)
        return keep, finished

    def _count_pages(self, running):
        """Peak pages in use, and what the same sequences would use without sharing."""
        used = self.num_pages - self.allocator.num_free
        unshared = sum(len(s.pages) for s in running)
        self.stats["peak_pages"] = max(self.stats["peak_pages"], used)
        self.stats["peak_pages_unshared"] = max(self.stats["peak_pages_unshared"], unshared)


def make_requests(vocab_size, rng, num_requests=6, *, system_prompts=(40, 27), user_len=(3, 12),
                  max_new_tokens=(4, 10), samples=(1, 3), arrivals=6, **sampling):
    """A scenario: each request is a random system prompt (shared between requests) plus its own
    user tokens, with n in [samples] parallel samples, arriving at a random step < arrivals.
    sampling: Request's temperature, top_k, top_p, min_p for every request."""
    systems = [rng.integers(0, vocab_size, n) for n in system_prompts]
    requests = []
    for rid in range(num_requests):
        prompt = np.concatenate([systems[rid % len(systems)],
                                 rng.integers(0, vocab_size, int(rng.integers(user_len[0], user_len[1] + 1)))])
        requests.append(Request(rid, prompt.astype(np.int32),
                                int(rng.integers(max_new_tokens[0], max_new_tokens[1] + 1)),
                                n=int(rng.integers(samples[0], samples[1] + 1)),
                                arrival=int(rng.integers(0, arrivals)), **sampling))
    return requests


def mismatches_against_alone(engine, requests, outputs):
    """rids of greedy requests whose batched outputs differ from serving the request alone on the
    same engine (sampled tokens depend on the batch: they are not compared)."""
    bad = []
    for r in requests:
        if r.temperature:
            continue
        alone = engine.run([dataclasses.replace(r, arrival=0)])
        if alone[r.rid] != outputs[r.rid]:
            bad.append(r.rid)
    return bad


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", choices=sorted(llama.CONFIGS),
                    help="model shapes (weights are random); tiny runs on CPU")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the config's)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor parallel over the first N devices (heads, MLP columns and the cache split)")
    ap.add_argument("--cp", type=int, default=1,
                    help="context parallel over the first N devices (every layer's cache split on pages)")
    ap.add_argument("--requests", type=int, default=8, help="requests in the scenario")
    ap.add_argument("--page-size", type=int, default=8, help="tokens per KV cache page")
    ap.add_argument("--num-pages", type=int, default=128, help="cache pages per layer")
    ap.add_argument("--max-batch", type=int, default=8, help="sequences decoded together")
    ap.add_argument("--max-prefill-tokens", type=int, default=256, help="prompt tokens prefilled per step")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="sample from the smallest set of top tokens holding this much probability (1: all)")
    ap.add_argument("--min-p", type=float, default=0.0,
                    help="sample among the tokens with p >= min_p * the top token's p (0: all)")
    ap.add_argument("--cascade", default="always", choices=CASCADE_MODES,
                    help="always: two-level cascade whenever pages are shared; auto: the decode "
                         "plan's cost estimate decides; off: plain decode")
    ap.add_argument("--chunk", type=int, default=None,
                    help="one forward pass (ragged_paged_attention) per step: decode rows plus up to "
                         "N prompt tokens (chunked prefill)")
    ap.add_argument("--check", action="store_true", help="also serve each request alone and compare")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the scenario")
    args = ap.parse_args(argv)
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    filters = [f for f, on in zip(FILTERS, (args.top_k > 0, args.top_p < 1, args.min_p > 0)) if on]
    if filters and args.temperature == 0:
        raise ValueError("--top-k, --top-p and --min-p filter samples: give a --temperature > 0 (0 is greedy)")
    cfg = llama.get_config(args.config, args.layers, tp=args.tp)
    engine = Engine(cfg, seed=args.seed, page_size=args.page_size, num_pages=args.num_pages,
                    max_batch=args.max_batch, max_prefill_tokens=args.max_prefill_tokens, cascade=args.cascade,
                    chunk=args.chunk, filters=filters, cp=args.cp)
    requests = make_requests(cfg.vocab_size, np.random.default_rng(args.seed), args.requests, **sampling)
    for r in requests:
        print(f"r{r.rid}: arrives at step {r.arrival}, prompt {len(r.prompt)} tokens, n={r.n}, "
              f"{r.max_new_tokens} new tokens")
    t = time.perf_counter()
    outputs = engine.run(requests, log=print)
    elapsed = time.perf_counter() - t
    st = engine.stats
    print(f"{st['steps']} steps in {elapsed:.1f} s (compiles included); prefilled {st['prefill_tokens']} "
          f"tokens, {st['cached_prompt_tokens']} prompt tokens found in the prefix cache; cascade in "
          f"{st['cascade_steps']} decode steps ({st['page_reads_saved']} page reads saved); peak pages "
          f"{st['peak_pages']} (without sharing: {st['peak_pages_unshared']})")
    for r in requests:
        print(f"r{r.rid}: " + " | ".join(" ".join(map(str, s)) for s in outputs[r.rid]))
    if args.check:
        bad = mismatches_against_alone(engine, requests, outputs)
        print("greedy requests identical to serving each alone" if not bad else f"differ when alone: {bad}")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
