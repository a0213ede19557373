"""The decoder: embedding → scanned blocks (attention + MLP or MoE) → RMSNorm → LM head."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.config import REMAT_MODES
from posttrain.models.attention import Attention
from posttrain.models.layers import MLP, RMSNorm, dtype_of, param
from posttrain.models.moe import MoE, RouterBias
from posttrain.models.quant import weight_einsum
from posttrain.models.vision import make_vision
from posttrain.parallel.sharding import constrain

ACTIVATION_NAMES = ("activation_batch", "activation_length", "activation_embed")  # the residual stream [B, S, D]

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def layer_kinds(cfg) -> tuple[str, ...]:
    """'dense' or 'moe' for each layer, from model.moe.{num_experts, first_dense, every, dense_layers}.

    Layer i is MoE when experts exist, i >= first_dense, (i + 1) % every == 0 (HF
    `decoder_sparse_step`) and i is not in dense_layers (HF `mlp_only_layers`).
    """
    m = cfg.moe
    bad = [i for i in m.dense_layers if not 0 <= i < cfg.num_layers]
    if bad:
        raise ValueError(f"model.moe.dense_layers={tuple(m.dense_layers)}: {bad} outside 0..{cfg.num_layers - 1}")
    if m.every < 1:
        raise ValueError(f"model.moe.every={m.every} must be >= 1")
    return tuple(
        "moe"
        if (m.num_experts > 0 and i >= m.first_dense and (i + 1) % m.every == 0 and i not in m.dense_layers)
        else "dense"
        for i in range(cfg.num_layers)
    )


def scan_segments(kinds: Sequence[str], max_period: int = 4) -> list[tuple[tuple[str, ...], int]]:
    """Split a layer-kind list into runs of a repeated unit, each compiled once with `lax.scan`.

    Greedy: at each position take the unit (length <= max_period, repeated at least twice unless
    it is a single layer) whose repeats cover the most layers, preferring shorter units.
    E.g. [d, m, d, m] → [((d, m), 2)];
    [d, d, m, m, m] → [((d,), 2), ((m,), 3)].
    """
    out, i = [], 0
    while i < len(kinds):
        best = None
        for p in range(1, min(max_period, len(kinds) - i) + 1):
            unit, r = tuple(kinds[i : i + p]), 1
            while tuple(kinds[i + r * p : i + (r + 1) * p]) == unit:
                r += 1
            if (p == 1 or r > 1) and (best is None or p * r > len(best[0]) * best[1]):
                best = (unit, r)
        out.append(best)
        i += len(best[0]) * best[1]
    return out


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp_or_moe(norm(x))."""

    def __init__(self, cfg, kind: str, *, rngs: nnx.Rngs):
        pdt = dtype_of(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, param_dtype=pdt)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, param_dtype=pdt)
        if kind == "moe":
            self.mlp = MoE(cfg, rngs=rngs)
        else:
            self.mlp = MLP(cfg.embed_dim, cfg.mlp_dim, param_dtype=pdt, dtype=dtype_of(cfg.dtype), rngs=rngs)
        self.is_moe = kind == "moe"

    def __call__(self, x, positions, segment_ids, update_bias: bool = False, experts=None):
        """x: [B, S, D] → ([B, S, D], MoE aux dict or {}); experts [B, S, k]: replayed routing."""
        x = x + self.attn(self.attn_norm(x), positions, segment_ids)
        return self.feed_forward(x, update_bias, token_mask=segment_ids != 0, experts=experts)

    def feed_forward(self, x, update_bias: bool = False, inference: bool = False, token_mask=None, experts=None):
        """x + mlp_or_moe(norm(x)): [B, S, D] → ([B, S, D], MoE aux dict or {}). `inference`: not
        differentiated (see `MoE`); token_mask [B, S]: real tokens (padding, segment id 0, takes
        no expert capacity and is left out of the MoE statistics; None: all real); experts
        [B, S, k]: an MoE block uses them instead of its router's choice (routing replay)."""
        h = self.mlp_norm(x)
        if self.is_moe:
            h, aux = self.mlp(h, token_mask, update_bias=update_bias, inference=inference, experts=experts)
        else:
            h, aux = self.mlp(h), {}
        return constrain(x + h, ACTIVATION_NAMES), aux

    def prefill(self, x, positions, segment_ids):
        """`__call__` that also returns the attention's keys and values: x [B, S, D] →
        ([B, S, D], (k [B, K, Dh, S], v [B, K, S, Dh]), experts): the KV-cache layout, and the
        experts [B, S, k] an MoE block chose (None for a dense block)."""
        a, k, v = self.attn.prefill(self.attn_norm(x), positions, segment_ids)
        x, aux = self.feed_forward(x + a, inference=True, token_mask=segment_ids != 0)
        return x, (k, v), aux.get("experts")

    def decode(self, x, positions, k_cache, v_cache):
        """One token per row against this layer's KV cache (see `Attention.decode`):
        x [B, 1, D] → ([B, 1, D], k_cache, v_cache, experts [B, 1, k] of an MoE block or None)."""
        a, k_cache, v_cache = self.attn.decode(self.attn_norm(x), positions, k_cache, v_cache)
        x, aux = self.feed_forward(x + a, inference=True)
        return x, k_cache, v_cache, aux.get("experts")


