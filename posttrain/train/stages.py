"""The gradient stages: SFT, reward model (Bradley–Terry) and DPO, as `Stage`s for the shared loop.

Each differs only in its model, loss and batches; `loop.train` does the rest.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain import storage
from posttrain.data.examples import sft_messages
from posttrain.data.pipeline import preference_batches, read_jsonl, sft_batches
from posttrain.data.tokenizer import Tokenizer, load_tokenizer
from posttrain.eval.long_context_eval import make_long_context_eval
from posttrain.models.decoder import Decoder
from posttrain.models.layers import dtype_of, param
from posttrain.parallel import is_primary, mesh_and_rules, use_sharding
from posttrain.sampling.generate import generate
from posttrain.sampling.rules import SamplingParams
from posttrain.train.data_files import resolve_data_files
from posttrain.train.init import load_model_state, overlay
from posttrain.train.loop import Result, Stage, put_batch, train
from posttrain.train.losses import bradley_terry_loss, dpo_loss, sequence_logprobs
from posttrain.train.state import abstract_model, init_model_state
from posttrain.train.step import lm_loss, moe_penalty, token_cross_entropy

SIDES = ("chosen", "rejected")


class RewardModel(Decoder):
    """The decoder with a scalar value head read at each row's last real token."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.value_head = param(rngs, jax.nn.initializers.normal(cfg.embed_dim ** -0.5), (cfg.embed_dim,),
                                ("embed",), dtype_of(cfg.param_dtype))

    def reward(self, tokens, positions, segment_ids) -> tuple[jax.Array, dict]:
        """[B, S] right-padded rows (segment id 0 = padding) → rewards [B] (float32), MoE aux."""
        hidden, aux = self.hidden_states(tokens, positions, segment_ids, update_bias=True)
        last = jnp.maximum((segment_ids != 0).sum(axis=1) - 1, 0)
        h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
        return (h.astype(jnp.float32) @ self.value_head[...].astype(jnp.float32)), aux


def both_sides(batch: dict, key: str) -> jax.Array:
    """Chosen rows then rejected rows: one forward pass for the pair."""
    return jnp.concatenate([batch[f"chosen_{key}"], batch[f"rejected_{key}"]], axis=0)


def reward_model_loss(model: RewardModel, batch: dict, moe_cfg) -> tuple[jax.Array, dict]:
    """Bradley–Terry loss on a batch of preference pairs."""
    rewards, aux = model.reward(both_sides(batch, "inputs"), both_sides(batch, "positions"),
                                both_sides(batch, "segment_ids"))
    chosen, rejected = jnp.split(rewards, 2)
    loss, metrics = bradley_terry_loss(chosen, rejected)
    loss = loss + moe_penalty(aux, moe_cfg)
    return loss, {**metrics, "loss": loss}


def pair_logprobs(model: Decoder, batch: dict, *, update_bias: bool) -> tuple[jax.Array, jax.Array, dict]:
    """Summed response log-probs [B] of chosen and rejected responses, and the MoE aux."""
    logits, aux = model(both_sides(batch, "inputs"), both_sides(batch, "positions"),
                        both_sides(batch, "segment_ids"), update_bias=update_bias)
    logp = sequence_logprobs(logits, both_sides(batch, "targets"), both_sides(batch, "loss_mask"))
    chosen, rejected = jnp.split(logp, 2)
    return chosen, rejected, aux


def dpo_stage_loss(model: Decoder, batch: dict, ref_params, ref_rest, *, graphdef, dpo_cfg,
                   moe_cfg) -> tuple[jax.Array, dict]:
    """DPO against the frozen reference (the starting weights), computed in the same step."""
    ref = nnx.merge(graphdef, jax.lax.stop_gradient(ref_params), ref_rest)
    ref_chosen, ref_rejected, _ = pair_logprobs(ref, batch, update_bias=False)
    chosen, rejected, aux = pair_logprobs(model, batch, update_bias=True)
    loss, metrics = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=dpo_cfg.beta,
                             loss_type=dpo_cfg.loss_type, label_smoothing=dpo_cfg.label_smoothing)
    loss = loss + moe_penalty(aux, moe_cfg)
    return loss, {**metrics, "loss": loss}


def make_evaluator(metric_fn, make_batches):
    """eval_fn(model, step) → metrics averaged over a finite pass of `make_batches()`, jitted once."""
    compiled = {}

    def eval_fn(model: nnx.Module, step: int | None = None) -> dict:
        graphdef, state = nnx.split(model)
        if "fn" not in compiled:
            compiled["fn"] = jax.jit(lambda state, batch: metric_fn(nnx.merge(graphdef, state), batch))
        sums, weight = {}, 0.0
        for batch in make_batches():
            metrics, w = compiled["fn"](state, put_batch(batch))
            w = float(w)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * w
            weight += w
        return {k: v / max(weight, 1e-9) for k, v in sums.items()}
    return eval_fn


