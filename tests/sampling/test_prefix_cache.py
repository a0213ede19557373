"""The prefix cache across sampler calls: outputs equal plain sampling (greedy and sampled, same
key) while later turns and shared system prompts are served from cached KV (partial, block-aligned
hits); LRU eviction under the token bound; new weights empty it (stale KV would change the
outputs); `sampling.prefix_cache` reaches the RL worker's multi-turn episodes, bad values raise."""

from __future__ import annotations

import concurrent.futures

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain.errors import UserError
from posttrain.models.decoder import Decoder
from posttrain.rl.envs.base import Step, Task
from posttrain.rl.envs.chat import continuation
from posttrain.rl.reward import RewardFunction
from posttrain.rl.rollout.episodes import rollout_episodes
from posttrain.rl.rollout.worker import RolloutWorker
from posttrain.rl.tasks.domains import Domain
from posttrain.rl.verifiers import MathTask
from posttrain.rl.verifiers.math import MathVerifier
from posttrain.sampling import SamplingParams, generate
from posttrain.sampling.prefix_cache import PrefixCache
from posttrain.stages.rlvr_parts import rollout_prefix_cache
from tests.support.episodes import TOK, CountingEnv
from tests.support.typed_configs import model, run_cfg

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, stop_ids=())
SAMPLED = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=8, num_samples=2, stop_ids=())
RNG = np.random.default_rng(0)
SYSTEM = RNG.integers(1, 64, 20).tolist()  # a shared system prompt: one full block and a bit
USERS = [RNG.integers(1, 64, n).tolist() for n in (3, 9, 14, 6)]
TOOL = [RNG.integers(1, 64, 5).tolist() for _ in range(2)]
FRESH = RNG.integers(1, 64, 10).tolist()


@pytest.fixture(scope="module")
def policy():
    cfg = model(vocab_size=64, embed_dim=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=32)
    return nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)


def same(a, b):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    np.testing.assert_allclose(a.sampling_logprobs, b.sampling_logprobs, atol=1e-5)


def turn_two(first, prompts):
    """Episodes 0, 1 continue (context + completion + tool output); a new user after the system
    prompt (a partial hit: its first block); an unrelated prompt (a miss)."""
    return [prompts[i] + first.completion(i) + TOOL[i] for i in range(2)] + [SYSTEM + USERS[3], FRESH]


@pytest.fixture(scope="module")
def first_turn(policy):
    prompts = [SYSTEM + u for u in USERS[:3]]
    return prompts, generate(*policy, prompts, GREEDY, jax.random.key(0))


