"""The `model` section: the decoder's shape, attention, RoPE scaling and Mixture-of-Experts keys, and
the values its enum keys take (the modules that implement them import these)."""

from __future__ import annotations

from posttrain.config.fields import Section, bounded, choice, section
from posttrain.errors import UserError

ATTENTION_KERNELS = ("xla", "blockwise", "cudnn", "splash")  # models.attention
ROPE_SCALINGS = ("", "linear", "dynamic", "yarn", "llama3")  # models.attention.RopeScaling
CONTEXT_PARALLEL = ("all_gather", "ring", "auto")  # ops.context_parallel
REMAT_MODES = ("none", "full", "dots")  # models.decoder.REMAT_POLICIES, and none
DTYPES = ("float32", "bfloat16", "float16")  # models.layers
MOE_ROUTERS = ("softmax", "sigmoid")  # models.moe.layer
DISPATCHES = ("auto", "ragged", "padded")  # models.moe.dispatch
# off: the learner routes each token itself; sampler: it replays the experts the sampler chose
ROUTING_REPLAY = ("off", "sampler")  # rl.rollout.routing
VISION_ENCODERS = ("none", "linear", "vit")  # models.vision.make_vision


@section
class RopeScalingConfig(Section):
    """`model.rope_scaling`: Hugging Face's `rope_scaling` (see models.attention.RopeScaling)."""

    KEY = "model.rope_scaling"
    type: str = choice(ROPE_SCALINGS)
    factor: float
    original_max_position_embeddings: int
    low_freq_factor: float
    high_freq_factor: float
    beta_fast: float
    beta_slow: float
    attention_factor: float
    truncate: bool


@section
class MoEConfig(Section):
    """`model.moe`: routed experts (none when num_experts is 0). `routing_replay` (off | sampler):
    whether the RL learner replays the experts the sampler chose for each token (`rl.rollout.routing`;
    only with experts, the rlvr stage and a sampler that records them)."""

    KEY = "model.moe"
    num_experts: int = bounded(ge=0)
    top_k: int = bounded(ge=1)
    expert_mlp_dim: int
    router: str = choice(MOE_ROUTERS)
    norm_topk_prob: bool
    routed_scaling: float
    bias_update_rate: float
    num_shared_experts: int
    shared_mlp_dim: int
    aux_loss_coef: float
    z_loss_coef: float
    capacity_factor: float = bounded(ge=0)
    first_dense: int
    every: int
    dense_layers: tuple[int, ...]
    dispatch: str = choice(DISPATCHES)
    routing_replay: str = choice(ROUTING_REPLAY)

    def check_rules(self) -> None:
        """A token picks at most every expert."""
        if self.num_experts and self.top_k > self.num_experts:
            raise UserError(
                f"config.{self.key}.top_k={self.top_k}: expected <= {self.key}.num_experts={self.num_experts}",
                key=f"{self.key}.top_k",
            )
        if self.routing_replay != "off" and not self.num_experts:
            raise UserError(
                f"config.{self.key}.routing_replay={self.routing_replay!r} needs a Mixture-of-Experts model: "
                f"{self.key}.num_experts=0 (dense) has no routing to replay; set routing_replay='off'",
                key=f"{self.key}.routing_replay",
            )


