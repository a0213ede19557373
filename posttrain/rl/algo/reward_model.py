"""A learned reward as an RL reward source (RLHF): the Bradley–Terry model of the `reward_model` stage.

`rl.reward_model` names that stage's run dir. A run loads its newest checkpoint, with the model
config it was trained with, and pins it: the RL checkpoints record its step
(`reward_model_step`), and a resumed run loads that step, not whatever is newest by then. Its
tokenizer and vocabulary must be the policy's (`check_matches_policy`, one line naming both: the
reward model reads the policy's token ids). `RewardModelScorer` scores whole (prompt, response)
token rows on the device with one jitted function over rows padded to power-of-two buckets, laid
out exactly as the stage trained on them (`data.packing.build_row`: prompt + response with its
end-of-turn token, the head read at the last real token). `RunningMeanStd` normalises the scores
by running statistics (kept in checkpoints), and `combine_rewards` weighs them against verifier
rewards.

Unfinished responses (`rl.truncated_reward`): a sample whose episode ended without an end of
turn (cut by `rl.max_new_tokens`, or out of `rl.max_turns`) gets, as its training reward, "min"
(the default) the lowest training reward of the judged samples of its batch (every sample of every
process with a verdict, finished or not, as the sources scored them; a verifier error's shaped score
is no judgement and sets no floor): an unfinished response never outranks a finished one, whether
the reward is learned or verified; a number: that reward; "none": what the sources give it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from posttrain.config import ModelConfig, RLConfig
from posttrain.config.syntax import parse_truncated_reward
from posttrain.core.batch import put_batch
from posttrain.core.checkpoint import Checkpointer
from posttrain.core.init import checkpoint_dir, load_model_state
from posttrain.core.state import abstract_model
from posttrain.data.packing import build_row
from posttrain.data.tokenizer import load_tokenizer
from posttrain.errors import UserError
from posttrain.models.reward import RewardModel
from posttrain.parallel import sequence_shards, use_sharding
from posttrain.parallel.sharding import Rules
from posttrain.parallel.zigzag import balanced_batch
from posttrain.rl.rollout.hosts import all_values
from posttrain.sampling.generate import bucket

ROW_KEYS = ("inputs", "positions", "segment_ids")


def reward_model_meta(path: str, step: int | None = None) -> tuple[int, dict]:
    """(step, meta) of the `reward_model` run at `path`: its newest checkpoint, or the one at `step`."""
    ckpt = Checkpointer(checkpoint_dir(path), every=0, keep=1, async_save=False)
    steps = ckpt.all_steps()
    if not steps or (step is not None and step not in steps):
        ckpt.close()
        where = f"no checkpoint under {checkpoint_dir(path)}" if not steps else f"no checkpoint at step {step}"
        pinned = " (the step this run started with, pinned in its checkpoints)" if step is not None and steps else ""
        raise FileNotFoundError(f"rl.reward_model={path!r}: {where}{pinned}; have {steps}")
    step = steps[-1] if step is None else step
    _, _, meta = ckpt.restore(step, {})
    ckpt.close()
    if meta.get("stage") != "reward_model" or "config" not in meta:
        raise ValueError(
            f"rl.reward_model={path!r}: checkpoint {step} is from stage {meta.get('stage')!r}, "
            "expected a run of the 'reward_model' stage"
        )
    if meta["config"].get("lora", {}).get("rank", 0) > 0:
        raise ValueError(
            f"rl.reward_model={path!r}: trained with LoRA (only adapters are checkpointed); "
            "train the reward model with lora.rank=0"
        )
    return step, meta


def reward_model_config(path: str, step: int | None = None) -> ModelConfig:
    """The model config of the `reward_model` run at `path` (its newest checkpoint's, or `step`'s)."""
    return ModelConfig.from_dict(reward_model_meta(path, step)[1]["config"]["model"])


def _tokenizer_fingerprint(spec: str) -> tuple:
    """What must agree for two tokenizers to give the same ids: sizes, specials, a chat's ids."""
    tok = load_tokenizer(spec)
    probe = [{"role": "user", "content": "What is 37+48? ünï 中文"}, {"role": "assistant", "content": "85."}]
    return (tok.vocab_size, tok.pad_id, tok.eos_id, tok.bos_id, tuple(tok.stop_ids), tuple(tok.encode_chat(probe)[0]))


