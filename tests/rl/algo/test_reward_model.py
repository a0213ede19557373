"""The learned reward as an RL reward source: the scorer loads a `reward_model` run and gives the
reward model's own forward on the same tokens (sharded on 8 devices vs unsharded, any row length
and count); running normalisation and reward composition against numpy."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain.core.checkpoint import Checkpointer
from posttrain.core.init import checkpoint_dir
from posttrain.data.packing import build_row
from posttrain.errors import UserError
from posttrain.models.reward import RewardModel
from posttrain.parallel import make_mesh, parse_rules
from posttrain.rl.algo.reward_model import (
    RewardComposer,
    RewardModelScorer,
    RunningMeanStd,
    check_matches_policy,
    combine_rewards,
    reward_model_config,
    reward_model_meta,
)
from posttrain.stages import reward_model as reward_model_stage
from tests.support.typed_configs import run_cfg, typed


def tiny_reward_model_config(workdir, data_dir):
    return run_cfg(
        {
            "model.vocab_size": 264,
            "model.embed_dim": 32,
            "model.num_layers": 1,
            "model.num_heads": 2,
            "model.num_kv_heads": 1,
            "model.head_dim": 16,
            "model.mlp_dim": 64,
            "model.moe.num_experts": 2,
            "model.moe.expert_mlp_dim": 32,
            "mesh.data": 2,
            "mesh.expert": 2,
            "mesh.tensor": 2,
            "data.synthetic": "arithmetic",
            "data.synthetic_size": 64,
            "reward_model.train_files": "synthetic:",
            "train.steps": 1,
            "train.batch_size": 8,
            "train.seq_len": 64,
            "train.progress": False,
            "checkpoint.every": 1,
        },
        stage="reward_model",
        workdir=str(workdir),
    )


@pytest.fixture(scope="module")
def rm_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    cfg = tiny_reward_model_config(root / "run", root)
    reward_model_stage.run(cfg)
    return cfg


def test_scorer_equals_the_reward_models_own_forward(rm_run):
    cfg = rm_run
    mesh, rules = make_mesh(cfg.mesh.to_dict()), parse_rules(cfg.sharding.rules)
    scorer = RewardModelScorer.load(cfg.workdir, mesh, rules, pad_id=0)
    rng = np.random.default_rng(0)
    rows = [rng.integers(1, 263, size=n).tolist() for n in (5, 40, 17, 64, 1, 23)]  # 6 rows → bucket of 8
    got = scorer.score(rows)
    assert got.shape == (6,) and got.dtype == np.float32

    # Reference: the stage's model class, weights on the host, no mesh, one jitted batch of rows.
    model = RewardModel(reward_model_config(cfg.workdir), rngs=nnx.Rngs(1))
    graphdef, _, _ = nnx.split(model, nnx.Param, ...)
    host = nnx.merge(graphdef, jax.device_get(scorer.params), jax.device_get(scorer.rest))
    built = [build_row([{"tokens": r, "loss_mask": np.zeros(len(r), bool)}], 64) for r in rows]
    batch = {k: np.stack([b[k] for b in built]) for k in ("inputs", "positions", "segment_ids")}
    want, _ = nnx.jit(lambda m, b: m.reward(b["inputs"], b["positions"], b["segment_ids"]))(host, batch)
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-4, atol=1e-5)
    assert np.unique(got).size == len(rows)  # the head reads each row's own last token
    short = [rows[0], rows[2]]  # another length bucket (32)
    np.testing.assert_allclose(scorer.score(short), got[[0, 2]], rtol=1e-5, atol=1e-6)


def test_reward_model_path_must_be_a_reward_model_run(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "checkpoints"), every=1, keep=1, async_save=False)
    ckpt.save(1, {"params": {"w": np.zeros(2, np.float32)}}, meta={"stage": "sft", "config": {}})
    ckpt.close()
    with pytest.raises(ValueError, match=r"rl.reward_model=.*stage 'sft'.*reward_model"):
        reward_model_config(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="rl.reward_model"):
        reward_model_config(str(tmp_path / "nowhere"))


def test_running_mean_std_matches_numpy_and_round_trips():
    rng = np.random.default_rng(1)
    batches = [rng.normal(3.0, 2.0, size=n) for n in (7, 1, 64, 13)]
    stats = RunningMeanStd()
    for i, b in enumerate(batches):
        stats.update(b)
        seen = np.concatenate(batches[: i + 1])
        np.testing.assert_allclose([stats.mean, stats.std], [seen.mean(), seen.std()], rtol=1e-12)
    x = rng.normal(size=5)
    np.testing.assert_allclose(stats.normalize(x), (x - seen.mean()) / (seen.std() + 1e-6), rtol=1e-6)
    restored = RunningMeanStd()
    restored.set_state(stats.get_state())
    restored.update(batches[0])
    stats.update(batches[0])
    assert restored.get_state() == stats.get_state()


def test_combine_rewards():
    v, rm = np.array([1.0, 0.0, 1.0]), np.array([0.5, -1.0, 2.0])
    np.testing.assert_allclose(combine_rewards(v, rm, verifier_weight=0.5, reward_model_weight=2.0), [1.5, -2.0, 4.5])
    np.testing.assert_allclose(combine_rewards(v, None, verifier_weight=1.0, reward_model_weight=2.0), v)


def newer_reward_model(path: str, step: int) -> None:
    """Add checkpoint `step` to the reward_model run at `path`: its weights with the value head
    doubled (other scores), as if the reward model had trained on."""
    cfg = tiny_reward_model_config(path, path)
    mesh, rules = make_mesh(cfg.mesh.to_dict()), parse_rules(cfg.sharding.rules)
    scorer = RewardModelScorer.load(path, mesh, rules, pad_id=0)
    _, meta = reward_model_meta(path)
    params = jax.tree.map(lambda x: x, scorer.params)
    params["value_head"] = jax.tree.map(lambda v: v * 2.0, params["value_head"])
    ckpt = Checkpointer(checkpoint_dir(path), every=1, keep=5, async_save=False)
    ckpt.save(step, {"params": params, "rest": scorer.rest}, meta=meta)
    ckpt.close()


def test_rlvr_with_the_learned_reward_and_a_critic_resumes_exactly(rm_run, tmp_path):
    """The loop's wiring: rewards = 0.5 · verifier + 2 · normalised RM score, PPO with GAE and the
    KL paid as reward; lose the last checkpoint and the rerun repeats the last step exactly (value
    head, optimizer and RM statistics restored) — with the reward model the run started with,
    pinned by step in its checkpoints, though a newer one appeared meanwhile (issue 25 item 10)."""
    import shutil

    from posttrain.stages import rlvr as loop
    from tests.support.rl_runs import rows, tiny

    rm_dir = tmp_path / "rm"
    shutil.copytree(rm_run.workdir, rm_dir)
    cfg = tiny(
        tmp_path / "rl",
        steps=3,
        advantage="gae",
        reward_model=str(rm_dir),
        verifier_weight=0.5,
        reward_model_weight=2.0,
        kl_coef=0.05,
        kl_in_reward=True,
        kl_estimator="k1",  # the only estimator whose reward-paid gradient is ∇KL (checks.INERT_WITH)
        updates_per_batch=2,
        truncated_reward="none",  # the random policy never finishes: keep the learned reward in play
    )
    cfg.checkpoint.every = 2
    cfg = typed(cfg)
    loop.run(cfg)
    before = rows(tmp_path / "rl")
    first = before[0]  # the first batch's normalised RM scores have mean 0
    assert first["rl/reward_mean"] == pytest.approx(0.5 * first["rl/verifier_reward_mean"], abs=1e-5)
    assert first["rl/rm_running_std"] == pytest.approx(first["rl/rm_score_std"], rel=1e-5)
    for r in before:
        assert r["rl/value_loss"] > 0 and "rl/value_explained_var" in r and r["rl/optimizer_steps"] == 2
    shutil.rmtree(tmp_path / "rl" / "checkpoints" / "3")
    ckpt = Checkpointer(str(tmp_path / "rl" / "checkpoints"), every=0, keep=1, async_save=False)
    assert ckpt.restore(2, {})[1]["reward_model_step"] == 1
    ckpt.close()
    newer_reward_model(str(rm_dir), 5)
    loop.run(cfg)
    after = rows(tmp_path / "rl")
    assert [r["step"] for r in after] == [0, 1, 2]
    for k in (
        "loss",
        "rl/value_loss",
        "rl/value_mean",
        "rl/rm_score_mean",
        "rl/rm_running_mean",
        "rl/reward_mean",
        "rl/adv_max",
        "rl/kl",
    ):
        np.testing.assert_allclose(after[2][k], before[2][k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_the_reward_model_must_read_the_policys_tokens(rm_run, tmp_path):
    """One line naming both tokenizers and vocabularies when they differ; another folder holding
    the same tokenizer is the same."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folders = []
    for name, words in (("a", ["what", "is"]), ("b", ["what", "is"]), ("c", ["is", "what"])):
        tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<eos>", *words, "<unk>"])}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text(tok.to_str())
        (tmp_path / name / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
        folders.append(str(tmp_path / name))
    meta = lambda tok, vocab: {"config": {"data": {"tokenizer": tok}, "model": {"vocab_size": vocab}}}
    check_matches_policy("rm", meta("byte", 264), "byte", 264)
    check_matches_policy("rm", meta(folders[0], 264), folders[1], 264)  # same tokenizer, another folder
    for rm, policy in (((folders[0], 264), (folders[2], 264)), (("byte", 264), ("byte", 320))):
        with pytest.raises(
            UserError, match=r"rl.reward_model='rm': the reward model's tokenizer .* is not the policy's"
        ) as e:
            check_matches_policy("rm", meta(*rm), *policy)
        assert "\n" not in str(e.value) and e.value.key == "rl.reward_model"
        assert f"{rm[0]!r} (model.vocab_size={rm[1]})" in str(e.value)
        assert f"{policy[0]!r} (model.vocab_size={policy[1]})" in str(e.value)
    # at start-up, before any weights are read
    mesh, rules = make_mesh(rm_run.mesh.to_dict()), parse_rules(rm_run.sharding.rules)
    rl_cfg = SimpleNamespace(
        reward_model=rm_run.workdir,
        reward_model_normalize=True,
        verifier_weight=1.0,
        reward_model_weight=1.0,
        truncated_reward="min",
    )
    with pytest.raises(
        UserError,
        match=r"tokenizer 'byte' \(model.vocab_size=264\) is not the policy's 'byte' \(model.vocab_size=512\)",
    ):
        RewardComposer.from_config(rl_cfg, mesh, rules, pad_id=0, policy=("byte", 512))
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 9 \(the step this run started with"):
        RewardComposer.from_config(rl_cfg, mesh, rules, pad_id=0, policy=("byte", 264), step=9)
    assert RewardComposer.from_config(rl_cfg, mesh, rules, pad_id=0, policy=("byte", 264)).step == 1


def test_unfinished_responses_get_the_truncated_reward_learned_or_verified():
    """rl.truncated_reward: "min" pays an unfinished sample the batch's lowest reward (it outranks
    no finished one, though the reward model liked it), a number pays that, "none" leaves the
    sources' scores; without a reward model the verifier's reward alike. Bad values name the key."""
    from posttrain.config import base_config

    class FakeScorer:
        step = 3

        def score(self, rows):
            return np.asarray([float(sum(r)) for r in rows], np.float32)

    rows, verifier = [[1, 2], [3], [40, 50, 60]], np.asarray([1.0, 0.0, -0.5], np.float32)
    unfinished = [False, False, True]
    cfg = lambda mode: SimpleNamespace(
        reward_model_normalize=False, verifier_weight=1.0, reward_model_weight=1.0, truncated_reward=mode
    )
    learned = np.asarray([4.0, 3.0, 149.5], np.float32)  # the unfinished row scores highest
    for mode, want in (("none", learned), ("min", [4.0, 3.0, 3.0]), ("-2.5", [4.0, 3.0, -2.5])):
        got, _ = RewardComposer(cfg(mode), FakeScorer())(rows, verifier, unfinished)
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=mode)
    for mode, want in (("none", verifier), ("min", [1.0, 0.0, -0.5]), ("-2.5", [1.0, 0.0, -2.5])):
        got, _ = RewardComposer(cfg(mode), None)(rows, verifier, unfinished)
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=mode)
    got, _ = RewardComposer(cfg("min"), None)(rows, np.asarray([1.0, 0.0, 0.5], np.float32), unfinished)
    np.testing.assert_allclose(got, [1.0, 0.0, 0.0])  # a shaping bonus does not lift it above a finished answer
    assert RewardComposer(cfg("min"), FakeScorer()).step == 3 and RewardComposer(cfg("min"), None).step is None
    for bad in ("lowest", "nan", "inf", ""):
        config = base_config()
        config.rl.truncated_reward = bad
        with pytest.raises(UserError, match=rf"config.rl.truncated_reward={bad!r}: expected 'min'") as e:
            typed(config)
        assert e.value.key == "rl.truncated_reward"


