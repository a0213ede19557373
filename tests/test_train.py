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
