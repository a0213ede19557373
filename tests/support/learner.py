"""The RL learner on a tiny dense model: its sizes, sampling, config and one update."""

from posttrain.core.optim import lr_schedule
from posttrain.parallel import use_sharding
from posttrain.rl.algo.learner import Learner
from posttrain.sampling.rules import SamplingParams
from tests.support.typed_configs import model, rl

PROMPTS, G, PROMPT_LEN, NEW = 4, 4, 4, 6
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=NEW, num_samples=G)


def model_cfg():
    return model(vocab_size=64, embed_dim=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)


def rl_cfg(**kw):
    return rl(**{"prompts_per_step": PROMPTS, "group_size": G, **kw})


def make_learner(setup, sampling=SAMPLING, context=(1, 512), **kw):
    mesh, rules, graphdef, state, shardings, optim, tx = setup
    return Learner(
        graphdef,
        tx,
        lr_schedule(optim, 100),
        shardings,
        rl_cfg=rl_cfg(**kw),
        moe_cfg=model_cfg().moe,
        lora_cfg=None,
        sampling=sampling,
        donate=False,
        seed=0,
        context=context,
    )


def update(setup, learner, batch, num_real):
    mesh, rules, graphdef, state, *_ = setup
    with use_sharding(mesh, rules):
        return learner.update(state, batch, (), 0, num_real)
