"""The RL learner on a tiny dense model: its sizes, sampling, config and one update."""

from posttrain.config import base_config
from posttrain.core.optim import lr_schedule
from posttrain.parallel import use_sharding
from posttrain.rl.algo.learner import Learner
from posttrain.sampling.rules import SamplingParams

PROMPTS, G, PROMPT_LEN, NEW = 4, 4, 4, 6
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=NEW, num_samples=G)


def model_cfg():
    m = base_config().model
    m.vocab_size, m.embed_dim, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = (
        64,
        32,
        1,
        2,
        1,
        16,
        64,
    )
    return m


def rl_cfg(**kw):
    r = base_config().rl
    r.prompts_per_step, r.group_size = PROMPTS, G
    r.update(kw)
    return r


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