def test_turn_two_is_served_from_turn_ones_kv_with_identical_outputs(policy, first_turn):
    cache = PrefixCache(4096)
    prompts, plain1 = first_turn
    same(generate(*policy, prompts, GREEDY, jax.random.key(0), prefix_cache=cache), plain1)
    assert (cache.stats.hits, cache.stats.inserted) == (0, 3)
    assert len(cache.entries) == 2  # prompt 0's single block (system prompt) is a prefix of prompt 1's entry
    second = turn_two(plain1, prompts)
    plain2 = generate(*policy, second, GREEDY, jax.random.key(1))
    cached2 = generate(*policy, second, GREEDY, jax.random.key(1), prefix_cache=cache)
    same(cached2, plain2)
    # turn 1 cached each prompt + all but its last generated token, in whole blocks of 16
    held = [(len(p) + plain1.lengths[i] - 1) // 16 * 16 for i, p in enumerate(prompts[:2])]
    expected = [min(h, (len(s) - 1) // 16 * 16) for h, s in zip(held, second)] + [16, 0]
    assert cache.stats.hits == 3 and cache.stats.hit_tokens == sum(expected) > 32
    assert cache.stats.prompt_tokens == sum(map(len, prompts + second))
    entries = [e.tokens.tolist() for e in cache.entries.values()]  # turn 2 superseded turn 1's entries
    assert not any(a != b and b[: len(a)] == a for a in entries for b in entries)


def test_sampled_outputs_with_the_cache_equal_plain_sampling(policy, first_turn):
    cache = PrefixCache(4096)
    prompts, plain1 = first_turn
    generate(*policy, prompts, GREEDY, jax.random.key(0), prefix_cache=cache)
    second = turn_two(plain1, prompts)
    cached = generate(*policy, second, SAMPLED, jax.random.key(7), prefix_cache=cache)
    same(cached, generate(*policy, second, SAMPLED, jax.random.key(7)))
    assert cache.stats.hits == 3 and cached.tokens.shape[0] == 8


def test_new_weights_empty_the_cache(policy, first_turn):
    graphdef, params, rest = policy
    cache = PrefixCache(4096)
    prompts, plain1 = first_turn
    generate(graphdef, params, rest, prompts, GREEDY, jax.random.key(0), prefix_cache=cache)
    cache.bind(params, rest)
    assert len(cache.entries) == 2 and cache.stats.invalidations == 0  # same weights: kept
    rng = np.random.default_rng(5)
    updated = jax.tree.map(lambda a: a + (0.3 * rng.normal(size=a.shape)).astype(a.dtype), params)  # next version
    second = turn_two(plain1, prompts)
    cached = generate(graphdef, updated, rest, second, GREEDY, jax.random.key(1), prefix_cache=cache)
    same(cached, generate(graphdef, updated, rest, second, GREEDY, jax.random.key(1)))
    assert cache.stats.invalidations == 1 and cache.stats.hits == 0
    assert all(len(e.tokens) for e in cache.entries.values())  # refilled with the new weights' KV


def fake_kv(tokens, layers=1):
    """Per layer (k [1, 2, L], v [1, L, 2]) whose values encode the token ids."""
    t = np.asarray(tokens, np.float32)
    return tuple((np.stack([t, -t])[None], np.stack([t, 2 * t], 1)[None]) for _ in range(layers))


def test_lookup_finds_the_longest_block_aligned_prefix_and_evicts_lru_under_the_bound():
    cache = PrefixCache(48, block=16)
    a, b, c, d = (list(range(s, s + 16)) for s in (100, 200, 300, 400))
    for seq in (a, b, c):
        cache.insert(np.array(seq), fake_kv(seq))
    assert cache.tokens == 48
    entry, n = cache.lookup(np.array(a + [1, 2]))
    assert n == 16 and np.array_equal(entry.kv[0][0][0, 0], np.array(a, np.float32))
    assert cache.lookup(np.array(a))[1] == 0  # one token must stay to prefill
    assert cache.lookup(np.array(a[:8] + b))[1] == 0  # a block matches only after its whole prefix
    cache.insert(np.array(d), fake_kv(d))  # over the bound: b is least recently used
    assert [cache.lookup(np.array(s + [0]))[1] for s in (a, b, c, d)] == [16, 0, 16, 16]
    assert cache.stats.evicted == 1 and cache.tokens == 48
    longer = a + list(range(500, 520))  # a's next turn: supersedes a's entry
    cache.insert(np.array(longer), fake_kv(longer))
    entry, n = cache.lookup(np.array(longer + [0]))
    assert n == 32 and len(entry.tokens) == 32 and cache.tokens <= 48
    assert np.array_equal(entry.kv[0][1][0, :, 1], 2 * np.array(longer[:32], np.float32))
    cache.insert(np.arange(64), fake_kv(range(64)))  # longer than the bound: not kept
    assert cache.lookup(np.arange(65))[1] == 0


class ThreeTurnEnv(CountingEnv):
    """`CountingEnv` whose episodes always run three turns (two tool messages)."""

    def step(self, action):
        text, _ = self._take(action)
        if self.trajectory().turns >= 3:
            return self._finish(text)
        message = {"role": "tool", "content": f"<output>\nturn {self.trajectory().turns}\n</output>"}
        obs = continuation(self.tok, self._messages, [message])
        self._messages.append(message)
        self.trajectory().extend(obs, generated=False)
        return Step(obs, None, False, {})


def test_a_hash_collision_is_a_miss(monkeypatch):
    from posttrain.sampling import prefix_cache

    monkeypatch.setattr(
        prefix_cache, "block_keys", lambda tokens, block: [bytes([i]) for i in range(len(tokens) // block)]
    )
    cache = PrefixCache(64, block=16)
    cache.insert(np.arange(16), fake_kv(range(16)))
    assert cache.lookup(np.arange(17))[1] == 16 and cache.lookup(np.arange(1, 18))[1] == 0


def test_sampling_prefix_cache_key_reaches_episodes_and_bad_values_raise():
    cfg = run_cfg(stage="rlvr")
    assert rollout_prefix_cache(cfg) is None
    with pytest.raises(UserError, match="sampling.prefix_cache=-1"):
        cfg.replace({"sampling.prefix_cache": -1})
    with pytest.raises(ValueError, match="sampling.prefix_cache=512"):
        cfg.replace({"sampling.prefix_cache": 512, "sampling.speculative_k": 2}).check_stages()
    with pytest.raises(ValueError, match="sampling.prefix_cache=512: not supported with sampling.continuous_batching"):
        cfg.replace({"sampling.prefix_cache": 512, "sampling.continuous_batching": True}).check_stages()
    cfg = cfg.replace({"sampling.prefix_cache": 512}).check_stages()
    with pytest.raises(ValueError, match="sampling.prefix_cache"):
        cfg.replace(stage="sft").check_stages()
    cache = rollout_prefix_cache(cfg)
    assert cache.max_tokens == 512

    m = model(vocab_size=264, embed_dim=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
    graphdef, params, rest = nnx.split(Decoder(m, rngs=nnx.Rngs(0)), nnx.Param, ...)
    sampling = SamplingParams(temperature=0.7, top_k=12, max_new_tokens=6, stop_ids=(TOK.eos_id,), num_samples=2)
    reward_fn = RewardFunction({MathTask: MathVerifier()})
    tasks = [Task("t0", ({"role": "user", "content": "say 0 and then some more"},), MathTask("0"))]
    make_env = lambda: ThreeTurnEnv(TOK, reward_fn, max_turn_tokens=6)
    batches = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for prefix_cache in (None, cache):
            worker = RolloutWorker(
                graphdef,
                {"count": Domain("count", tasks, make_env)},
                sampling,
                TOK.pad_id,
                pool,
                episodes=rollout_episodes,
                prefix_cache=prefix_cache,
            )
            batches.append(worker.rollout(params, rest, [("count", tasks[0])], jax.random.key(3)))
    plain, cached = ([t.tokens for t in b.groups[0].trajectories] for b in batches)
    assert cached == plain and [t.turns for t in batches[0].groups[0].trajectories] == [3, 3]
    for p, c in zip(batches[0].behav[0], batches[1].behav[0]):
        np.testing.assert_allclose(c, p, atol=1e-5)
    assert cache.stats.hits > 0 and cache.stats.hit_tokens >= 32  # later turns hit earlier turns' KV


@pytest.mark.slow  # ~1 min loaded per mesh: three more compiles on 8 simulated devices
@pytest.mark.parametrize("axes", [dict(data=2, fsdp=2, tensor=2), dict(data=2, tensor=2, sequence=2)])
def test_cached_sampling_on_a_sharded_mesh_equals_the_unsharded_result(policy, first_turn, axes):
    """Also with the KV cache's time axis split over `sequence` (long context): the cached prefix is
    placed into, and the suffix attends over, a cache whose halves live on different devices."""
    from posttrain.parallel import make_mesh, parse_rules, use_sharding

    prompts, plain1 = first_turn
    second = turn_two(plain1, prompts)
    plain2 = generate(*policy, second, GREEDY, jax.random.key(1))
    cache = PrefixCache(4096)
    with use_sharding(make_mesh(axes), parse_rules({})):
        same(generate(*policy, prompts, GREEDY, jax.random.key(0), prefix_cache=cache), plain1)
        same(generate(*policy, second, GREEDY, jax.random.key(1), prefix_cache=cache), plain2)
    assert cache.stats.hits == 3