def combine_evals(*fns):
    """One eval_fn(model, step) returning the union of the given ones' metrics (None entries
    skipped; None when there are none)."""
    fns = [f for f in fns if f is not None]
    if not fns:
        return None
    return lambda model, step=None: {k: v for f in fns for k, v in f(model, step).items()}


def _finite(make):
    """An iterator over one epoch in file order that stops at the padding rows of the last batch."""
    def batches():
        it = make()
        seen = -1
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            if it.epoch != seen and seen >= 0:
                return
            seen = it.epoch
            yield batch
    return batches


def _data_kw(cfg) -> dict:
    d = cfg.data
    fields = dict(kv.split("=", 1) for kv in d.fields.split(",") if kv) if d.fields else None
    return dict(on_error=d.on_error, fields=fields)


def with_stage_overrides(cfg, stage: str):
    """`cfg` with `<stage>.steps` / `<stage>.lr` (when non-zero) in train.steps / optim.lr."""
    cfg = cfg.copy_and_resolve_references()
    if cfg[stage].steps:
        cfg.train.steps = cfg[stage].steps
    if cfg[stage].lr:
        cfg.optim.lr = cfg[stage].lr
    return cfg


def _tokenizer(cfg) -> Tokenizer:
    tok = load_tokenizer(cfg.data.tokenizer)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"data.tokenizer={cfg.data.tokenizer!r} has {tok.vocab_size} tokens but "
                         f"model.vocab_size={cfg.model.vocab_size}")
    return tok


def _require(files: str, key: str) -> str:
    if not files:
        raise ValueError(f"config.{key} is empty: give a JSONL path or glob (local, gs:// or memory://)")
    return files


def init_model_from(cfg, make_source):
    """`Stage.init_model`: overlay the variables of `cfg.init_from`'s newest checkpoint (a model
    built by `make_source`) on the freshly initialised ones."""
    if not cfg.init_from:
        return None

    def init(params, rest):
        mesh, rules = mesh_and_rules(cfg)
        src_params, src_rest, step = load_model_state(cfg.init_from, make_source, mesh, rules)
        logging.info("init_from %s (step %d)", cfg.init_from, step)
        return overlay(params, src_params), overlay(rest, src_rest)
    return init


def sample_prompts(files: str, tok: Tokenizer, n: int, fields=None) -> list[tuple[str, list[int]]]:
    """The first `n` conversations of `files` up to their last assistant turn, as (text, prompt ids)."""
    out = []
    for rec in itertools.islice(read_jsonl(files), n):
        messages, _ = sft_messages(rec.data, fields)
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
        ids, _ = tok.encode_chat(messages[:last], add_generation_prompt=True)
        out.append((messages[last - 1]["content"] if last else "", ids))
    return out


def make_sampler_log(cfg, tok: Tokenizer, files: str, n: int = 3):
    """sample_fn for `Stage`: greedy completions of a few held-out prompts → `{workdir}/samples.jsonl`."""
    prompts = sample_prompts(files, tok, n, _data_kw(cfg)["fields"])
    sampling = SamplingParams(temperature=0.0, max_new_tokens=cfg.sft.sample_tokens, stop_ids=tuple(tok.stop_ids))

    def sample_fn(model: nnx.Module, step: int) -> None:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        out = generate(graphdef, params, rest, [ids for _, ids in prompts], sampling, jax.random.key(0),
                       pad_id=tok.pad_id)
        lines = []
        for i, (text, _) in enumerate(prompts):
            completion = tok.decode(out.completion(i))
            lines.append(json.dumps({"step": step, "prompt": text, "completion": completion}) + "\n")
            logging.info("sample %d: %r → %r", i, text[-80:], completion[:160])
        if is_primary():
            storage.append_text(storage.join(cfg.workdir, "samples.jsonl"), "".join(lines))
    return sample_fn


def sft(cfg) -> Result:
    """Supervised fine-tuning: next-token loss on response tokens of packed conversations."""
    cfg = with_stage_overrides(cfg, "sft")
    tok = _tokenizer(cfg)
    resolve_data_files(cfg, "sft", "sft", tok)
    kw = _data_kw(cfg)
    make = lambda: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    train_files = _require(cfg.sft.train_files, "sft.train_files")
    batches_for = lambda seq_len: sft_batches(
        train_files, tok, batch_size=cfg.train.batch_size, seq_len=seq_len, seed=cfg.seed, packing=cfg.data.packing,
        truncate=cfg.data.truncate, final_seq_len=cfg.train.seq_len, **kw)
    eval_fn = None
    if cfg.sft.eval_files:
        def metric(model, batch):
            logits, _ = model(batch["inputs"], batch["positions"], batch["segment_ids"])
            ce, n = token_cross_entropy(logits, batch["targets"], batch["loss_mask"])
            return {"loss": ce}, n
        eval_fn = make_evaluator(metric, _finite(lambda: sft_batches(
            cfg.sft.eval_files, tok, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len, seed=0,
            packing=cfg.data.packing, truncate=cfg.data.truncate, shuffle=False, epochs=1, **kw)))
    eval_fn = combine_evals(eval_fn, make_long_context_eval(cfg, tok))
    sample_fn = make_sampler_log(cfg, tok, cfg.sft.eval_files) if cfg.sft.eval_files and cfg.sft.sample_tokens else None
    stage = Stage("sft", make, functools.partial(lm_loss, moe_cfg=cfg.model.moe), batches_for(cfg.train.seq_len),
                  batches_for=batches_for, eval_fn=eval_fn, sample_fn=sample_fn, init_model=init_model_from(cfg, make))
    return train(cfg, stage)


