"""Every rl.* switch acts or is refused at start-up: combinations in which another key makes a
switch inert (or changes it into something its name does not say), one case each."""

import pytest

from posttrain.config import base_config
from tests.support.typed_configs import checked

RM = dict(reward_model="runs/rm", verifier_weight=0.0)


@pytest.mark.parametrize(
    "refused, accepted, match",
    [
        # grpo's (r − mean) / std cancels a scale on the whole reward
        (dict(verifier_weight=2.0), dict(verifier_weight=2.0, advantage="drgrpo"), "rl.verifier_weight=2.0 .*cancels"),
        ({**RM, "reward_model_weight": 2.0}, {**RM, "reward_model_weight": 2.0, "advantage": "rloo"}, "cancels"),
        (
            {**RM, "reward_model_normalize": False},
            {**RM, "reward_model_normalize": False, "verifier_weight": 0.5},
            "cancels",
        ),
        # the delay is a single-turn verification knob
        (dict(verifier_delay=0.1, env="tool"), dict(verifier_delay=0.1), "rl.verifier_delay=0.1 .*multi-turn"),
        # repo_fix verdicts always have format_ok
        (
            dict(format_penalty=0.1, domains="repo_fix"),
            dict(format_penalty=0.1, domains="repo_fix,arithmetic"),
            "format_ok",
        ),
        # with verifier_weight=0 the verifier reward and its shaping are dropped
        ({**RM, "format_penalty": 0.1}, {**RM, "format_penalty": 0.1, "verifier_weight": 0.5}, "rl.format_penalty=0.1"),
        ({**RM, "overlong_buffer": 4}, {**RM, "overlong_buffer": 4, "verifier_weight": 0.5}, "rl.overlong_buffer=4"),
        # GSPO is the sequence ratio with seq-mean-token-mean
        (
            dict(ratio_level="sequence", updates_per_batch=2),
            dict(ratio_level="sequence", updates_per_batch=2, aggregation="seq-mean-token-mean"),
            "rl.ratio_level='sequence' .*seq-mean-token-mean",
        ),
        # the critic's values equal the rollout's at the only step: the clip never acts
        (
            dict(advantage="gae", value_clip=0.1),
            dict(advantage="gae", value_clip=0.1, minibatches=2),
            "rl.value_clip=0.1 .*V = V_old",
        ),
        # Dr. GRPO's constant
        (
            dict(loss_norm_tokens=64),
            dict(loss_norm_tokens=64, aggregation="seq-mean-token-sum"),
            "rl.loss_norm_tokens=64",
        ),
        # dynamic sampling of one-sample groups (PPO with a critic allows them) drops them all
        (
            dict(advantage="gae", group_size=1, filter_groups=True),
            dict(advantage="gae", filter_groups=True),
            "drop every",
        ),
        # masked IS at the truncation's level drops every ratio the cap would truncate
        (dict(is_cap=3.0, is_mask="token"), dict(is_cap=1.5, is_mask="token"), "rl.is_cap=3.0 .*truncation never acts"),
        (
            dict(is_cap=3.0, is_mask="sequence", is_level="sequence"),
            dict(is_cap=3.0, is_mask="sequence"),
            "rl.is_cap=3.0",
        ),
        # top_k that keeps the whole vocabulary
        (dict(top_k=256), dict(top_k=255), "rl.top_k=256 >= model.vocab_size=256"),
    ],
)
def test_a_switch_that_another_key_makes_inert_is_refused(refused, accepted, match):
    cfg = base_config()
    cfg.model.vocab_size = 256
    cfg.rl.update(refused)
    with pytest.raises(ValueError, match=match):
        checked(cfg, "rlvr")
    cfg = base_config()
    cfg.model.vocab_size = 256
    cfg.rl.update(accepted)
    checked(cfg, "rlvr")
