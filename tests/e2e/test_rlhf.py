"""RLHF end to end: the pipeline [sft, reward_model, rlvr] on tiny configs, PPO with a critic
maximising the learned reward of the reward model trained one stage earlier (~2-3 min on 2 CPU
cores, so marked slow; the wiring's fast test is in rl/algo/test_reward_model.py)."""

import json
import shutil

import numpy as np
import pytest

from configs.rlhf_tiny import get_config
from posttrain.main import run


def tiny_rlhf(workdir, data_dir, **rl):
    cfg = get_config()
    cfg.workdir = str(workdir)
    m = cfg.model
    m.embed_dim, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 32, 1, 2, 1, 16, 64
    m.moe.num_experts, m.moe.expert_mlp_dim = 2, 32
    cfg.mesh.data, cfg.mesh.expert, cfg.mesh.tensor = 2, 2, 2
    cfg.data.synthetic_size = 256
    cfg.sft.train_files = cfg.reward_model.train_files = "synthetic:"
    cfg.sft.eval_files = cfg.reward_model.eval_files = ""
    cfg.sft.gate = cfg.reward_model.gate = ""
    cfg.sft.steps, cfg.sft.lr, cfg.reward_model.steps, cfg.reward_model.lr = 40, 3e-3, 30, 3e-3
    cfg.train.batch_size, cfg.train.progress = 8, False
    r = cfg.rl
    r.steps, r.lr, r.eval_every, r.eval_size, r.arithmetic_size = 20, 3e-3, 20, 16, 100
    r.prompts_per_step, r.group_size, r.max_new_tokens = 8, 4, 16
    r.update(rl)
    cfg.checkpoint.every = 5
    return cfg


def rl_rows(workdir, key="rl/rm_score_mean"):
    lines = (workdir / "2_rlvr" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if key in r]


@pytest.mark.slow
def test_rlhf_pipeline_raises_the_learned_reward_and_resumes(tmp_path):
    cfg = tiny_rlhf(tmp_path / "run", tmp_path)
    results = run(cfg)
    assert set(results) == {"sft", "reward_model", "rlvr"}
    rows = rl_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(20))
    score = np.array([r["rl/rm_score_mean"] for r in rows])
    print("rm score per step:", np.round(score, 3))
    assert score[-5:].mean() > score[:5].mean() + 0.1  # seen: 0.04 → 0.32
    start, end = (r["eval/rm_score"] for r in rl_rows(tmp_path / "run", "eval/rm_score"))  # held-out prompts
    print("held-out rm score:", start, end)
    assert end > start
    for r in rows:  # the critic trains, the KL is paid as reward, the reward is the learned one only
        assert np.isfinite(r["rl/value_loss"]) and r["rl/value_loss"] > 0
        assert r["rl/rm_running_std"] > 0
    # Resume: lose the last checkpoint of the rlvr stage; the rerun (sft and reward model are
    # complete) continues from step 15 with the critic's head and the RM statistics restored.
    shutil.rmtree(tmp_path / "run" / "2_rlvr" / "checkpoints" / "20")
    run(cfg)
    again = rl_rows(tmp_path / "run")
    assert [r["step"] for r in again] == list(range(20))
    for x, y in zip(rows[15:], again[15:]):
        for k in ("loss", "rl/value_loss", "rl/value_mean", "rl/rm_score_mean", "rl/rm_running_mean", "rl/reward_mean"):
            np.testing.assert_allclose(y[k], x[k], rtol=1e-4, atol=1e-6, err_msg=f"step {x['step']} {k}")
