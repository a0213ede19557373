"""A learned reward as an RL reward source (RLHF): the Bradley–Terry model of the `reward_model` stage.

`rl.reward_model` names that stage's run dir (its newest checkpoint is loaded, with the model
config it was trained with); `RewardModelScorer` scores whole (prompt, response) token rows on
the device with one jitted function over rows padded to power-of-two buckets, laid out exactly as
the stage trained on them (`data.packing.build_row`: prompt + response with its end-of-turn token,
the head read at the last real token). `RunningMeanStd` normalises the scores by running
statistics (kept in checkpoints), and `combine_rewards` weighs them against verifier rewards.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from posttrain.core.batch import put_batch
from posttrain.core.checkpoint import Checkpointer
from posttrain.core.init import checkpoint_dir, load_model_state
from posttrain.core.state import abstract_model
from posttrain.data.packing import build_row
from posttrain.models.reward import RewardModel
from posttrain.parallel import use_sharding
from posttrain.parallel.sharding import Rules
from posttrain.sampling.generate import bucket

ROW_KEYS = ("inputs", "positions", "segment_ids")


def reward_model_config(path: str) -> ml_collections.ConfigDict:
    """The model config of the `reward_model` run at `path` (from its newest checkpoint's meta)."""
    ckpt = Checkpointer(checkpoint_dir(path), every=0, keep=1, async_save=False)
    step = ckpt.latest_step()
    if step is None:
        ckpt.close()
        raise FileNotFoundError(f"rl.reward_model={path!r}: no checkpoint under {checkpoint_dir(path)}")
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
    return ml_collections.ConfigDict(meta["config"]["model"])


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
    ):
        self.params, self.rest, self.mesh, self.rules = params, rest, mesh, rules
        self.pad_id, self.min_rows, self.min_len = pad_id, min_rows, min_len

        @jax.jit
        def forward(params, rest, inputs, positions, segment_ids):
            rewards, _ = nnx.merge(graphdef, params, rest).reward(inputs, positions, segment_ids)
            return rewards

        self._forward = forward

    @classmethod
    def load(cls, path: str, mesh: Mesh, rules: Rules, *, pad_id: int, **kw) -> RewardModelScorer:
        """The newest checkpoint of the `reward_model` run at `path`, placed on `mesh` by `rules`."""
        model_cfg = reward_model_config(path)
        make = lambda: RewardModel(model_cfg, rngs=nnx.Rngs(0))
        with use_sharding(mesh, rules):
            params, rest, _ = load_model_state(path, make, mesh, rules)
        return cls(nnx.graphdef(abstract_model(make)), params, rest, mesh, rules, pad_id=pad_id, **kw)

    def score(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """Reward of each token row (prompt + response) → [len(rows)] float32. Rows and length are
        padded to power-of-two buckets, so few shapes ever compile."""
        if not rows:
            return np.zeros(0, np.float32)
        n, length = bucket(len(rows), self.min_rows), bucket(max(len(r) for r in rows), self.min_len)
        built = [
            build_row([{"tokens": r, "loss_mask": np.zeros(len(r), bool)}], length, pad_id=self.pad_id) for r in rows
        ]
        empty = build_row([], length, pad_id=self.pad_id)
        batch = {k: np.stack([b[k] for b in built] + [empty[k]] * (n - len(rows))) for k in ROW_KEYS}
        with use_sharding(self.mesh, self.rules):
            out = self._forward(self.params, self.rest, **put_batch(batch))
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
    when rl.reward_model_normalize. Called on the main thread once per trained batch, so the
    statistics a checkpoint saves are those of the batches trained on."""

    def __init__(self, rl_cfg, scorer: RewardModelScorer | None):
        self.scorer, self.stats = scorer, RunningMeanStd()
        self.normalize = rl_cfg.reward_model_normalize
        self.verifier_weight, self.reward_model_weight = rl_cfg.verifier_weight, rl_cfg.reward_model_weight

    @classmethod
    def from_config(cls, rl_cfg, mesh: Mesh, rules: Rules, *, pad_id: int) -> RewardComposer:
        """From the `rl` section; `rl.reward_model` must be a run dir here (a pipeline resolves "@stage")."""
        path = rl_cfg.reward_model
        if path.startswith("@"):
            raise ValueError(
                f"rl.reward_model={path!r} names a pipeline stage: only a pipeline (stage='pipeline') "
                "resolves it; give the reward_model run dir instead"
            )
        return cls(rl_cfg, RewardModelScorer.load(path, mesh, rules, pad_id=pad_id) if path else None)

    def __call__(self, rows: Sequence[Sequence[int]], verifier: np.ndarray) -> tuple[np.ndarray, dict]:
        """Token rows (prompt + response) and their verifier rewards → (training rewards, metrics)."""
        verifier = np.asarray(verifier, np.float32)
        if self.scorer is None:
            return combine_rewards(verifier, None, verifier_weight=self.verifier_weight, reward_model_weight=0.0), {}
        raw = self.scorer.score(rows)
        learned = raw
        if self.normalize:
            self.stats.update(raw)
            learned = self.stats.normalize(raw)
        rewards = combine_rewards(
            verifier, learned, verifier_weight=self.verifier_weight, reward_model_weight=self.reward_model_weight
        )
        return rewards, {
            "rl/rm_score_mean": float(raw.mean()),
            "rl/rm_score_std": float(raw.std()),
            "rl/verifier_reward_mean": float(verifier.mean()),
            "rl/rm_running_mean": self.stats.mean,
            "rl/rm_running_std": self.stats.std,
        }
