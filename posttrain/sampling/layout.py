"""The sampler's weight layout (`sampling.layout`): serve from the learner's arrays, or from a
copy resharded into a decode layout at each publish.

- learner: the sampler reads the learner's own arrays (ZeRO-3 over fsdp: every decode step
  all-gathers each chip's weight shards again, ~7 GB per chip per token for Qwen3-30B-A3B on
  v5p-128, BENCHMARKS.md "Pod plan").
- tensor: `parallel.sharding.decode_rules` — heads, MLP / expert hidden and vocab split over
  `tensor` and the ZeRO-3 axes, experts over `expert`, replicated over the batch axes; the KV
  cache split by rows over the batch axes and by KV heads over the tensor axes. A decode step
  moves activations instead of weights, for one reshard per publish and a second copy of the
  weights.
"""

from __future__ import annotations

import contextlib

import jax
from flax import nnx
from jax.sharding import Mesh

from posttrain.config import SAMPLING_LAYOUTS
from posttrain.parallel.sharding import Rules, current, decode_rules, shardings_for, use_sharding


def check_layout(layout: str, key: str = "sampling.layout") -> str:
    """`layout` if it is one of SAMPLING_LAYOUTS, else a ValueError naming `key`."""
    if layout not in SAMPLING_LAYOUTS:
        raise ValueError(f"{key}={layout!r}: expected one of {', '.join(SAMPLING_LAYOUTS)}")
    return layout


def sampler_rules(rules: Rules, layout: str) -> dict[str, tuple[str, ...]]:
    """The logical-axis rules the sampler runs under: the learner's, or the decode layout's."""
    return dict(rules) if check_layout(layout) == "learner" else decode_rules(rules)


def publish_weights(params: nnx.State, mesh: Mesh, rules: Rules, layout: str, to: Mesh | None = None) -> nnx.State:
    """The learner's params as the sampler takes them: as they are ('learner'), or resharded into
    the decode layout ('tensor': one reshard, new arrays; the learner's stay as they were).
    `to`: the sampler's own mesh (`rl.placement = split`): the params are copied onto it, in the
    layout's rules, whatever the layout. `params` are nnx Variables carrying their logical names
    (a train state's params)."""
    if check_layout(layout) == "learner" and to is None:
        return params
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if not all(isinstance(x, nnx.Variable) for x in leaves):
        raise ValueError(
            "publish_weights: params must be nnx Variables carrying their logical axis names "
            "(nnx.split's or a train state's params), not plain arrays, whose layout is unknown"
        )
    return jax.device_put(params, shardings_for(params, mesh if to is None else to, sampler_rules(rules, layout)))


@contextlib.contextmanager
def sampling_sharding(rules: Rules | None, mesh: Mesh | None = None):
    """Trace the sampler under `rules` on `mesh` (the sampler's own, `rl.placement = split`), else
    on the current mesh (rules None: leave the rules in force)."""
    ctx = current()
    if mesh is not None:
        rules = rules if rules is not None else ctx[1] if ctx is not None else None
        if rules is None:
            raise ValueError("sampling_sharding: a sampler mesh needs rules (none given, none in force)")
        with use_sharding(mesh, rules):
            yield
        return
    if rules is None or ctx is None:
        yield
        return
    with use_sharding(ctx[0], rules):
        yield