def test_reward_composer_weights_and_normalisation_switch():
    """rl.verifier_weight / rl.reward_model_weight weight the two sources; rl.reward_model_normalize
    puts the learned score through its running statistics (off: the raw score)."""

    class FakeScorer:
        step = 1

        def score(self, rows):
            return np.asarray([float(sum(r)) for r in rows], np.float32)

    rows, verifier = [[1, 2], [3], [4, 5, 6]], np.asarray([1.0, 0.0, 1.0], np.float32)
    raw = np.asarray([3.0, 3.0, 15.0], np.float32)
    cfg = lambda normalize: SimpleNamespace(
        reward_model_normalize=normalize, verifier_weight=0.5, reward_model_weight=2.0, truncated_reward="min"
    )
    plain, _ = RewardComposer(cfg(False), FakeScorer())(rows, verifier)
    np.testing.assert_allclose(plain, 0.5 * verifier + 2.0 * raw, rtol=1e-6)
    composer = RewardComposer(cfg(True), FakeScorer())
    normalised, _ = composer(rows, verifier)
    np.testing.assert_allclose(normalised, 0.5 * verifier + 2.0 * (raw - raw.mean()) / (raw.std() + 1e-6), rtol=1e-5)
    assert not np.allclose(plain, normalised)


def test_the_truncated_reward_min_is_the_lowest_judged_reward():
    """rl.truncated_reward=min: a verifier error's shaped score (−1 here) is no judgement, so it does
    not lower what an unfinished answer is paid: the floor is the judged samples' minimum (0)."""
    cfg = SimpleNamespace(
        reward_model_normalize=False, verifier_weight=1.0, reward_model_weight=1.0, truncated_reward="min"
    )
    verifier = np.asarray([1.0, 0.0, -1.0, 0.5], np.float32)  # sample 2: the verifier failed
    unfinished, judged = [False, False, False, True], [True, True, False, True]
    got, _ = RewardComposer(cfg, None)([[1]] * 4, verifier, unfinished, judged)
    np.testing.assert_allclose(got, [1.0, 0.0, -1.0, 0.0])
    got, _ = RewardComposer(cfg, None)([[1]] * 4, verifier, unfinished, [False] * 4)  # no verdict at all
    np.testing.assert_allclose(got, [1.0, 0.0, -1.0, -1.0])
