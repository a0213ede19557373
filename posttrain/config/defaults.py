"""The run configuration's keys and defaults: one ml-collections ConfigDict holding everything a run needs.

Config files (`configs/*.py`) define `get_config()` starting from `base_config()` and change what
they need. The dict is locked, so a misspelt key (in a file or a `--config.a.b=v` override) fails
before anything is compiled, naming the key and the valid keys at that level. The typed sections
(`RunConfig.from_config`) say what values each key may take.
"""

from __future__ import annotations

import ml_collections

# The default logical-axis → mesh-axes rules (`sharding.rules`; parallel/sharding.py applies them).
DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp", "expert"),
    "length": ("sequence",),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "experts": ("expert",),
    "expert_mlp": ("tensor",),
    "head_dim": (),
    "layers": (),
    # Activations have names of their own (as in MaxText), so that the weights' layout (e.g.
    # ZeRO-3: embed over fsdp) and the activations' (e.g. embed whole, or over tensor) change
    # independently. `batch` / `length` remain the layout of input batches.
    "activation_batch": ("data", "fsdp", "expert"),
    "activation_length": ("sequence",),
    "activation_embed": (),
    "activation_heads": ("tensor",),
    "activation_kv_heads": ("tensor",),
    "activation_mlp": ("tensor",),
    "activation_vocab": ("tensor",),
    # The vocab dim of the embedding table as the token lookup reads it: () gathers the table and
    # looks tokens up locally (training); the `vocab` axes look each token up in its shard and sum
    # (the decode layout, `decode_rules`: no table gather per token).
    "vocab_lookup": (),
}


def model_config() -> ml_collections.ConfigDict:
    """Decoder hyper-parameters (defaults: a tiny dense model that runs anywhere)."""
    return ml_collections.ConfigDict(
        dict(
            vocab_size=256,
            embed_dim=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            mlp_dim=128,
            rope_theta=10_000.0,
            rope_scaling=ml_collections.ConfigDict(
                dict(  # Hugging Face `rope_scaling` (see attention.RopeScaling)
                    type="",  # "" (none) | linear | dynamic | yarn | llama3
                    factor=1.0,
                    original_max_position_embeddings=0,  # pre-training context (dynamic, yarn, llama3)
                    low_freq_factor=1.0,  # llama3
                    high_freq_factor=4.0,  # llama3
                    beta_fast=32.0,  # yarn
                    beta_slow=1.0,  # yarn
                    attention_factor=0.0,  # yarn: q, k scale; 0 = 0.1 ln(factor) + 1
                    truncate=True,  # yarn: round the ramp's ends to whole dimensions
                )
            ),
            qk_norm=False,
            attention_bias=False,  # biases on the q, k, v projections (Qwen2)
            norm_eps=1e-6,
            tie_embeddings=False,
            param_dtype="float32",
            dtype="float32",  # compute dtype
            remat="none",  # none | full | dots (save matmul outputs)
            attention="xla",  # xla (reference) | blockwise (memory-linear) | cudnn (GPU) | splash (TPU)
            attention_block=512,  # blockwise / splash tile length (queries and keys)
            # mesh.sequence > 1 with blockwise: all_gather | ring | auto (ops.context_parallel)
            context_parallel="auto",
            moe=ml_collections.ConfigDict(
                dict(
                    num_experts=0,  # 0: every layer is a dense MLP
                    top_k=2,
                    expert_mlp_dim=64,
                    router="softmax",  # softmax | sigmoid
                    norm_topk_prob=True,  # renormalise the top-k probabilities (Mixtral: always)
                    routed_scaling=1.0,  # multiplies the combine weights (DeepSeek-V3 style)
                    bias_update_rate=0.0,  # aux-loss-free balancing: router-bias step per update (sigmoid)
                    num_shared_experts=0,
                    shared_mlp_dim=64,
                    aux_loss_coef=0.01,  # load-balancing loss (Switch / HF `router_aux_loss_coef`)
                    z_loss_coef=0.001,  # router z-loss (ST-MoE)
                    capacity_factor=0.0,  # 0: dropless; > 0: per-expert capacity, overflow tokens dropped
                    first_dense=0,  # the first k layers use a dense MLP
                    every=1,  # then every n-th layer is MoE (HF `decoder_sparse_step`)
                    dense_layers=(),  # explicit dense layers (HF `mlp_only_layers`)
                    dispatch="auto",  # auto | ragged | padded: expert-parallel all-to-all flavour
                    # off | sampler: the RL learner replays the experts the sampler chose for each token
                    # (gate weights recomputed by the learner's router over them); rlvr, static sampler
                    routing_replay="off",
                )
            ),
            vision=ml_collections.ConfigDict(
                dict(  # images as patch tokens (models/decoder.py, data/images.py; README "Images")
                    encoder="none",  # none (text only) | linear (Fuyu-style patch embedding) | vit (models/vit.py)
                    image_size=32,  # every image is resized to image_size x image_size (RGB)
                    patch_size=8,  # cut into (image_size / patch_size)^2 patches, one placeholder token each
                    image_token_id=263,  # the placeholder token: the byte tokenizer's <|image|>
                    patch_positions=False,  # linear: + a learned embedding of each patch's place in its image
                    vit_layers=2,  # encoder=vit: the tower's pre-LayerNorm layers (bidirectional within an image)
                    vit_width=64,  # its width (then a 2-layer GELU projector to model.embed_dim)
                    vit_heads=4,
                    vit_mlp_dim=128,
                    vit_final_norm=True,  # a LayerNorm after the last layer (LLaVA imports: False)
                    image_mean=(0.0, 0.0, 0.0),  # the tower reads (pixel/255 - mean) / std per channel
                    image_std=(1.0, 1.0, 1.0),
                )
            ),
        )
    )


