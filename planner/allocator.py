"""Host-side KV page management for serving loops (NumPy only).

PageAllocator: a free list of page ids with reference counts, so sequences that share a
prompt prefix reference the same full pages (no copies). PrefixCache: full pages of earlier
prompts, found again by token content through a planner.prefix.RadixTree (longest-prefix
match, LRU eviction, locks). page_table / pad: a batch's CSR page table as plan() takes it,
and fixed-capacity copies of index arrays for jitted steps.
"""
import itertools

import numpy as np

from planner.prefix import RadixTree


class PageAllocator:
    """Page ids [0, num_pages) with reference counts.

        alloc = PageAllocator(64)
        pages = alloc.alloc(3)      # fresh pages, reference count 1
        alloc.ref(pages[:2])        # another sequence shares the first two
        alloc.free(pages)           # drops one reference each; returns the pages now free

    num_shards: the pages of a cache split on pages over devices (jaxinfer.sharding's
    pages_per_shard): shard k holds ids [k N, (k + 1) N), N = num_pages / num_shards, and
    alloc(n, shard=k) takes pages of shard k only.
    """

    def __init__(self, num_pages, *, num_shards=1):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if num_shards < 1 or num_pages % num_shards:
            raise ValueError(f"num_shards must be >= 1 and divide num_pages ({num_pages}), got {num_shards}")
        self.num_pages, self.num_shards = int(num_pages), int(num_shards)
        self.pages_per_shard = self.num_pages // self.num_shards
        self.refcount = np.zeros(self.num_pages, np.int32)
        n = self.pages_per_shard  # one stack per shard: its lowest page is handed out first
        self._free = [list(range((k + 1) * n - 1, k * n - 1, -1)) for k in range(self.num_shards)]

    @property
    def num_free(self):
        return sum(map(len, self._free))

    def free_per_shard(self):
        """int64[num_shards]: the free pages of each shard."""
        return np.array([len(f) for f in self._free], np.int64)

    def alloc(self, n, *, shard=None):
        """n fresh pages (reference count 1) as int32[n]: of `shard`, or (None) of the first
        shards with free pages, in shard order."""
        if shard is not None and not 0 <= shard < self.num_shards:
            raise ValueError(f"shard must lie in [0, {self.num_shards}), got {shard}")
        stacks = self._free if shard is None else [self._free[shard]]
        free = sum(map(len, stacks))
        if not 0 <= n <= free:
            raise ValueError(f"n must lie in [0, {free}] (the free pages), got {n}")
        pages = []
        for stack in stacks:
            while stack and len(pages) < n:
                pages.append(stack.pop())
        pages = np.array(pages, np.int32)
        self.refcount[pages] = 1
        return pages

    def ref(self, pages):
        """Adds one reference to each of `pages` (allocated pages that another sequence shares)."""
        pages = self._check(pages, release=False)
        np.add.at(self.refcount, pages, 1)

    def free(self, pages):
        """Drops one reference per entry of `pages`; pages left with none return to the free
        list. Returns those pages (int32)."""
        pages = self._check(pages, release=True)
        np.add.at(self.refcount, pages, -1)
        released = np.unique(pages[self.refcount[pages] == 0]).astype(np.int32)
        for page in released[::-1].tolist():
            self._free[page // self.pages_per_shard].append(page)
        return released

    def _check(self, pages, release):
        pages = np.asarray(pages).reshape(-1)
        if pages.size and not np.issubdtype(pages.dtype, np.integer):
            raise ValueError(f"pages must hold integer page ids, got {pages.dtype}")
        pages = pages.astype(np.int64)
        if pages.size and (pages.min() < 0 or pages.max() >= self.num_pages):
            raise ValueError(f"pages holds ids outside [0, {self.num_pages})")
        if np.any(self.refcount[pages] < 1):
            raise ValueError("pages holds pages that are not allocated")
        if release and np.any(np.bincount(pages, minlength=self.num_pages) > self.refcount):
            raise ValueError("pages drops more references than are held")
        return pages


class PrefixCache:
    """Full KV pages of earlier prompts, found again by token content.

        cache = PrefixCache(allocator, page_size)
        pages = cache.match(tokens, max_pages)   # pages holding the longest cached prefix
        cache.insert(tokens, pages)              # list a prompt's full pages (takes a reference)
        cache.evict(n)                           # drop least-recently-used unlocked pages

    Page i of a prompt holds tokens [i * P, (i + 1) * P); its key is the pair (key of page
    i - 1, its tokens), so equal keys mean equal token prefixes (exact, no hashing). The
    RadixTree indexes key sequences. The cache holds one reference on every page it lists,
    so a listed page outlives the sequences that wrote it until it is evicted.
    """

    def __init__(self, allocator, page_size):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator, self.page_size = allocator, int(page_size)
        self.tree = RadixTree()
        self._ids = {}      # (parent key, page tokens) -> key
        self._entry = {}    # key -> ((parent key, page tokens), page id)
        self._next_key = itertools.count()

    def __len__(self):
        """Pages listed (each holds one reference)."""
        return len(self._entry)

    def _keys(self, tokens, num_pages, create):
        """(key, (parent key, page tokens)) of the first num_pages full pages of tokens; stops
        at the first unknown page unless create."""
        if num_pages * self.page_size > len(tokens):
            raise ValueError(f"tokens has {len(tokens)} tokens, fewer than num_pages={num_pages} full pages")
        keys, parent = [], -1
        for i in range(num_pages):
            item = (parent, tuple(int(t) for t in tokens[i * self.page_size:(i + 1) * self.page_size]))
            if item not in self._ids:
                if not create:
                    break
                self._ids[item] = next(self._next_key)
            parent = self._ids[item]
            keys.append((parent, item))
        return keys

    def match(self, tokens, max_pages):
        """Pages (int32) holding the longest cached prefix of tokens' first max_pages full
        pages; marks them recently used. Takes no references."""
        keys = [k for k, _ in self._keys(tokens, max_pages, create=False)]
        n = self.tree.match(keys)
        return np.array([self._entry[k][1] for k in keys[:n]], np.int32)

    def insert(self, tokens, pages):
        """Lists pages[i] as holding page i of tokens (full pages only). Pages whose content is
        already listed keep the listed page; each newly listed page gets a reference."""
        keys = self._keys(tokens, len(pages), create=True)
        for (key, item), page in zip(keys, pages):
            if key not in self._entry:
                self._entry[key] = (item, int(page))
                self.allocator.ref([page])
        self.tree.insert([k for k, _ in keys])

    def lock(self, tokens, num_pages, delta=1):
        """Adds delta locks (delta=-1 unlocks) to the listed prefix of num_pages full pages of
        tokens: locked pages are never evicted."""
        keys = [k for k, _ in self._keys(tokens, num_pages, create=False)]
        if len(keys) != num_pages:
            raise ValueError(f"num_pages={num_pages} pages of tokens are not all listed (insert them first)")
        self.tree.insert(keys)  # a no-op but for splitting an edge where the prefix ends
        self.tree.lock(keys, delta)

    def evict(self, num_pages):
        """Unlists least-recently-used unlocked pages until num_pages pages have returned to the
        allocator or nothing is left to evict. Returns how many returned."""
        returned = 0
        while returned < num_pages:
            keys = self.tree.evict(num_pages - returned)
            if not keys:
                break
            for key in keys:
                item, page = self._entry.pop(key)
                del self._ids[item]
                returned += len(self.allocator.free([page]))
        return returned


def page_table(page_lists, kv_lens, page_size):
    """CSR page table of a batch: sequence b uses the first ceil(kv_lens[b] / page_size) pages of
    page_lists[b]. Returns (kv_indptr int32[B+1], kv_indices int32[nnz], kv_last_page_len int32[B])."""
    kv_lens = np.asarray(kv_lens, np.int64)
    if kv_lens.ndim != 1 or len(page_lists) != kv_lens.shape[0]:
        raise ValueError(f"kv_lens must be 1-D with one entry per page list ({len(page_lists)}), "
                         f"got shape {kv_lens.shape}")
    if np.any(kv_lens < 0):
        raise ValueError("kv_lens must be >= 0")
    npages = -(-kv_lens // page_size)
    for b, (pages, n) in enumerate(zip(page_lists, npages)):
        if len(pages) < n:
            raise ValueError(f"page_lists[{b}] has {len(pages)} pages; kv_lens[{b}] = {kv_lens[b]} needs {n}")
    kv_indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    kv_indices = np.concatenate([np.asarray(p[:n], np.int32) for p, n in zip(page_lists, npages)]
                                + [np.zeros(0, np.int32)])
    last = np.where(npages > 0, kv_lens - (npages - 1) * page_size, 1).astype(np.int32)
    return kv_indptr, kv_indices, last


def pad(x, size, fill=0):
    """x (1-D) extended to `size` entries with `fill` (fixed shapes for a jitted step)."""
    x = np.asarray(x)
    if x.ndim != 1 or x.shape[0] > size:
        raise ValueError(f"x must be 1-D with at most {size} entries, got shape {x.shape}")
    return np.concatenate([x, np.full(size - x.shape[0], fill, x.dtype)])
