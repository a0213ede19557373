"""The tiny dense policy and the scripted multi-turn episodes that several RL test files sample
and compare (so their sampler programs are compiled once per session): a byte tokenizer, a counting
environment, episodes in cohorts, and the check that two rollouts are the same."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import random
import threading
import time

import jax
import numpy as np
from flax import nnx

from posttrain.config import OptimConfig
from posttrain.core.optim import make_optimizer
from posttrain.core.state import create_train_state
from posttrain.data.tokenizer import ByteTokenizer
from posttrain.models.decoder import Decoder
from posttrain.parallel import make_mesh, parse_rules, use_sharding
from posttrain.rl.envs.base import Step, Task
from posttrain.rl.envs.chat import ChatEnv
from posttrain.rl.reward import RewardFunction
from posttrain.rl.rollout.episodes import rollout_episodes
from posttrain.rl.rollout.worker import RolloutWorker
from posttrain.rl.tasks.domains import Domain
from posttrain.rl.verifiers import MathTask
from posttrain.rl.verifiers.math import MathVerifier
from posttrain.sampling.rules import SamplingParams
from tests.support.typed_configs import model

TOK = ByteTokenizer()


def runs(tokens, mask) -> list[list[int]]:
    """Maximal runs of tokens whose mask is True."""
    out, cur = [], []
    for t, m in zip(tokens, mask):
        if m:
            cur.append(t)
        elif cur:
            out, cur = out + [cur], []
    return out + [cur] if cur else out


class CountingEnv(ChatEnv):
    """A multi-turn env without tools: after each model turn the environment answers with a tool
    message, until the turn's first token is even or `max_turns` is reached (so episodes of one
    batch end at different turns). Keeps the actions and observations for the test."""

    max_turns = 3

    def reset(self, task):
        self.actions, self.observations = [], []
        return super().reset(task)

    def step(self, action):
        text, _ = self._take(action)
        self.actions.append(list(action))
        if self.trajectory().turns >= self.max_turns or action[0] % 2 == 0:
            return self._finish(text)
        message = {"role": "tool", "content": f"<output>\nturn {self.trajectory().turns}\n</output>"}
        obs = self._observe(message)
        self.observations.append(obs)
        return Step(obs, None, False, {})


REWARD = RewardFunction({MathTask: MathVerifier()})


def tiny_policy():
    """(graphdef, params, rest, mesh, rules) of the tiny dense policy of tests/rl/tasks/test_repo_domain.py, made
    as it makes it (so its episodes' static sampler programs are shared with that test's)."""
    m = model(vocab_size=264, embed_dim=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
    mesh, rules = make_mesh(dict(data=1), devices=jax.devices()[:1]), parse_rules({})
    with use_sharding(mesh, rules):
        tx = make_optimizer(OptimConfig(), 10)
        graphdef, state, _ = create_train_state(lambda: Decoder(m, rngs=nnx.Rngs(0)), tx, mesh, rules)
    return graphdef, state.params, state.rest, mesh, rules


def tasks(n: int) -> list[Task]:
    return [Task(f"t{i}", ({"role": "user", "content": "add " * (1 + 3 * i)},), MathTask(str(i))) for i in range(n)]


def assert_same_rollouts(static, cont):
    assert len(static.groups) == len(cont.groups)
    for j, (gs, gc) in enumerate(zip(static.groups, cont.groups)):
        assert gs.task.id == gc.task.id and gs.rewards == gc.rewards, j
        for s, (ts, tc) in enumerate(zip(gs.trajectories, gc.trajectories)):
            assert ts.tokens == tc.tokens, (j, s)
            np.testing.assert_array_equal(ts.loss_mask, tc.loss_mask)
            np.testing.assert_allclose(cont.behav[j][s], static.behav[j][s], atol=1e-5, err_msg=f"group {j} sample {s}")


# The episodes in cohorts (rl/rollout/test_episodes.py): tests/rl/tasks/test_repo_domain.py's
# sampling, so the sampler's programs are shared with it.
SAMPLING = SamplingParams(temperature=0.7, top_k=12, top_p=0.9, max_new_tokens=6, stop_ids=(TOK.eos_id,), num_samples=4)
TASKS = [Task(f"t{i}", ({"role": "user", "content": f"say {i}"},), MathTask(str(i))) for i in range(2)]


class SlowEnv(CountingEnv):
    """CountingEnv whose steps take `delay` seconds (plus up to `jitter`), each recorded as
    (start, end) in `log`."""

    def __init__(self, *a, log: list, delay: float = 0.0, jitter: float = 0.0, **kw):
        super().__init__(*a, **kw)
        self.log, self.delay, self.jitter = log, delay, jitter

    def step(self, action):
        t0 = time.perf_counter()
        time.sleep(self.delay + random.uniform(0, self.jitter))
        out = super().step(action)
        self.log.append((t0, time.perf_counter()))
        return out


@dataclasses.dataclass
class RecordingWorker(RolloutWorker):
    """A rollout worker that records each sampler call as (start, end, number of contexts), and
    its contexts."""

    calls: list = dataclasses.field(default_factory=list)
    contexts: list = dataclasses.field(default_factory=list)

    def sample(self, params, rest, prompts, sampling, key):
        t0 = time.perf_counter()
        out = super().sample(params, rest, prompts, sampling, key)
        self.calls.append((t0, time.perf_counter(), len(prompts)))
        self.contexts.append([list(p) for p in prompts])
        return out


def episodes(policy, cohorts: int, key, *, delay=0.0, jitter=0.0, workers=2, slots=None, prefix_cache=None):
    """The episodes of TASKS (4 per task) in `cohorts` cohorts, the envs in episode order, the
    worker (its sampler calls) and the environment steps' (start, end)."""
    graphdef, params, rest, mesh, rules = policy
    envs, steps = [], []
    lock = threading.Lock()

    def make_env():
        with lock:
            envs.append(SlowEnv(TOK, REWARD, max_turn_tokens=6, log=steps, delay=delay, jitter=jitter))
            return envs[-1]

    with use_sharding(mesh, rules), concurrent.futures.ThreadPoolExecutor(workers) as pool:
        worker = RecordingWorker(
            graphdef,
            {"count": Domain("count", TASKS, make_env)},
            SAMPLING,
            TOK.pad_id,
            pool,
            continuous=slots,
            prefix_cache=prefix_cache,
        )
        batch = rollout_episodes(worker, params, rest, [("count", t) for t in TASKS], key, cohorts=cohorts)
    return batch, envs, worker, steps