@section
class VisionConfig(Section):
    """`model.vision`: images as patch tokens in the token stream. `encoder` none (text only: no
    vision parameters) | linear (a Fuyu-style linear patch embedding) | vit (a ViT tower and a
    2-layer projector, `models.vit`); `patch_positions` (linear only) adds a learned embedding of
    each patch's place in its image, as ViT and Pix2Struct do; each image is resized to `image_size`² and cut into
    (image_size / patch_size)² patches, whose placeholder tokens (`image_token_id`) the encoded
    patches replace. The vit_* keys size the tower (read only with encoder=vit; `vit_final_norm`:
    a LayerNorm after the last layer — LLaVA's selected layer has none); the tower normalises
    each channel of the [0, 1] pixels as (x - image_mean) / image_std (a HF processor's
    constants, e.g. 0.5 / 0.5 for SigLIP)."""

    KEY = "model.vision"
    encoder: str = choice(VISION_ENCODERS)
    image_size: int = bounded(ge=1)
    patch_size: int = bounded(ge=1)
    image_token_id: int = bounded(ge=0)
    patch_positions: bool
    vit_layers: int = bounded(ge=1)
    vit_width: int = bounded(ge=1)
    vit_heads: int = bounded(ge=1)
    vit_mlp_dim: int = bounded(ge=1)
    vit_final_norm: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]

    def check_rules(self) -> None:
        """Patches tile the image exactly; the tower's heads split its width; one mean and one
        nonzero std per RGB channel; normalisation only where the tower applies it."""
        if self.vit_width % self.vit_heads:
            raise UserError(
                f"config.{self.key}.vit_heads={self.vit_heads} must divide {self.key}.vit_width={self.vit_width}",
                key=f"{self.key}.vit_heads",
            )
        for name in ("image_mean", "image_std"):
            value = tuple(getattr(self, name))
            if len(value) != 3 or (name == "image_std" and 0 in value):
                raise UserError(
                    f"config.{self.key}.{name}={value}: expected 3 values (R, G, B)"
                    + (", none zero" if name == "image_std" else ""),
                    key=f"{self.key}.{name}",
                )
            default = (0.0,) * 3 if name == "image_mean" else (1.0,) * 3
            if self.encoder != "vit" and value != default:
                raise UserError(
                    f"config.{self.key}.{name}={value}: only encoder='vit' normalises pixels; "
                    f"leave it at {default} for encoder={self.encoder!r}",
                    key=f"{self.key}.{name}",
                )
        if self.patch_positions and self.encoder != "linear":
            raise UserError(
                f"config.{self.key}.patch_positions=True: read only with encoder='linear' (got "
                f"{self.encoder!r}; the vit tower has its own position embedding)",
                key=f"{self.key}.patch_positions",
            )
        if self.image_size % self.patch_size:
            raise UserError(
                f"config.{self.key}.patch_size={self.patch_size} must divide {self.key}.image_size="
                f"{self.image_size} (whole patches)",
                key=f"{self.key}.patch_size",
            )


@section
class ModelConfig(Section):
    """`model`: the decoder's hyper-parameters."""

    KEY = "model"
    vocab_size: int = bounded(ge=1)
    embed_dim: int = bounded(ge=1)
    num_layers: int = bounded(ge=1)
    num_heads: int = bounded(ge=1)
    num_kv_heads: int = bounded(ge=1)
    head_dim: int = bounded(ge=1)
    mlp_dim: int = bounded(ge=1)
    rope_theta: float
    rope_scaling: RopeScalingConfig
    qk_norm: bool
    attention_bias: bool
    norm_eps: float
    tie_embeddings: bool
    param_dtype: str = choice(DTYPES)
    dtype: str = choice(DTYPES)
    remat: str = choice(REMAT_MODES)
    attention: str = choice(ATTENTION_KERNELS)
    attention_block: int
    context_parallel: str = choice(CONTEXT_PARALLEL)
    moe: MoEConfig
    vision: VisionConfig

    def check_rules(self) -> None:
        """Grouped-query attention: each KV head serves a whole number of query heads; the image
        placeholder is a token of the vocabulary."""
        if self.vision.encoder != "none" and self.vision.image_token_id >= self.vocab_size:
            raise UserError(
                f"config.{self.key}.vision.image_token_id={self.vision.image_token_id}: expected < "
                f"{self.key}.vocab_size={self.vocab_size} (the placeholder is looked up like any token)",
                key=f"{self.key}.vision.image_token_id",
            )
        if self.num_heads % self.num_kv_heads:
            raise UserError(
                f"config.{self.key}.num_kv_heads={self.num_kv_heads} must divide {self.key}.num_heads="
                f"{self.num_heads} (grouped-query attention)",
                key=f"{self.key}.num_kv_heads",
            )
