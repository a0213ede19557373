"""The `model` section: the decoder's shape, attention, RoPE scaling, Mixture-of-Experts and vision
keys, with their defaults (a tiny dense model that runs anywhere) and the values they take (the
modules that implement them import these)."""

from __future__ import annotations

import math

from posttrain.config.fields import Section, bounded, choice, flag, free, nested, section

ATTENTION_KERNELS = ("xla", "blockwise", "cudnn", "splash")  # models.attention
ROPE_SCALINGS = ("", "linear", "dynamic", "yarn", "llama3")  # models.attention.rope_frequencies
CONTEXT_PARALLEL = ("all_gather", "ring", "auto")  # ops.context_parallel
REMAT_MODES = ("none", "full", "dots")  # models.decoder.REMAT_POLICIES, and none
DTYPES = ("float32", "bfloat16", "float16")  # models.layers
MOE_ROUTERS = ("softmax", "sigmoid")  # models.moe.layer
DISPATCHES = ("auto", "ragged", "padded")  # models.moe.dispatch
# off: the learner routes each token itself; sampler: it replays the experts the sampler chose
ROUTING_REPLAY = ("off", "sampler")  # rl.rollout.routing
VISION_ENCODERS = ("none", "linear", "vit")  # models.vision.make_vision
_NEEDS_ORIGINAL_CONTEXT = ("dynamic", "yarn", "llama3")


@section
class RopeScalingConfig(Section):
    """`model.rope_scaling`: how RoPE is stretched beyond the pre-training context, as Hugging Face's
    `rope_scaling` / `rope_parameters` types of the same names define it (models.attention).

    type "" (none) | linear (positions / factor) | dynamic (NTK base for the extended context
    `original_max_position_embeddings × factor`, fixed: see `dynamic_length`) | yarn (NTK-by-parts
    ramp between beta_fast and beta_slow rotations, q and k scaled by `attention_factor`; 0 means
    0.1 ln(factor) + 1) | llama3 (low/high-frequency wavelength bands)."""

    KEY = "model.rope_scaling"
    type: str = choice("", ROPE_SCALINGS)  # "" (none) | linear | dynamic | yarn | llama3
    factor: float = bounded(1.0, gt=0)
    original_max_position_embeddings: int = bounded(0, ge=0)  # pre-training context (dynamic, yarn, llama3)
    low_freq_factor: float = bounded(1.0, gt=0)  # llama3
    high_freq_factor: float = bounded(4.0, gt=0)  # llama3
    beta_fast: float = bounded(32.0, gt=0)  # yarn
    beta_slow: float = bounded(1.0, gt=0)  # yarn
    # yarn: q, k scale; 0 = 0.1 ln(factor) + 1
    attention_factor: float = bounded(0.0, ge=0)
    truncate: bool = flag(True)  # yarn: round the ramp's ends to whole dimensions

    def dynamic_length(self) -> float:
        """The length dynamic NTK scaling takes its base from: the extended context, for every call,
        as vLLM and SGLang serve it. Hugging Face's transformers grows the base with the longest
        position of each call instead; then a row's logits depend on its batch, and the keys a
        KV-cached sampler stored under an earlier base disagree with the learner's one forward."""
        return self.original_max_position_embeddings * self.factor

    def attention_scale(self) -> float:
        """The factor RoPE multiplies q and k by (yarn's attention temperature; 1 otherwise)."""
        if self.type != "yarn":
            return 1.0
        if self.attention_factor:
            return self.attention_factor
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    def check_rules(self) -> None:
        """The scalings that extend a pre-training context need its length."""
        if self.type in _NEEDS_ORIGINAL_CONTEXT and self.original_max_position_embeddings <= 0:
            self.refuse(
                "original_max_position_embeddings",
                f": rope_scaling.type={self.type!r} needs the pre-training context length",
            )


