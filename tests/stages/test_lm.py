"""Training end to end on the built-in task: the loss falls."""

import pytest

from posttrain.config import base_config
from posttrain.stages import lm
from tests.support.typed_configs import run_cfg, typed


@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_loss_falls_on_arithmetic_text(tmp_path, experts):
    cfg = base_config()
    cfg.workdir = str(tmp_path)
    cfg.model.moe.num_experts = experts
    cfg.mesh.data, cfg.mesh.expert = (4, 2) if experts else (8, 1)
    # 60 steps: the cross-entropy halves by ~step 20 (warmup) and ends near 0.39x its start (150 steps: 0.28x)
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len, cfg.train.log_every = 60, 16, 32, 25
    cfg.train.progress = False
    rows = lm.run(typed(cfg))
    first, last = rows[0]["ce"], rows[-1]["ce"]
    assert first > 4.0  # ~log(256) at init
    assert last < 0.5 * first, [r["ce"] for r in rows]
    if experts:
        load = rows[-1]["moe/load"]
        assert abs(sum(load) - 1) < 1e-5 and min(load) > 0.05  # balanced enough that no expert starves


def test_context_parallel_training_equals_one_shard(tmp_path):
    """The training loop with mesh.sequence = 2 (rows zig-zagged, blockwise ring attention) logs the
    losses of the same run with the sequence unsharded."""

    def losses(sequence, attention):
        cfg = base_config()
        cfg.workdir = str(tmp_path / f"{sequence}_{attention}")
        cfg.mesh.data, cfg.mesh.sequence = 8 // sequence, sequence
        cfg.model.attention, cfg.model.attention_block = attention, 8
        cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len, cfg.train.log_every = 3, 8, 32, 1
        cfg.train.progress = False
        return [r["ce"] for r in lm.run(typed(cfg))]

    ref = losses(1, "xla")
    assert losses(2, "blockwise") == pytest.approx(ref, rel=1e-4, abs=1e-5)


def test_context_parallel_needs_divisible_lengths(tmp_path):
    cfg = base_config()
    cfg.workdir = str(tmp_path)
    cfg.mesh.data, cfg.mesh.sequence = 2, 4
    cfg.train.seq_len = 36
    with pytest.raises(ValueError, match="train.seq_len=36.*mesh.sequence=4"):
        lm.run(typed(cfg))


def test_train_step_updates_the_router_bias_of_a_sigmoid_router():
    """Aux-loss-free balancing (DeepSeek-V3): the train step's forward pass steps the router bias,
    carried into the new state (the non-trained variables enter the step as plain arguments)."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from posttrain.core.optim import make_optimizer
    from posttrain.core.state import create_train_state
    from posttrain.core.step import lm_loss, make_train_step
    from posttrain.models.decoder import Decoder
    from posttrain.parallel import make_mesh, parse_rules, use_sharding

    cfg = run_cfg({"model.moe.num_experts": 4, "model.moe.router": "sigmoid", "model.moe.bias_update_rate": 0.01})
    m = cfg.model
    mesh, rules = make_mesh(dict(data=1), jax.devices()[:1]), parse_rules(cfg.sharding.rules)
    tx = make_optimizer(cfg.optim, 10)
    rng = np.random.default_rng(0)
    batch = {k: jnp.asarray(rng.integers(0, m.vocab_size, (2, 8)), jnp.int32) for k in ("inputs", "targets")}
    batch.update(
        loss_mask=jnp.ones((2, 8), jnp.int32),
        segment_ids=jnp.ones((2, 8), jnp.int32),
        positions=jnp.broadcast_to(jnp.arange(8), (2, 8)),
    )
    with use_sharding(mesh, rules):
        graphdef, state, _ = create_train_state(lambda: Decoder(m, rngs=nnx.Rngs(0)), tx, mesh, rules)
        step = jax.jit(make_train_step(graphdef, tx, functools.partial(lm_loss, moe_cfg=m.moe)))
        new, _ = step(state, batch)
    before, after = jax.tree.leaves(state.rest), jax.tree.leaves(new.rest)
    assert before and all(np.all(b == 0) for b in before)
    assert any(np.any(a != 0) for a in after)