class Unit(nnx.Module):
    """A few consecutive blocks (e.g. dense then MoE) that repeat as one scan step."""

    def __init__(self, cfg, kinds: tuple[str, ...], *, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(cfg, k, rngs=rngs) for k in kinds])

    def __call__(self, x, positions, segment_ids, update_bias: bool = False, experts=None):
        """experts: [MoE blocks of the unit, B, S, k] replayed routing, or None."""
        auxs, j = [], 0
        for block in self.blocks:
            given = experts[j] if experts is not None and block.is_moe else None
            x, aux = block(x, positions, segment_ids, update_bias, given)
            j += block.is_moe
            auxs.append(aux)
        return x, auxs


def _stacked_unit(cfg, kinds: tuple[str, ...], repeats: int, rngs: nnx.Rngs) -> Unit:
    @nnx.split_rngs(splits=repeats)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs):
        return Unit(cfg, kinds, rngs=rngs)

    return make(rngs)


class Decoder(nnx.Module):
    """Decoder-only LM (dense or MoE). Layers run under `lax.scan`, one compile per segment."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.remat = cfg.remat
        pdt = dtype_of(cfg.param_dtype)
        self.dtype = dtype_of(cfg.dtype)
        if cfg.remat not in REMAT_MODES:
            raise ValueError(f"model.remat={cfg.remat!r}: expected none, full or dots")
        self.embed = param(
            rngs, jax.nn.initializers.normal(1.0), (cfg.vocab_size, cfg.embed_dim), ("vocab", "embed"), pdt
        )
        self.stacks = nnx.List([_stacked_unit(cfg, kinds, r, rngs) for kinds, r in scan_segments(layer_kinds(cfg))])
        self.final_norm = RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, param_dtype=pdt)
        self.head = (
            None
            if cfg.tie_embeddings
            else param(
                rngs,
                jax.nn.initializers.normal(cfg.embed_dim**-0.5),
                (cfg.embed_dim, cfg.vocab_size),
                ("embed", "vocab"),
                pdt,
            )
        )
        # images (model.vision): no parameters when text only; made last, so a text-only model
        # draws the same initial weights as before
        self.vision = make_vision(cfg, rngs)

    def hidden_states(
        self,
        tokens,
        positions=None,
        segment_ids=None,
        *,
        update_bias: bool = False,
        routing=None,
        experts_out=False,
        patches=None,
    ):
        """tokens [B, S] int → (final-normed hidden [B, S, D], aux).

        patches [B, S, patch_dim] (with model.vision.encoder = linear): each image placeholder
        token's input is its patch, projected (`_embed`); other positions' patches are ignored.

        positions default to 0..S-1 and segment_ids to ones (one unpacked sequence per row).
        aux holds the MoE statistics averaged over MoE layers ("moe/aux_loss", "moe/z_loss",
        "moe/dropped") and "moe/load" [num_moe_layers, num_experts], over real tokens only
        (segment id != 0); empty for a dense model. `routing` [B, S, num_moe_layers, k] (ints):
        each MoE layer uses these experts instead of its router's choice (routing replay, the
        sampler's record); `experts_out`: aux also holds "moe/experts" [B, S, num_moe_layers, k]
        int32, the experts used.
        """
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        if segment_ids is None:
            segment_ids = jnp.ones_like(tokens)
        x = self._embed(tokens, patches, positions, segment_ids)
        moe_aux, used, first = [], [], 0
        per_layer = None if routing is None else jnp.moveaxis(routing, 2, 0)  # [layers, B, S, k]
        for stack in self.stacks:
            width, repeats = sum(b.is_moe for b in stack.blocks), _repeats(nnx.state(stack))
            given = None
            if per_layer is not None and width:  # this stack's layers as [repeats, width, B, S, k]
                given = per_layer[first : first + width * repeats].reshape(repeats, width, *per_layer.shape[1:])
            first += width * repeats
            x, auxs = self._run_stack(stack, x, positions, segment_ids, update_bias, given)
            moe_aux += [a for a in auxs if a]
            if width and experts_out:  # [repeats, width, B, S, k] → layers in order (repeat-major)
                exps = [a["experts"] for a in auxs if a]
                used.append(jnp.stack(exps, axis=1).reshape(-1, *exps[0].shape[1:]))
        if per_layer is not None and first != per_layer.shape[0]:
            raise ValueError(f"routing for {per_layer.shape[0]} MoE layers, the model has {first}")
        aux = _reduce_moe_aux(moe_aux)
        if experts_out and used:
            aux["moe/experts"] = jnp.moveaxis(jnp.concatenate(used), 0, 2)
        return self.final_norm(x), aux

    def _embed(self, tokens, patches=None, positions=None, segment_ids=None):
        """tokens [B, S] int → embeddings [B, S, D] in the compute dtype; with patches
        [B, S, patch_dim], an image placeholder's embedding is its projected patch (`models.vision`)
        (the rotary positions stay the tokens' 1-D positions)."""
        # embed dim all-gathered (ZeRO-3); the vocab dim as `vocab_lookup` says: whole (a local row
        # gather) or left sharded (each shard looks up its tokens, the partials are summed)
        table = constrain(self.embed[...], ("vocab_lookup", None))
        x = jnp.take(table, tokens, axis=0).astype(self.dtype)
        if patches is not None:
            if self.vision is None:
                raise ValueError("patches given to a text-only model (model.vision.encoder='none')")
            x = self.vision(tokens, patches, x, positions, segment_ids)
        return constrain(x, ACTIVATION_NAMES)

    def prefill(
        self,
        tokens,
        positions,
        segment_ids,
        layers: Sequence[Block] | None = None,
        *,
        stacked: bool = False,
        routing: bool = False,
        patches=None,
    ):
        """The forward pass of a sampler's prompt: tokens [B, S] → (final-normed hidden [B, S, D], kv).
        patches [B, S, patch_dim]: the prompt's image patches (see `hidden_states`).

        kv holds one (k, v) pair per layer, in layer order, laid out like the KV cache
        (`sampling.kv_cache`): k [B, K, Dh, S], v [B, K, S, Dh]. Given `layers` (`self.layers()`)
        the layers run one after another, else each stack under its scan; `stacked` (no `layers`)
        keeps the scan's layout, one pair per block of each stack with the repeats in front
        (k [R, B, K, Dh, S]): the cache `decode_stacked` takes. `routing`: also return the experts
        each MoE layer chose, [B, S, num_moe_layers, k] int32 (None for a dense model).
        """
        x = self._embed(tokens, patches, positions, segment_ids)
        kv, used = [], []
        if layers is not None:
            for block in layers:
                x, block_kv, experts = block.prefill(x, positions, segment_ids)
                kv.append(block_kv)
                used += [] if experts is None else [experts[None]]
            return (self.final_norm(x), tuple(kv)) + ((_layers_last(used),) if routing else ())
        for stack in self.stacks:
            graphdef, state = nnx.split(stack)

            def body(x, state):
                unit = nnx.merge(graphdef, state)
                kvs, exps = [], []
                for block in unit.blocks:
                    x, block_kv, experts = block.prefill(x, positions, segment_ids)
                    kvs.append(block_kv)
                    exps += [] if experts is None or not routing else [experts]
                return x, (kvs, exps)

            x, (stack_kv, exps) = jax.lax.scan(body, x, state)  # per block: [repeats, ...]
            kv += (
                [tuple(block_kv) for block_kv in stack_kv]
                if stacked
                else [jax.tree.map(lambda a: a[r], block_kv) for r in range(_repeats(state)) for block_kv in stack_kv]
            )
            used += [jnp.stack(exps, axis=1).reshape(-1, *exps[0].shape[1:])] if exps else []
        return (self.final_norm(x), tuple(kv)) + ((_layers_last(used),) if routing else ())

    def layers(self) -> list[Block]:
        """The blocks in layer order, each holding its own slice of the stacked (scanned) weights.

        The sampler's decode step runs them one after another, without a scan: a scan over layers
        would index every weight and cache array with the layer number at every token.
        """
        out = []
        for stack in self.stacks:
            graphdef, state = nnx.split(stack)
            for r in range(_repeats(state)):
                out += nnx.merge(graphdef, jax.tree.map(lambda a: a[r], state)).blocks
        return out

    def decode(self, tokens, positions, cache, layers: Sequence[Block] | None = None, *, routing: bool = False):
        """One new token per row: tokens [B, 1], positions [B] → (final-normed hidden [B, 1, D], cache).

        cache has `prefill`'s kv structure with T (the capacity) entries per row; a token's cache
        index is its position. The new keys and values are written at `positions`
        (in place) and each row attends to its entries 0..position. `layers` is `self.layers()`,
        computed here unless the caller hoisted it out of its decode loop. `routing`: also return
        the experts each MoE layer chose, [B, 1, num_moe_layers, k] (see `prefill`).
        """
        layers = self.layers() if layers is None else layers
        if len(layers) != len(cache):
            raise ValueError(f"KV cache of {len(cache)} layers for a model of {len(layers)}")
        x = self._embed(tokens)
        new_cache, used = [], []
        for block, (k, v) in zip(layers, cache):
            x, k, v, experts = block.decode(x, positions, k, v)
            new_cache.append((k, v))
            used += [] if experts is None else [experts[None]]
        return (self.final_norm(x), tuple(new_cache)) + ((_layers_last(used),) if routing else ())

    def decode_stacked(self, tokens, positions, cache, *, routing: bool = False):
        """`decode` with each stack's layers under `lax.scan`, so the compiled decode step does not
        grow with depth (the unrolled one does: minutes per layer-count doubling when compiling a
        deep model for a TPU pod). cache: `prefill(stacked=True)`'s layout; each layer's cache
        slice goes through the scan with its weights and comes back updated."""
        x = self._embed(tokens)
        new_cache, i, used = [], 0, []
        for stack in self.stacks:
            graphdef, state = nnx.split(stack)
            width = len(stack.blocks)

            def body(x, xs, graphdef=graphdef):
                state, kvs = xs
                out, exps = [], []
                for block, (k, v) in zip(nnx.merge(graphdef, state).blocks, kvs):
                    x, k, v, experts = block.decode(x, positions, k, v)
                    out.append((k, v))
                    exps += [] if experts is None or not routing else [experts]
                return x, (tuple(out), exps)

            stack_cache = tuple(cache[i : i + width])
            if len(stack_cache) != width or _repeats(state) != stack_cache[0][0].shape[0]:
                raise ValueError(
                    f"stacked KV cache of {len(cache)} (k, v) pairs does not match the model's "
                    f"stacks (use prefill(stacked=True))"
                )
            x, (stack_cache, exps) = jax.lax.scan(body, x, (state, stack_cache))
            new_cache += list(stack_cache)
            i += width
            used += [jnp.stack(exps, axis=1).reshape(-1, *exps[0].shape[1:])] if exps else []
        return (self.final_norm(x), tuple(new_cache)) + ((_layers_last(used),) if routing else ())

    def _run_stack(self, stack: Unit, x, positions, segment_ids, update_bias, experts=None):
        """One stack under `lax.scan`; experts [repeats, MoE blocks of the unit, B, S, k] or None."""
        graphdef, state = nnx.split(stack)

        def body(x, xs):
            state, given = xs
            unit = nnx.merge(graphdef, state)
            x, auxs = unit(x, positions, segment_ids, update_bias, given)
            return x, (auxs, nnx.state(unit, RouterBias))

        if self.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.remat], prevent_cse=False)
        x, (auxs, bias) = jax.lax.scan(body, x, (state, experts))
        if update_bias:
            nnx.update(stack, bias)
        return x, auxs

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[B, S, D] → float32 logits [B, S, V]."""
        w = self.embed[...].T if self.head is None else self.head[...]
        out = weight_einsum("bsd,dv->bsv", hidden.astype(self.dtype), w, self.dtype, preferred_element_type=jnp.float32)
        out = out if self.vision is None else self.vision.mask_logits(out)  # no image placeholder out
        return constrain(out, ("activation_batch", "activation_length", "activation_vocab"))

    def __call__(self, tokens, positions=None, segment_ids=None, *, update_bias: bool = False, **kw):
        """tokens [B, S] → (logits [B, S, V] float32, aux) — see `hidden_states` (`kw`: its
        routing / experts_out / patches)."""
        hidden, aux = self.hidden_states(tokens, positions, segment_ids, update_bias=update_bias, **kw)
        return self.logits(hidden), aux


def _repeats(stack_state) -> int:
    """How many times a scanned stack's unit repeats: the leading dim of its weights."""
    return jax.tree.leaves(stack_state)[0].shape[0]


def _layers_last(used: list) -> jax.Array | None:
    """Per-stack experts [layers, B, S, k] → [B, S, num_moe_layers, k] int32 (None: no MoE layer)."""
    return jnp.moveaxis(jnp.concatenate(used), 0, 2) if used else None


def _reduce_moe_aux(auxs: list[dict]) -> dict:
    """Per-layer MoE stats (each stacked over scan repeats) → means over layers, loads stacked."""
    if not auxs:
        return {}
    cat = lambda k: jnp.concatenate([a[k] for a in auxs])  # each [repeats, ...]
    return {
        "moe/aux_loss": cat("aux_loss").mean(),
        "moe/z_loss": cat("z_loss").mean(),
        "moe/dropped": cat("dropped").mean(),
        "moe/load": cat("load"),
    }
