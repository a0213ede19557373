"""Speculative decoding against plain decoding and the policy's exact distribution: greedy output
identical, log-probs the policy's, sampled sequences distributed as the policy's (chi-square on
every 3-token continuation of a tiny vocabulary), and a wrong acceptance rule caught."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from posttrain.models.decoder import Decoder
from posttrain.models.logprobs import token_logprobs
from posttrain.parallel.mesh import ACCELERATOR_PATHS_ENV
from posttrain.sampling import SamplingParams, generate, speculative
from tests.support.typed_configs import model, run_cfg

PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 2, 8, 6, 3, 9, 1, 5], [2], [3, 3, 8, 1, 12]]


def model_config(kind, vocab=64):
    shape = dict(vocab_size=vocab, embed_dim=16, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=32)
    moe = dict(num_experts=8, top_k=2, expert_mlp_dim=16, first_dense=1) if kind == "moe" else {}
    return model({f"moe.{k}": v for k, v in moe.items()}, **shape, qk_norm=True)


@functools.cache
def policy(kind):
    """(graphdef, params, rest) of the 3-layer model, made once per kind."""
    return nnx.split(Decoder(model_config(kind), rngs=nnx.Rngs(0)), nnx.Param, ...)


@pytest.mark.parametrize("branch", ["cpu", "accelerator"])
@pytest.mark.parametrize("kind", ["dense", pytest.param("moe", marks=pytest.mark.slow)])  # MoE: ~3 min loaded
def test_greedy_speculative_equals_plain_decoding(kind, branch, monkeypatch):
    """Against the CPU's plain decoding, on either branch (`parallel.accelerator_paths`): the CPU's
    unrolled layers, or the stacked KV cache that GPUs and TPUs extend under a loop over each
    stack (before, `extend` indexed the stacked cache per layer and failed)."""
    graphdef, params, rest = policy(kind)
    plain = SamplingParams(temperature=0.0, max_new_tokens=10, stop_ids=(7,))
    spec = SamplingParams(temperature=0.0, max_new_tokens=10, stop_ids=(7,), speculative_k=3, draft_layers=1)
    monkeypatch.delenv(ACCELERATOR_PATHS_ENV, raising=False)
    a = generate(graphdef, params, rest, PROMPTS, plain, jax.random.key(0), max_new_tokens=[10, 4, 10, 7])
    if branch == "accelerator":
        monkeypatch.setenv(ACCELERATOR_PATHS_ENV, "1")
    b = generate(graphdef, params, rest, PROMPTS, spec, jax.random.key(0), max_new_tokens=[10, 4, 10, 7])
    np.testing.assert_array_equal(b.tokens, a.tokens)
    np.testing.assert_array_equal(b.lengths, a.lengths)
    np.testing.assert_array_equal(b.stop_reason, a.stop_reason)
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=2e-5)
    assert 0 < b.speculative["rounds"] < a.lengths.sum() and 0 <= b.acceptance_rate <= 1


VOCAB, NEW, DRAWS = 6, 3, 6000


@pytest.fixture(scope="module")
def tiny_policy():
    """A 3-layer policy over 6 tokens, its exact probability of every 3-token continuation of the
    prompt (from full forward passes), and speculative samples of it at temperature 1."""
    graphdef, params, rest = nnx.split(Decoder(model_config("dense", VOCAB), rngs=nnx.Rngs(3)), nnx.Param, ...)
    prompt = [1, 4, 2]
    seqs = np.array(list(itertools.product(range(VOCAB), repeat=NEW)), np.int32)
    rows = np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], axis=1)
    logits = nnx.merge(graphdef, params, rest)(jnp.asarray(rows))[0]
    lp = np.asarray(token_logprobs(logits[:, :-1], jnp.asarray(rows[:, 1:])))[:, len(prompt) - 1 :]
    exact = np.exp(lp.sum(1).astype(np.float64))
    return graphdef, params, rest, prompt, seqs, exact, lp


def chi_square_pvalue(tokens, seqs, exact):
    """p-value of the observed 3-token sequences against the exact probabilities (cells with an
    expected count below 5 pooled)."""
    index = {tuple(s): i for i, s in enumerate(seqs.tolist())}
    counts = np.bincount([index[tuple(t)] for t in tokens.tolist()], minlength=len(seqs))
    expected = exact / exact.sum() * len(tokens)
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    return stats.chisquare(obs, exp).pvalue


def speculative_samples(tiny_policy, monkeypatch=None):
    graphdef, params, rest, prompt, *_ = tiny_policy
    sampling = SamplingParams(temperature=1.0, max_new_tokens=NEW, num_samples=DRAWS, speculative_k=2, draft_layers=1)
    return generate(graphdef, params, rest, [prompt], sampling, jax.random.key(7))


def test_speculative_samples_follow_the_policy_distribution(tiny_policy):
    graphdef, params, rest, prompt, seqs, exact, lp = tiny_policy
    out = speculative_samples(tiny_policy)
    assert (out.lengths == NEW).all()
    p = chi_square_pvalue(out.tokens, seqs, exact)
    print("chi-square p", p, "acceptance", out.acceptance_rate)
    assert p > 1e-3
    assert 0.2 < out.acceptance_rate < 1.0  # the draft differs from the policy, yet helps
    # the returned log-probs are the policy's own
    index = {tuple(s): i for i, s in enumerate(seqs.tolist())}
    ref = lp[[index[tuple(t)] for t in out.tokens.tolist()]]
    np.testing.assert_allclose(out.logprobs, ref, atol=2e-5)


def test_a_wrong_acceptance_rule_fails_the_same_check(tiny_policy, monkeypatch):
    """Always accepting the drafts (sampling the draft model) must fail the chi-square check."""
    seqs, exact = tiny_policy[4], tiny_policy[5]
    right = speculative.accept

    def always(key, drafts, q, p, greedy):
        a, t = right(key, drafts, q, p, greedy)
        return jnp.full_like(a, drafts.shape[1]), t

    monkeypatch.setattr(speculative, "accept", always)
    speculative.speculative_program.clear_cache()
    try:
        out = speculative_samples(tiny_policy)
    finally:
        speculative.speculative_program.clear_cache()
    p = chi_square_pvalue(out.tokens, seqs, exact)
    print("wrong rule chi-square p", p)
    assert p < 1e-6


def test_sampling_speculative_keys_reach_the_rollouts_or_raise():
    from posttrain.stages.rlvr_parts import rollout_sampling

    cfg = run_cfg(stage="rlvr")
    assert rollout_sampling(cfg, (1,)).speculative_k == 0
    cfg = cfg.replace({"sampling.speculative_k": 4, "sampling.draft_layers": 2}).check_stages()
    assert (rollout_sampling(cfg, (1,)).speculative_k, rollout_sampling(cfg, (1,)).draft_layers) == (4, 2)
    with pytest.raises(ValueError, match="sampling.draft_layers"):
        cfg.replace({"sampling.draft_layers": cfg.model.num_layers + 1}).check_stages()
    with pytest.raises(ValueError, match="no draft without sampling.speculative_k"):
        cfg.replace({"sampling.speculative_k": 0, "sampling.draft_layers": 2}).check_stages()
    with pytest.raises(ValueError, match="speculative_k"):
        SamplingParams(speculative_k=-1)
