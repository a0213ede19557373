"""A prefix cache across sampler calls: the KV of prompts (and of their completions) kept in a
bounded, content-keyed store, so a later request whose prompt starts with a cached prefix, e.g. the
next turn of a multi-turn episode (previous context + completion + tool output) or a prompt that
shares a system prompt, prefills only its uncached suffix.

Keys: a prompt is cut into blocks of `block` tokens; block i's key is a chain hash of blocks 0..i
(blake2b over the previous key and the block's ids, as vLLM and SGLang key theirs), so a lookup
walks the prompt's block keys and finds the longest cached block-aligned prefix. A hit is checked
token by token against the stored ids (a hash collision can never serve wrong KV), and leaves at
least one token to prefill (its logits start decoding).

Images: a prompt's image placeholders stand for their patches, so with images (`generate`'s
`patches`) a block's key also hashes the patch values at its placeholders: the same ids with
another image never share KV, the same image does (the image content is checked through the
128-bit key, not value by value). Blocks without a placeholder keep their text-only keys, so a
system prompt before the image is shared with text prompts. A hit never ends inside a run of
placeholders (it backs off to a block before the run): the suffix holds whole images, which a ViT
tower (`model.vision.encoder = vit`) encodes from all of an image's patches.

Layout: whole entries, one per cached sequence: its ids and, per layer, (k [K, Dh, L], v [K, L, Dh])
in host memory (numpy), L a multiple of `block`. The sampler's cache is one contiguous row per
sample (`kv_cache`), so a paged pool would be gathered into rows at every call anyway; whole
entries need one copy per hit and no block tables, and a multi-turn history (the workload that
pays) is linear: inserting an entry drops every entry that is a prefix of it, so the turns of one
episode hold one entry, not one per turn. Branches (many prompts after one system prompt) keep the
shared blocks once per entry: the bound counts them each time. Host memory keeps device memory for
the sampler's own cache; on a CPU it is the same memory, on an accelerator each call copies its
batch's final KV to the host once (a cost not measured here: no accelerator). A paged pool was not
built: whole entries already serve 73% of a multi-turn workload's prompt tokens (BENCHMARKS.md).

Bound: `max_tokens`, the sum of the entries' lengths; the least recently used entries (a hit or an
insert uses one) are evicted first. Weights: KV is only valid for the weights that computed it;
`bind` holds weak references to the weight arrays and empties the cache when they are not the same
objects (a new policy version after an RL update, or a restored checkpoint): stale KV is never used.

The sampler (`generate(..., prefix_cache=cache)`) runs `cached_program`: the cached KV of each row
is placed at positions 0..h-1 of its cache row, the suffix is run through the layers against it
(`engine.extend`: one scatter and one attention per layer), then decoding is `generate_program`'s.
The cached prefix length and the suffix length are bucketed to powers of two (as the prompt length
is), so programs are reused. The layers run as the plain sampler's do (`engine.decode_layers`):
unrolled on the CPU, each stack under a loop over its repeats on GPU/TPU, with the cache stacked to
match (entries stay per layer on the host; `kv_cache.to_stacked` / `to_layers` convert at the
call's edges). Outputs equal plain sampling up to float rounding (different reduction orders of
the same sums), not bit for bit: tested to 1e-5 on log-probs, identical tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.sampling import engine, kv_cache
from posttrain.sampling.generate import MIN_PROMPT_BUCKET, bucket, host_outputs, pad_patches, pad_prompts, sharding_key
from posttrain.sampling.rules import SamplingParams

BLOCK = 16


@dataclasses.dataclass(frozen=True)
class Images:
    """A sequence's images for its keys: patches [>= its length, patch_dim] float32 aligned with its
    ids, and the placeholder token id (`model.vision.image_token_id`) whose patches count."""

    patches: np.ndarray
    token_id: int


def block_keys(tokens: np.ndarray, block: int, images: Images | None = None) -> list[bytes]:
    """Chain hash of every full block of `tokens`: key_i = blake2b(key_{i-1} + ids of block i), and
    with `images` + the patch values at block i's placeholders (none there: the text-only key)."""
    keys, key = [], b""
    ids = np.asarray(tokens, np.int32)
    for i in range(len(ids) // block):
        span = slice(i * block, (i + 1) * block)
        content = ids[span].tobytes()
        if images is not None:
            content += np.asarray(images.patches[span][ids[span] == images.token_id], np.float32).tobytes()
        key = hashlib.blake2b(key + content, digest_size=16).digest()
        keys.append(key)
    return keys


def whole_images(tokens: np.ndarray, n: int, block: int, token_id: int) -> int:
    """The largest multiple of `block` <= n that does not cut a run of `token_id` placeholders."""
    start = n
    while 0 < start < len(tokens) and tokens[start - 1] == token_id and tokens[start] == token_id:
        start -= 1
    return start // block * block


@dataclasses.dataclass
class Entry:
    """One cached sequence: ids [L] and per layer (k [K, Dh, L], v [K, L, Dh]); `keys` its block keys."""

    tokens: np.ndarray
    kv: tuple
    keys: list[bytes]

    @property
    def nbytes(self) -> int:
        """Bytes of KV held."""
        return sum(a.nbytes for kv in self.kv for a in kv)


@dataclasses.dataclass
class CacheStats:
    """Counters since creation: prompts looked up, their tokens, tokens served from the cache,
    prompts with a hit, entries inserted and evicted, and times emptied for new weights."""

    lookups: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hits: int = 0
    inserted: int = 0
    evicted: int = 0
    invalidations: int = 0

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache / prompt tokens looked up."""
        return self.hit_tokens / max(self.prompt_tokens, 1)


class PrefixCache:
    """Bounded LRU store of prompt-prefix KV keyed by token content (see the module doc)."""

    def __init__(self, max_tokens: int, block: int = BLOCK):
        if max_tokens < 1 or block < 1:
            raise ValueError(f"prefix cache: max_tokens={max_tokens} and block={block} must be >= 1")
        self.max_tokens, self.block = max_tokens, block
        self.entries: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()  # LRU first
        self.index: dict[bytes, dict[bytes, None]] = {}  # block key → entries holding that prefix
        self.stats = CacheStats()
        self.tokens = 0  # tokens held: each entry's length (shared blocks counted per entry)
        self._weights: list | None = None
        self._lock = threading.Lock()  # sampler calls from several threads (RL producer, evaluation)

    @property
    def nbytes(self) -> int:
        """Bytes of KV held."""
        return sum(e.nbytes for e in self.entries.values())

    def clear(self) -> None:
        """Drop every entry."""
        self.entries.clear()
        self.index.clear()
        self.tokens = 0

    def bind(self, params, rest) -> None:
        """Use the cache with these weights: empty it unless they are the very arrays it was filled
        with (held by weak reference: a freed or replaced array means new weights)."""
        leaves = jax.tree.leaves((params, rest))
        same = (
            self._weights is not None
            and len(self._weights) == len(leaves)
            and all(ref() is leaf for ref, leaf in zip(self._weights, leaves))
        )
        if not same:
            if self.entries:
                self.stats.invalidations += 1
            self.clear()
            self._weights = [_ref(leaf) for leaf in leaves]

    def _keys(self, tokens: np.ndarray, images: Images | None) -> list[bytes]:
        return block_keys(tokens, self.block) if images is None else block_keys(tokens, self.block, images)

    def lookup(self, tokens: np.ndarray, images: Images | None = None) -> tuple[Entry | None, int]:
        """The entry holding the longest cached block-aligned prefix of `tokens` (with `images`:
        and of their images; a prefix that cuts no image) that leaves at least one token
        uncached, and that prefix's length (0: a miss). Counts the lookup."""
        tokens = np.asarray(tokens, np.int32)
        found, n = None, 0
        for i, key in enumerate(self._keys(tokens[: len(tokens) - 1], images)):
            holders = self.index.get(key)
            if not holders:
                break
            found, n = next(reversed(holders)), (i + 1) * self.block
        if images is not None:  # the entry holding the longer prefix holds this one too
            n = whole_images(tokens, n, self.block, images.token_id)
        entry = self.entries.get(found) if found is not None and n else None
        if entry is not None and not np.array_equal(entry.tokens[:n], tokens[:n]):  # a hash collision
            entry, n = None, 0
        if entry is not None:
            self.entries.move_to_end(found)
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(tokens)
        self.stats.hit_tokens += n
        self.stats.hits += n > 0
        return entry, n

    def insert(self, tokens: np.ndarray, kv: tuple, images: Images | None = None) -> None:
        """Cache the KV of `tokens` (their full blocks): kv per layer (k [K, Dh, >= L], v [K, >= L, Dh])
        for ids `tokens` (and `images`) at positions 0..; entries that are prefixes of it are
        dropped, and nothing is added when an entry already holds it. No entry is a prefix of another."""
        n = len(tokens) // self.block * self.block
        if n == 0 or n > self.max_tokens:
            return
        keys = self._keys(tokens[:n], images)
        if keys[-1] in self.index:  # already held (by an entry this is a prefix of)
            for name in self.index[keys[-1]]:
                self.entries.move_to_end(name)
            return
        for key in keys[:-1]:
            if key in self.entries:  # an earlier turn of this sequence: superseded
                self._remove(key)
        kv = tuple((np.array(k[..., :n]), np.array(v[..., :n, :])) for k, v in kv)
        self.entries[keys[-1]] = Entry(np.array(tokens[:n], np.int32), kv, keys)
        self.tokens += n
        for key in keys:
            self.index.setdefault(key, {})[keys[-1]] = None
        self.stats.inserted += 1
        while self.tokens > self.max_tokens:
            self._remove(next(iter(self.entries)))
            self.stats.evicted += 1

    def _remove(self, name: bytes) -> None:
        entry = self.entries.pop(name)
        self.tokens -= len(entry.tokens)
        for key in entry.keys:
            holders = self.index[key]
            holders.pop(name, None)
            if not holders:
                del self.index[key]

    def sample(
        self,
        graphdef: nnx.GraphDef,
        params: nnx.State,
        rest: nnx.State,
        rows: list[np.ndarray],
        num_rows: int,
        prompt_bucket: int,
        limits: np.ndarray,
        key: jax.Array,
        *,
        sampling: SamplingParams,
        pad_id: int,
        patches: list[np.ndarray | None] | None = None,
    ) -> engine.Outputs:
        """`generate`'s device outputs for prompts `rows` (padded to `num_rows` rows of at most
        `prompt_bucket` tokens) and their image `patches` (per prompt, or None), prefilling only
        what the cache lacks; every sample's prompt and completion are cached for later requests.
        Returns host outputs."""
        if jax.process_count() > 1:
            raise ValueError("sampling.prefix_cache runs in a single process for now (its KV lives on the host)")
        if sampling.speculative_k:
            raise ValueError("sampling.prefix_cache with sampling.speculative_k > 0: not supported together")
        model = nnx.merge(graphdef, params, rest) if patches is not None or engine.stacked_cache() else None
        # with images, every row's patches as the program sees them (a row without any: zeros)
        padded = None if patches is None else pad_patches(patches, rows, (num_rows, prompt_bucket))
        token_id = getattr(getattr(model, "vision", None), "token_id", None)  # a text-only model: refused by prefill
        images = [None if padded is None else Images(padded[i], token_id) for i in range(len(rows))]
        with self._lock:
            self.bind(params, rest)
            bound, hits = self._weights, [self.lookup(r, im) for r, im in zip(rows, images)]
            starts = np.zeros((num_rows,), np.int32)
            starts[: len(rows)] = [n for _, n in hits]
            prefix = (
                _gather_prefix([e for e, _ in hits], starts, num_rows, bucket(int(starts.max())))
                if starts.any()
                else None
            )
        capacity = prompt_bucket + sampling.max_new_tokens
        common = dict(
            limits=limits,
            num_prompts=np.int32(len(rows)),
            key=key,
            capacity=capacity,
            sampling=sampling,
            pad_id=pad_id,
            rules=sharding_key(),
        )
        if prefix is None:
            tokens, lengths = pad_prompts(rows, num_rows, prompt_bucket, pad_id)
            suffix_patches = padded
        else:
            suffixes = [r[n:] for r, n in zip(rows, starts)]
            tokens, lengths = pad_prompts(
                suffixes, num_rows, bucket(max(map(len, suffixes)), MIN_PROMPT_BUCKET), pad_id
            )
            suffix_patches = None
            if padded is not None:
                suffix_patches = np.zeros((*tokens.shape, padded.shape[-1]), np.float32)
                for i, (r, n) in enumerate(zip(rows, starts)):
                    suffix_patches[i, : len(r) - n] = padded[i, n : len(r)]
        # the program's cache layout (`engine.decode_layers`); entries are kept per layer
        segments = engine.stack_segments(model) if engine.stacked_cache() else None
        if segments and prefix is not None:
            prefix = kv_cache.to_stacked(prefix, segments, np.stack)
        out, cache = cached_program(
            graphdef, params, rest, prefix, tokens, starts, lengths, patches=suffix_patches, **common
        )
        out, cache = host_outputs(out), jax.device_get(cache)
        if segments:
            cache = kv_cache.to_layers(cache, segments)
        with self._lock:
            if self._weights is bound:  # else another thread bound new weights meanwhile: KV is stale
                self._insert_samples(rows, out, cache, sampling.num_samples, images)
        return out

    def _insert_samples(self, rows: list[np.ndarray], out, cache, g: int, images: list) -> None:
        """Cache each sample's prompt and completion (keyed with the prompt's images; generated
        tokens are text). The last sampled token's KV is not in the cache (a finished slot writes
        padding there), so a sample of m tokens caches prompt + m − 1."""
        for r in range(len(rows) * g):
            prompt, m, im = rows[r // g], int(out.lengths[r]), images[r // g]
            ids = np.concatenate([prompt, out.tokens[r, : max(m - 1, 0)]])
            if im is not None:  # the prompt's patches, zeros along the completion
                im = Images(np.pad(im.patches[: len(prompt)], ((0, len(ids) - len(prompt)), (0, 0))), im.token_id)
            if len(ids) >= self.block:
                self.insert(ids, tuple((k[r], v[r]) for k, v in cache), im)


def _ref(leaf):
    """A weak reference to a weight array (an object that has none: itself, compared by identity)."""
    try:
        return weakref.ref(leaf)
    except TypeError:
        return lambda: leaf


def _gather_prefix(entries: list[Entry | None], starts: np.ndarray, num_rows: int, length: int) -> tuple:
    """The hits' KV as a batch: per layer (k [B, K, Dh, length], v [B, K, length, Dh]), row i's
    first starts[i] entries from its cache entry, zeros elsewhere."""
    template = next(e for e in entries if e is not None).kv
    out = []
    for layer, (k0, v0) in enumerate(template):
        k = np.zeros((num_rows, *k0.shape[:-1], length), k0.dtype)
        v = np.zeros((num_rows, v0.shape[0], length, v0.shape[2]), v0.dtype)
        for i, (entry, n) in enumerate(zip(entries, starts)):
            if entry is not None and n:
                k[i, ..., :n] = entry.kv[layer][0][..., :n]
                v[i, :, :n] = entry.kv[layer][1][:, :n]
        out.append((k, v))
    return tuple(out)


@functools.partial(jax.jit, static_argnames=("graphdef", "capacity", "sampling", "pad_id", "rules"))
def cached_program(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    rest: nnx.State,
    prefix: tuple | None,
    tokens: jax.Array,
    starts: jax.Array,
    lengths: jax.Array,
    limits: jax.Array,
    num_prompts: jax.Array,
    key: jax.Array,
    patches: jax.Array | None = None,
    *,
    capacity: int,
    sampling: SamplingParams,
    pad_id: int,
    rules: tuple | None = None,
) -> tuple[engine.Outputs, tuple]:
    """`generate_program` on top of cached KV: prefix (per layer k [B, K, Dh, H], v [B, K, H, Dh],
    stacked as `engine.decode_layers` says; None: no row hit, a plain prefill) holds row b's first
    starts[b] entries; tokens [B, S] are the uncached suffixes (lengths [B] >= 1) at positions
    starts[b]... with their images patches [B, S, patch_dim] (or None) → (Outputs, the final cache
    [B * G rows], in the same layout: each sample's prompt and completion KV). `rules`:
    `generate.sharding_key()`, the rules it is traced under (part of the compile key)."""
    model = nnx.merge(graphdef, params, rest)
    g, b = sampling.num_samples, tokens.shape[0]
    layers = engine.decode_layers(model)
    if prefix is None:
        logits, kv = engine.prefill(model, tokens, lengths, layers, patches=patches)
        cache = kv_cache.allocate(kv, capacity)
    else:
        positions = starts[:, None] + jnp.arange(tokens.shape[1])
        cache = kv_cache.allocate(prefix, capacity)
        hidden, cache = engine.extend(model, layers, tokens, positions, cache, patches=patches)
        logits = model.logits(jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1))[:, 0]
    ids = jnp.arange(b * g, dtype=jnp.int32)
    slots = engine.Slots(
        cache=kv_cache.repeat_rows(cache, g),
        logits=jnp.repeat(logits, g, axis=0),
        prompt_len=jnp.repeat(starts + lengths, g),
        step=jnp.zeros((b * g,), jnp.int32),
        limit=jnp.repeat(limits, g),
        done=ids >= num_prompts * g,
        keys=engine.token_keys(key, ids, sampling.max_new_tokens),
        row=ids,
    )
    out = engine.Outputs.empty(b * g, sampling.max_new_tokens, pad_id)
    out, slots = engine.decode_loop(model, slots, out, sampling, pad_id, layers=layers, return_slots=True)
    return out, slots.cache