def optim_config() -> ml_collections.ConfigDict:
    """The optimizer's keys (`optim`)."""
    return ml_collections.ConfigDict(
        dict(
            name="adamw",  # adamw | adafactor (factored second moments, no first: ~(rows+cols) per matrix)
            lr=3e-3,
            min_lr_ratio=0.1,
            warmup_steps=20,
            weight_decay=0.01,
            grad_clip=1.0,
            b1=0.9,
            b2=0.95,
            eps=1e-8,  # adamw only
            moment_dtype="",  # adamw only: first-moment dtype, "" = the params' dtype, float32 | bfloat16
            factored_min_dim=128,  # adafactor only: factor a matrix's second moment when its 2 largest dims are >= this
        )
    )


def base_config() -> ml_collections.ConfigDict:
    """Every key a run may set, with defaults; config files start from this."""
    cfg = ml_collections.ConfigDict()
    cfg.stage = "lm"  # which job main runs
    cfg.seed = 0
    cfg.workdir = "runs/default"
    cfg.init_from = ""  # another run's checkpoint (workdir or checkpoint dir), or "hf:/hf/folder"
    cfg.distributed = ml_collections.ConfigDict(
        dict(  # several processes (parallel/distributed.py)
            # "host:port" of process 0; "" = $JAX_COORDINATOR_ADDRESS, a TPU pod / SLURM, or one process
            coordinator="",
            num_processes=0,  # with coordinator: how many processes in all
            process_id=-1,  # with coordinator: this process (0 .. num_processes-1)
            heartbeat_timeout_s=30,  # a process silent this long is declared dead: the others stop, naming it
            initialization_timeout_s=300,  # how long processes wait for each other at start
        )
    )
    cfg.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, expert=1, tensor=1, sequence=1))
    cfg.sharding = ml_collections.ConfigDict(
        dict(rules=ml_collections.ConfigDict({k: ",".join(v) for k, v in DEFAULT_RULES.items()}))
    )
    cfg.model = model_config()
    cfg.train = ml_collections.ConfigDict(
        dict(
            steps=300,
            batch_size=16,
            seq_len=64,
            log_every=10,
            eval_every=0,
            progress=True,
            seq_len_schedule="",  # staged context: "256:20,1024" = 256 tokens for 20 steps, then train.seq_len
        )
    )
    # Non-finite loss or gradient norm: the update is skipped (counted as nonfinite_skipped); the run
    # stops when more than this many updates in a row were skipped (0: at the first).
    cfg.train.max_nonfinite_steps = 10
    cfg.compilation_cache = "auto"  # "auto" ($POSTTRAIN_COMPILATION_CACHE or ~/.cache/posttrain/jax) | "off" | folder
    cfg.checkpoint = ml_collections.ConfigDict(dict(every=100, keep=3, async_save=True))
    cfg.eval = ml_collections.ConfigDict(
        dict(
            long_context=ml_collections.ConfigDict(
                dict(  # needle / multi-hop retrieval (eval/long_context_eval.py)
                    lengths="",  # prompt lengths in tokens, e.g. "256,1024"; "" = off. SFT evaluates it
                    depths="0,0.25,0.5,0.75,1",  # where the facts sit (0 = start of the context, 1 = end)
                    kinds="needle,multihop",
                    samples=4,  # problems per (kind, length, depth) cell
                    hops=2,  # facts chained in a multi-hop problem
                    max_new_tokens=8,
                    seed=0,  # problems come from the eval name space, disjoint from training's
                )
            )
        )
    )
    cfg.optim = optim_config()
    cfg.data = ml_collections.ConfigDict(
        dict(
            task="arithmetic",  # stage lm: the built-in task
            tokenizer="byte",  # "byte" or a folder with tokenizer.json (local, gs://)
            on_error="raise",  # raise | skip (bad records counted as data/skipped)
            packing=True,  # SFT: pack conversations into rows with segment ids
            truncate=False,  # SFT: cut over-long examples (counted) instead of erroring
            fields="",  # record field renames, e.g. "prompt=question,response=answer"
            synthetic="",  # "arithmetic": generate the stage's train/eval files if missing
            synthetic_size=2000,  # records per generated train file (eval files get a quarter)
            synthetic_max_value=99,  # operands 0..max (RL arithmetic tasks use the same range)
            synthetic_error_rate=0.0,  # SFT: fraction of worked answers that are off by one
            synthetic_min_length=0,  # long_context: shortest generated prompt (0: 64 for recall alone, else 160)
            synthetic_recall_density=0.0,  # long_context: up to this many recall facts per 64 tokens (0: 1 + len/64)
        )
    )
    gate = ""  # e.g. "eval/loss<1.5" — must hold before a pipeline moves on
    # Per-stage: data files, gate, and steps / lr overriding train.steps / optim.lr when non-zero.
    stage = lambda **kw: ml_collections.ConfigDict(
        dict(train_files="", eval_files="", steps=0, lr=0.0, gate=gate, **kw)
    )
    cfg.sft = stage(sample_tokens=48)  # greedy samples of a few eval prompts at each eval (0: off)
    cfg.reward_model = stage()
    cfg.dpo = stage(beta=0.1, loss_type="sigmoid", label_smoothing=0.0)
    cfg.pipeline = ml_collections.ConfigDict(dict(stages=("sft", "dpo")))
    cfg.rl = ml_collections.ConfigDict(
        dict(
            domains="",  # task mixture "name[:weight],...": arithmetic, gsm8k, humaneval, the domains of
            # train_files; "": arithmetic, or with train_files their domains alone
            train_files="",  # the user's tasks: JSONL files / globs, comma-separated (rl/task_files.py)
            eval_files="",  # held-out user tasks (prompts must not be training prompts)
            verifiers="",  # user verifiers "[name=]package.module:function,..." (rl/verifiers/user.py)
            verifier_timeout_s=30.0,  # wall-clock limit of one user verifier call (then Reward.error, counted)
            curriculum=ml_collections.ConfigDict(
                dict(  # task scheduler (rl/scheduler.py): bands by observed pass rate
                    # e.g. "new:1,hard:0.5,medium:4,easy:0.2": draw a band by weight, then a task in it
                    band_weights="",
                    hard_below=0.2,  # pass rate < this: band "hard"
                    easy_above=0.8,  # pass rate > this: band "easy" (else "medium")
                    min_attempts=1,  # samples before a task leaves band "new"
                    window=0,  # pass rate over a task's last n samples (0: all of them)
                    retire_above=-1.0,  # >= 0: retire (never draw again) tasks whose pass rate is >= this (too easy)
                    retire_below=-1.0,  # >= 0: retire tasks whose pass rate is < this (too hard)
                    retire_after=16,  # samples of a task before it may retire
                    pass_threshold=0.5,  # a sample passes when its reward >= this
                )
            ),
            env="single",  # single: one answer per sample | tool: multi-turn episodes with sandboxed sh/python
            # calls in a persistent working directory (rl/envs/workspace.py, rl/episodes.py)
            max_turns=4,  # rl.env=tool: model turns per episode (rl.max_new_tokens each), calls included
            episode_cohorts=1,  # rl.env=tool: episodes split into n cohorts taking turns on the sampler, so one
            # cohort's tool calls overlap another's sampling (rl/episodes.py); 1: lockstep rounds
            tool_timeout_s=5.0,  # rl.env=tool: wall-clock limit of one call
            invalid_tool_call_penalty=0.0,  # rl.env=tool: per malformed or failed call
            redundant_tool_call_penalty=0.0,  # rl.env=tool: per call repeating an earlier one on an unchanged directory
            rollouts_every=0,  # keep trajectories: every n steps write {workdir}/rollouts/{step}.jsonl; 0: off
            rollouts_fraction=1.0,  # the fraction of that step's samples written (chosen by seed and step)
            instruction="",  # appended to math prompts (e.g. "Give the final answer as \\boxed{}.")
            arithmetic_size=2000,  # generated training problems (train split; held-out ones come from the test split)
            eval_size=128,  # held-out problems per domain
            eval_every=10,  # evaluate every n updates (and at start and end); 0: never
            eval_samples=4,  # samples per held-out problem for mean accuracy and pass@k
            prompts_per_step=8,  # groups per update
            group_size=8,  # G samples per prompt
            max_new_tokens=32,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            advantage="grpo",  # grpo | drgrpo (no std) | rloo | gae (PPO: a critic, token-level)
            clip_low=0.2,
            clip_high=0.28,  # DAPO clip-higher
            ratio_level="token",  # token | sequence (GSPO)
            updates_per_batch=1,  # PPO epochs over one rollout batch
            minibatches=1,  # optimizer steps per epoch (must divide prompts_per_step * group_size)
            aggregation="token-mean",  # token-mean | seq-mean-token-sum | seq-mean-token-mean
            loss_norm_tokens=0,  # seq-mean-token-sum's constant divisor (Dr. GRPO); 0: rl.max_new_tokens
            kl_coef=0.0,  # 0: no reference policy is held at all
            kl_estimator="k3",
            entropy_coef=0.0,
            is_cap=2.0,  # truncation of importance weights π_learner / π_sampler
            # --- off-policy corrections (rl/algo/offpolicy.py, rl/algo/losses.py) ---
            loss_type="ppo",  # ppo: clipped surrogate | cispo: sg(clip(r, 1 - clip_low, 1 + clip_high))·A·log π
            is_level="token",  # truncated IS (rl.is_cap) per token | sequence (its product of ratios)
            is_mask="off",  # masked IS: drop tokens (token) or sequences (sequence: product of ratios;
            # geometric: their geometric mean) whose π_learner / π_sampler lies outside [is_mask_low, is_mask_high]
            is_mask_low=0.5,  # 0: no lower bound
            is_mask_high=2.0,
            # --- end off-policy corrections ---
            max_staleness=0,  # 0: on-policy, synchronous; >= 1: sampling overlaps updates
            # in-flight weight updates (rl/rollout/inflight.py; needs max_staleness >= 1): every N decode
            # steps the sampler switches to the newest published weights, sequences in flight kept; 0: off
            inflight_update_every=0,
            filter_groups=False,  # dynamic sampling: resample groups whose rewards are all equal
            max_resample_rounds=2,
            seq_bucket=0,  # learner row length S: 0 a power of two; N a multiple of N (less padding, more shapes)
            format_penalty=0.0,
            overlong_buffer=0,  # DAPO overlong shaping ramp (tokens before max_new_tokens)
            verifier_workers=4,
            verifier_delay=0.0,  # benchmarks only: extra host seconds per verified response
            # PPO with a critic (advantage="gae") and a learned reward (RLHF)
            critic="shared",  # shared: a value head on the policy's decoder
            gamma=1.0,
            lam=0.95,  # GAE discount and trace decay
            value_coef=0.5,  # weight of the critic's loss in the learner's loss
            value_clip=0.2,  # PPO value clipping around the rollout's values (0: unclipped)
            reward_model="",  # a reward_model run dir ("@reward_model": the pipeline's stage) or ""
            reward_model_weight=1.0,  # reward = verifier_weight · verifier + reward_model_weight · RM score
            verifier_weight=1.0,
            reward_model_normalize=True,  # RM scores by running mean/std (checkpointed)
            # an unfinished response's training reward (no end of turn: cut by max_new_tokens or max_turns),
            # learned or verified: "min" (the batch's lowest), "none" (as scored) or a number
            truncated_reward="min",
            kl_in_reward=False,  # pay rl.kl_coef · KL per token as reward instead of a loss term
            # --- rl.placement (issue 27 item 1) ---
            # colocated: sampler and learner on every device | split: the last rl.sampler_devices
            # devices sample (their own mesh), the others learn | disaggregated: separate process
            # groups, one command each with rl.role = learner | sampler (rl/rollout/remote.py)
            placement="colocated",
            sampler_devices=0,
            role="none",
            lease_timeout_s=60.0,  # disaggregated: a sampler silent this long loses its leases (re-issued)
            # --- end rl.placement ---
            steps=0,
            lr=0.0,
            gate=gate,  # as for the other stages
        )
    )
    # Stage "eval" (posttrain/stages/eval.py), beside eval.long_context above.
    cfg.eval.checkpoint = ""  # a run dir / checkpoints dir; "" = init_from (in a pipeline: the previous stage)
    cfg.eval.steps = "latest"  # latest | all | "100,200": which checkpoints of that run
    cfg.eval.suites = "arithmetic"  # arithmetic, gsm8k, humaneval and/or name=path.jsonl (rl.eval_files records)
    cfg.eval.size = 128  # problems per built-in suite
    cfg.eval.samples = 4  # samples per problem (mean sampled accuracy, pass@k)
    cfg.eval.pass_k = "1,4"  # pass@k reported for each k (each <= samples)
    cfg.eval.gate = gate
    # Stage "rejection_sampling" (posttrain/stages/rejection_sampling.py): verified samples of the policy → SFT data.
    # Prompts are RL training tasks (rl.domains, rl.train_files); sampling uses rl.max_new_tokens, top_k, top_p.
    cfg.rejection = ml_collections.ConfigDict(
        dict(
            prompts=256,  # distinct training prompts, split over the domains by their rl.domains weights
            samples_per_prompt=8,  # N candidates sampled per prompt
            keep_per_prompt=1,  # at most this many kept per prompt: the best by score, then shortest
            min_score=1.0,  # a candidate passes when its reward >= this (and the verifier did not fail)
            max_tokens=0,  # length filter: drop passing responses longer than this many tokens; 0: off
            temperature=1.0,
            output="",  # the SFT JSONL written (local or gs://); "": {workdir}/sft.jsonl
            mix_original=False,  # also write {output}.mixed.jsonl (sft.train_files, then the kept records); the
            # next sft stage of a pipeline trains on it instead of the kept records alone
            gate=gate,  # e.g. "rejection/yield>=0.2" (see rl/rejection.py for the metrics)
        )
    )
    cfg.alerts = ml_collections.ConfigDict(
        dict(  # run health rules (posttrain/core/alerts.py); 0 = rule off
            on="warn",  # off | warn (log, event row, progress bar) | stop (raise AlertStop)
            reward_drift=6.0,  # |batch mean reward − running mean| / running std above this
            entropy_collapse=0.01,  # rl/entropy (nats/token) below this
            kl_blowup=1.0,  # rl/kl above this
            response_len_explosion=3.0,  # mean response length above this × its running mean
            clip_saturation=0.5,  # rl/clip_frac_low + rl/clip_frac_high above this
            nonfinite=True,  # any NaN/inf metric
            verifier_error_rate=0.1,  # rl/verifier_errors / rl/responses above this
            throughput_stall=0.2,  # tokens/s below this × its running mean
        )
    )
    cfg.sampling = ml_collections.ConfigDict(
        dict(  # the rlvr stage's sampler (rollouts and held-out evals)
            quantize="none",  # none | int8 (w8a16) | int4 (w4a16): weights quantised from the learner's at each publish
            # learner (serve the learner's ZeRO-3 arrays) | tensor (a decode-layout copy made at each publish)
            layout="learner",
            # > 0: speculative decoding, k tokens drafted per round (same distribution, policy log-probs)
            speculative_k=0,
            draft_layers=1,  # the draft: the policy's first n layers + its final norm and head
            prefix_cache=0,  # > 0: keep prompt-prefix KV across sampler calls (multi-turn turns), bound in tokens
            continuous_batching=False,  # rollouts through continuously refilled decode slots (same samples as static)
            num_slots=16,  # continuous_batching: decode slots (at most the samples of one sampler call)
            refill_batch=4,  # continuous_batching: free slots refilled this many samples at a time
            # longest prompt + new tokens any sampler call (rollouts, evals, long-context evals, tools) may
            # need; 0: the context the model was trained and configured for (core/lineage.py
            # `configured_context`); N: up to N tokens, explicitly (e.g. to measure past the trained length)
            max_context=0,
        )
    )
    cfg.lora = ml_collections.ConfigDict(
        dict(
            rank=0,  # 0: full fine-tuning; > 0: train only low-rank adapters
            alpha=16.0,  # adapters scaled by alpha / rank
            # decoder: any of q k v o gate up down w_gate w_up w_down; images (models/lora.py): proj
            # (encoder=linear), patch wq wk wv wo fc1 fc2 proj1 proj2 (encoder=vit); q never hits the tower
            targets=("q", "k", "v", "o"),
            dropout=0.0,  # not supported (adapters are merged into the weights)
        )
    )
    cfg.lock()
    return cfg


def with_stage_overrides(cfg, stage: str):
    """`cfg` with `<stage>.steps` / `<stage>.lr` (when non-zero) in train.steps / optim.lr."""
    cfg = cfg.copy_and_resolve_references()
    if cfg[stage].steps:
        cfg.train.steps = cfg[stage].steps
    if cfg[stage].lr:
        cfg.optim.lr = cfg[stage].lr
    return cfg