@section
class MoEConfig(Section):
    """`model.moe`: routed experts (none when num_experts is 0). `routing_replay` (off | sampler):
    whether the RL learner replays the experts the sampler chose for each token (`rl.rollout.routing`;
    only with experts, the rlvr stage and a sampler that records them)."""

    KEY = "model.moe"
    num_experts: int = bounded(0, ge=0)  # 0: every layer is a dense MLP
    top_k: int = bounded(2, ge=1)
    expert_mlp_dim: int = bounded(64, ge=1)
    router: str = choice("softmax", MOE_ROUTERS)
    norm_topk_prob: bool = flag(True)  # renormalise the top-k probabilities (Mixtral: always)
    routed_scaling: float = bounded(1.0, gt=0)  # multiplies the combine weights (DeepSeek-V3 style)
    bias_update_rate: float = bounded(0.0, ge=0)  # aux-loss-free balancing: router-bias step per update (sigmoid)
    num_shared_experts: int = bounded(0, ge=0)
    shared_mlp_dim: int = bounded(64, ge=1)
    aux_loss_coef: float = bounded(0.01, ge=0)  # load-balancing loss (Switch / HF `router_aux_loss_coef`)
    z_loss_coef: float = bounded(0.001, ge=0)  # router z-loss (ST-MoE)
    capacity_factor: float = bounded(0.0, ge=0)  # 0: dropless; > 0: per-expert capacity, overflow tokens dropped
    first_dense: int = bounded(0, ge=0)  # the first k layers use a dense MLP
    every: int = bounded(1, ge=1)  # then every n-th layer is MoE (HF `decoder_sparse_step`)
    dense_layers: tuple[int, ...] = free((), "layer indices; models.decoder.layer_kinds reads them")  # HF mlp_only
    dispatch: str = choice("auto", DISPATCHES)  # expert-parallel all-to-all flavour
    # off | sampler: the RL learner replays the experts the sampler chose for each token (gate weights
    # recomputed by the learner's router over them); rlvr, static sampler
    routing_replay: str = choice("off", ROUTING_REPLAY)

    def check_rules(self) -> None:
        """A token picks at most every expert."""
        if self.num_experts and self.top_k > self.num_experts:
            self.refuse("top_k", f": expected <= {self.KEY}.num_experts={self.num_experts}")
        if self.routing_replay != "off" and not self.num_experts:
            self.refuse(
                "routing_replay",
                " needs a Mixture-of-Experts model: "
                f"{self.KEY}.num_experts=0 (dense) has no routing to replay; set routing_replay='off'",
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
    encoder: str = choice("none", VISION_ENCODERS)
    image_size: int = bounded(32, ge=1)  # every image is resized to image_size x image_size (RGB)
    patch_size: int = bounded(8, ge=1)  # cut into (image_size / patch_size)^2 patches, one placeholder token each
    image_token_id: int = bounded(263, ge=0)  # the placeholder token: the byte tokenizer's <|image|>
    patch_positions: bool = flag(False)  # linear: + a learned embedding of each patch's place in its image
    vit_layers: int = bounded(2, ge=1)  # pre-LayerNorm layers, bidirectional within an image
    vit_width: int = bounded(64, ge=1)  # then a 2-layer GELU projector to model.embed_dim
    vit_heads: int = bounded(4, ge=1)
    vit_mlp_dim: int = bounded(128, ge=1)
    vit_final_norm: bool = flag(True)  # a LayerNorm after the last layer (LLaVA: False)
    # the tower reads (pixel/255 - mean) / std per channel
    image_mean: tuple[float, ...] = free((0.0, 0.0, 0.0), "3 channel values, checked by the section's rules")
    image_std: tuple[float, ...] = free((1.0, 1.0, 1.0), "3 nonzero channel values, checked by the section's rules")

    def check_rules(self) -> None:
        """Patches tile the image exactly; the tower's heads split its width; one mean and one
        nonzero std per RGB channel; normalisation only where the tower applies it."""
        if self.vit_width % self.vit_heads:
            self.refuse("vit_heads", f" must divide {self.KEY}.vit_width={self.vit_width}")
        for name in ("image_mean", "image_std"):
            value = tuple(getattr(self, name))
            if len(value) != 3 or (name == "image_std" and 0 in value):
                self.refuse(name, ": expected 3 values (R, G, B)" + (", none zero" if name == "image_std" else ""))
            default = (0.0,) * 3 if name == "image_mean" else (1.0,) * 3
            if self.encoder != "vit" and value != default:
                self.refuse(
                    name, f": only encoder='vit' normalises pixels; leave it at {default} for encoder={self.encoder!r}"
                )
        if self.patch_positions and self.encoder != "linear":
            self.refuse(
                "patch_positions",
                f": read only with encoder='linear' (got {self.encoder!r}; "
                "the vit tower has its own position embedding)",
            )
        if self.image_size % self.patch_size:
            self.refuse("patch_size", f" must divide {self.KEY}.image_size={self.image_size} (whole patches)")


@section
class ModelConfig(Section):
    """`model`: the decoder's hyper-parameters."""

    KEY = "model"
    vocab_size: int = bounded(256, ge=1)
    embed_dim: int = bounded(64, ge=1)
    num_layers: int = bounded(2, ge=1)
    num_heads: int = bounded(4, ge=1)
    num_kv_heads: int = bounded(2, ge=1)
    head_dim: int = bounded(16, ge=1)
    mlp_dim: int = bounded(128, ge=1)
    rope_theta: float = bounded(10_000.0, gt=0)
    rope_scaling: RopeScalingConfig = nested(RopeScalingConfig)  # Hugging Face `rope_scaling`
    qk_norm: bool = flag(False)
    attention_bias: bool = flag(False)  # biases on the q, k, v projections (Qwen2)
    norm_eps: float = bounded(1e-6, gt=0)
    tie_embeddings: bool = flag(False)
    param_dtype: str = choice("float32", DTYPES)
    dtype: str = choice("float32", DTYPES)  # compute dtype
    remat: str = choice("none", REMAT_MODES)  # none | full | dots (save matmul outputs)
    attention: str = choice("xla", ATTENTION_KERNELS)  # xla (reference) | blockwise | cudnn (GPU) | splash (TPU)
    attention_block: int = bounded(512, ge=1)  # blockwise / splash tile length (queries and keys)
    # mesh.sequence > 1 with blockwise: all_gather | ring | auto (ops.context_parallel)
    context_parallel: str = choice("auto", CONTEXT_PARALLEL)
    moe: MoEConfig = nested(MoEConfig)
    vision: VisionConfig = nested(VisionConfig)

    def check_rules(self) -> None:
        """Grouped-query attention: each KV head serves a whole number of query heads; the image
        placeholder is a token of the vocabulary."""
        if self.vision.encoder != "none" and self.vision.image_token_id >= self.vocab_size:
            self.refuse(
                "vision.image_token_id",
                f": expected < {self.KEY}.vocab_size={self.vocab_size} (the placeholder is looked up like any token)",
            )
        if self.num_heads % self.num_kv_heads:
            self.refuse("num_kv_heads", f" must divide {self.KEY}.num_heads={self.num_heads} (grouped-query attention)")
