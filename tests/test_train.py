"""Training end to end on the built-in task: the loss falls."""

import pytest

from posttrain.config import base_config
from posttrain.train import lm


@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_loss_falls_on_arithmetic_text(tmp_path, experts):
    cfg = base_config()
    cfg.workdir = str(tmp_path)
    cfg.model.moe.num_experts = experts
    cfg.mesh.data, cfg.mesh.expert = (4, 2) if experts else (8, 1)
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len, cfg.train.log_every = 150, 16, 32, 25
    cfg.train.progress = False
    rows = lm.run(cfg)
    first, last = rows[0]["ce"], rows[-1]["ce"]
    assert first > 4.0            # ~log(256) at init
    assert last < 0.5 * first, [r["ce"] for r in rows]
    if experts:
        load = rows[-1]["moe/load"]
        assert abs(sum(load) - 1) < 1e-5 and min(load) > 0.05   # balanced enough that no expert starves


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
        return [r["ce"] for r in lm.run(cfg)]
    ref = losses(1, "xla")
    assert losses(2, "blockwise") == pytest.approx(ref, rel=1e-4, abs=1e-5)


def test_context_parallel_needs_divisible_lengths(tmp_path):
    cfg = base_config()
    cfg.workdir = str(tmp_path)
    cfg.mesh.data, cfg.mesh.sequence = 2, 4
    cfg.train.seq_len = 36
    with pytest.raises(ValueError, match="train.seq_len=36.*mesh.sequence=4"):
        lm.run(cfg)