def _preference(cfg, files: str, *, eval: bool, tok: Tokenizer, kw: dict):
    make = lambda: preference_batches(files, tok, batch_size=cfg.train.batch_size, max_len=cfg.train.seq_len,
                                      seed=0 if eval else cfg.seed, shuffle=not eval, epochs=1 if eval else None, **kw)
    return _finite(make) if eval else make()


PREFERENCE_AXES = {f"{s}_{k}": ("batch", "length") for s in SIDES
                   for k in ("inputs", "targets", "loss_mask", "positions", "segment_ids")}


def reward_model(cfg) -> Result:
    """Reward model: decoder + scalar head trained with the Bradley–Terry loss on preference pairs."""
    cfg = with_stage_overrides(cfg, "reward_model")
    if cfg.eval.long_context.lengths:
        raise ValueError(f"eval.long_context.lengths={cfg.eval.long_context.lengths!r}: a reward model does not "
                         "generate; evaluate long context in the sft or dpo stage")
    resolve_data_files(cfg, "reward_model", "preference")
    tok, kw = _tokenizer(cfg), _data_kw(cfg)
    make = lambda: RewardModel(cfg.model, rngs=nnx.Rngs(cfg.seed))
    loss = functools.partial(reward_model_loss, moe_cfg=cfg.model.moe)
    eval_fn = None
    if cfg.reward_model.eval_files:
        def metric(model, batch):
            _, m = loss(model, batch)
            return {k.removeprefix("rm/"): v for k, v in m.items() if k.startswith("rm/")}, batch["chosen_inputs"].shape[0]
        eval_fn = make_evaluator(metric, _preference(cfg, cfg.reward_model.eval_files, eval=True, tok=tok, kw=kw))
    batches = _preference(cfg, _require(cfg.reward_model.train_files, "reward_model.train_files"), eval=False,
                          tok=tok, kw=kw)
    decoder = lambda: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    return train(cfg, Stage("reward_model", make, loss, batches, batch_axes=PREFERENCE_AXES, eval_fn=eval_fn,
                            init_model=init_model_from(cfg, decoder)))


def dpo(cfg) -> Result:
    """DPO from `init_from` (or the seed's initial weights); the reference is that starting point."""
    cfg = with_stage_overrides(cfg, "dpo")
    resolve_data_files(cfg, "dpo", "preference")
    tok, kw = _tokenizer(cfg), _data_kw(cfg)
    make = lambda: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    mesh, rules = mesh_and_rules(cfg)
    with use_sharding(mesh, rules):
        if cfg.init_from:
            ref_params, ref_rest, _ = load_model_state(cfg.init_from, make, mesh, rules)
        else:
            ref_params, ref_rest = init_model_state(make, mesh, rules)
    graphdef = nnx.graphdef(abstract_model(make))
    loss = functools.partial(dpo_stage_loss, graphdef=graphdef, dpo_cfg=cfg.dpo, moe_cfg=cfg.model.moe)
    eval_fn = None
    if cfg.dpo.eval_files:
        def metric(model, batch):
            _, m = loss(model, batch, ref_params, ref_rest)
            return {k.removeprefix("dpo/"): v for k, v in m.items() if k.startswith("dpo/")}, batch["chosen_inputs"].shape[0]
        eval_fn = make_evaluator(metric, _preference(cfg, cfg.dpo.eval_files, eval=True, tok=tok, kw=kw))
    eval_fn = combine_evals(eval_fn, make_long_context_eval(cfg, tok))
    batches = _preference(cfg, _require(cfg.dpo.train_files, "dpo.train_files"), eval=False, tok=tok, kw=kw)
    # The policy starts as a copy of the reference (the step donates the policy's buffers).
    start = lambda params, rest: jax.tree.map(jnp.copy, (ref_params, ref_rest))
    stage = Stage("dpo", make, loss, batches, batch_axes=PREFERENCE_AXES, extra=(ref_params, ref_rest),
                  eval_fn=eval_fn, init_model=start)
    return train(cfg, stage)