def check_matches_policy(path: str, meta: dict, tokenizer: str, vocab_size: int) -> None:
    """Raise (one line naming both) unless the reward model at `path` (checkpoint `meta`) reads the
    policy's token ids as the policy writes them: the same tokenizer and model.vocab_size."""
    config = meta["config"]
    rm_tok, rm_vocab = config.get("data", {}).get("tokenizer"), config["model"].get("vocab_size")
    same = rm_vocab == vocab_size and rm_tok is not None
    if same and rm_tok != tokenizer:
        try:
            same = _tokenizer_fingerprint(rm_tok) == _tokenizer_fingerprint(tokenizer)
        except (OSError, ValueError) as e:
            raise UserError(
                f"rl.reward_model={path!r}: cannot compare its tokenizer {rm_tok!r} with the policy's "
                f"{tokenizer!r} ({type(e).__name__}: {e})",
                key="rl.reward_model",
            ) from None
    if not same:
        raise UserError(
            f"rl.reward_model={path!r}: the reward model's tokenizer {rm_tok!r} (model.vocab_size={rm_vocab}) "
            f"is not the policy's {tokenizer!r} (model.vocab_size={vocab_size}); it would score other tokens "
            "than the policy wrote: train the reward model on the policy's tokenizer",
            key="rl.reward_model",
        )


class RewardModelScorer:
    """Scores token rows with a reward model's weights: `score(rows) -> [N] float32`."""

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        params: nnx.State,
        rest: nnx.State,
        mesh: Mesh,
        rules: Rules,
        *,
        pad_id: int,
        min_rows: int = 8,
        min_len: int = 16,
        attention_block: int = 512,
    ):
        self.params, self.rest, self.mesh, self.rules = params, rest, mesh, rules
        self.pad_id, self.min_rows, self.min_len, self.block = pad_id, min_rows, min_len, attention_block
        self.step: int | None = None  # the checkpoint step loaded (`load`)

        @jax.jit
        def forward(params, rest, inputs, positions, segment_ids):
            rewards, _ = nnx.merge(graphdef, params, rest).reward(inputs, positions, segment_ids)
            return rewards

        self._forward = forward

    @classmethod
    def load(
        cls, path: str, mesh: Mesh, rules: Rules, *, pad_id: int, step: int | None = None, **kw
    ) -> RewardModelScorer:
        """The newest checkpoint (or the one at `step`) of the `reward_model` run at `path`, placed
        on `mesh` by `rules`; `.step` says which."""
        step, meta = reward_model_meta(path, step)
        model_cfg = ModelConfig.from_dict(meta["config"]["model"])
        make = lambda: RewardModel(model_cfg, rngs=nnx.Rngs(0))
        with use_sharding(mesh, rules):
            params, rest, step = load_model_state(path, make, mesh, rules, step=step)
        kw.setdefault("attention_block", model_cfg.attention_block)
        scorer = cls(nnx.graphdef(abstract_model(make)), params, rest, mesh, rules, pad_id=pad_id, **kw)
        scorer.step = step
        return scorer

    def score(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """Reward of each token row (prompt + response) → [len(rows)] float32. Rows and length are
        padded to power-of-two buckets, so few shapes ever compile; under context parallelism the
        length is a multiple of 2 × the shards and the rows are zig-zagged where that balances."""
        if not rows:
            return np.zeros(0, np.float32)
        shards = sequence_shards(self.mesh, self.rules)[1]
        n, length = bucket(len(rows), self.min_rows), bucket(max(len(r) for r in rows), self.min_len)
        length = -(-length // (2 * shards)) * 2 * shards
        built = [
            build_row([{"tokens": r, "loss_mask": np.zeros(len(r), bool)}], length, pad_id=self.pad_id) for r in rows
        ]
        empty = build_row([], length, pad_id=self.pad_id)
        batch = {k: np.stack([b[k] for b in built] + [empty[k]] * (n - len(rows))) for k in ROW_KEYS}
        with use_sharding(self.mesh, self.rules):
            out = self._forward(self.params, self.rest, **put_batch(balanced_batch(batch, shards, self.block)[0]))
        return np.asarray(jax.device_get(out), np.float32)[: len(rows)]


class RunningMeanStd:
    """Running mean and variance of everything seen (Chan et al.'s parallel update, float64);
    thread-safe; `get_state`/`set_state` for checkpoints."""

    def __init__(self, eps: float = 1e-6):
        self.eps, self.count, self.mean, self.m2 = eps, 0, 0.0, 0.0
        self._lock = threading.Lock()

    def update(self, x: np.ndarray) -> None:
        """Fold a batch of values into the statistics."""
        x = np.asarray(x, np.float64).reshape(-1)
        if not x.size:
            return
        with self._lock:
            n, mean, m2 = x.size, float(x.mean()), float(((x - x.mean()) ** 2).sum())
            total = self.count + n
            delta = mean - self.mean
            self.mean += delta * n / total
            self.m2 += m2 + delta**2 * self.count * n / total
            self.count = total

    @property
    def std(self) -> float:
        """Population standard deviation of the values seen (0 before any)."""
        return float(np.sqrt(self.m2 / self.count)) if self.count else 0.0

    def normalize(self, x: np.ndarray) -> np.ndarray:
        """(x − mean) / (std + eps) under the current statistics, float32."""
        with self._lock:
            mean, std = self.mean, self.std
        return ((np.asarray(x, np.float64) - mean) / (std + self.eps)).astype(np.float32)

    def get_state(self) -> dict:
        with self._lock:
            return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def set_state(self, state: dict) -> None:
        with self._lock:
            self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def combine_rewards(
    verifier: np.ndarray, learned: np.ndarray | None, *, verifier_weight: float, reward_model_weight: float
) -> np.ndarray:
    """The training reward: w_v · verifier reward + w_rm · (normalised) learned reward, float32."""
    out = verifier_weight * np.asarray(verifier, np.float32)
    if learned is not None:
        out = out + reward_model_weight * np.asarray(learned, np.float32)
    return out.astype(np.float32)


class RewardComposer:
    """The RL training reward of each sample: rl.verifier_weight · verifier reward, plus (with
    rl.reward_model) rl.reward_model_weight · the learned reward, normalised by running statistics
    when rl.reward_model_normalize; unfinished samples then get rl.truncated_reward (module
    docstring). Called on the main thread once per trained batch, so the statistics a checkpoint
    saves are those of the batches trained on. `step`: the reward model's checkpoint step (pinned
    in the RL checkpoints), None without one."""

    def __init__(self, rl_cfg: RLConfig, scorer: RewardModelScorer | None):
        self.scorer, self.stats = scorer, RunningMeanStd()
        self.normalize = rl_cfg.reward_model_normalize
        self.verifier_weight, self.reward_model_weight = rl_cfg.verifier_weight, rl_cfg.reward_model_weight
        self.truncated = parse_truncated_reward(rl_cfg.truncated_reward)
        self.step = None if scorer is None else scorer.step

    @classmethod
    def from_config(
        cls,
        rl_cfg: RLConfig,
        mesh: Mesh,
        rules: Rules,
        *,
        pad_id: int,
        policy: tuple[str, int],
        step: int | None = None,
    ) -> RewardComposer:
        """From the `rl` section; `rl.reward_model` must be a run dir here (a pipeline resolves "@stage").
        policy: the policy's (data.tokenizer, model.vocab_size), which the reward model must share;
        step: the reward model step a resumed run started with (None: the newest, at a run's start)."""
        path = rl_cfg.reward_model
        if path.startswith("@"):
            raise ValueError(
                f"rl.reward_model={path!r} names a pipeline stage: only a pipeline (stage='pipeline') "
                "resolves it; give the reward_model run dir instead"
            )
        if not path:
            return cls(rl_cfg, None)
        found, meta = reward_model_meta(path, step)
        check_matches_policy(path, meta, *policy)
        if step is None:
            logging.info("rl.reward_model=%s: step %d (pinned in this run's checkpoints)", path, found)
        return cls(rl_cfg, RewardModelScorer.load(path, mesh, rules, pad_id=pad_id, step=found))

    def __call__(
        self,
        rows: Sequence[Sequence[int]],
        verifier: np.ndarray,
        truncated: Sequence[bool] | None = None,
        judged: Sequence[bool] | None = None,
    ) -> tuple[np.ndarray, dict]:
        """Token rows (prompt + response), their verifier rewards, whether each is unfinished and
        whether each has a verdict (None: all) → (training rewards, metrics)."""
        verifier = np.asarray(verifier, np.float32)
        metrics: dict = {}
        if self.scorer is None:
            rewards = combine_rewards(verifier, None, verifier_weight=self.verifier_weight, reward_model_weight=0.0)
        else:
            raw = self.scorer.score(rows)
            learned = raw
            if self.normalize:
                self.stats.update(raw)
                learned = self.stats.normalize(raw)
            rewards = combine_rewards(
                verifier, learned, verifier_weight=self.verifier_weight, reward_model_weight=self.reward_model_weight
            )
            metrics = {
                "rl/rm_score_mean": float(raw.mean()),
                "rl/rm_score_std": float(raw.std()),
                "rl/verifier_reward_mean": float(verifier.mean()),
                "rl/rm_running_mean": self.stats.mean,
                "rl/rm_running_std": self.stats.std,
            }
        return self._unfinished(rewards, truncated, judged), metrics

    def _unfinished(
        self, rewards: np.ndarray, truncated: Sequence[bool] | None, judged: Sequence[bool] | None
    ) -> np.ndarray:
        """`rewards` with the unfinished samples' set to rl.truncated_reward ("min": the lowest of
        the judged samples', every process's; of all when none has a verdict)."""
        if self.truncated == "none" or truncated is None or not len(rewards):
            return rewards
        mask = np.asarray(truncated, bool)
        judged = np.ones(len(rewards), bool) if judged is None else np.asarray(judged, bool)
        if not len(mask) == len(judged) == len(rewards):
            raise ValueError(f"{len(mask)} truncated and {len(judged)} judged flags for {len(rewards)} rewards")
        value = self.truncated
        if self.truncated == "min":  # every process's rows (a collective, whether or not this one has unfinished ones)
            floor = all_values(rewards[judged])
            value = float(floor.min()) if floor.size else float(all_values(rewards).min())
        return np.where(mask, np.float32(value), rewards).astype(np.float32)
