from setuptools import find_packages, setup

setup(
    name="posttrain",
    version="0.1.0",
    description="JAX-native LLM post-training: SFT, preference alignment and RLVR on a sharded MoE decoder.",
    packages=find_packages(include=["posttrain", "posttrain.*"]),
    # the math verifier's attack and honest corpora (issue 42), read by tools and tests
    package_data={"posttrain.rl.verifiers": ["corpora/*.jsonl", "corpora/*.md"], "posttrain.eval.lm_tasks": ["*.yaml"]},
    python_requires=">=3.11",
    install_requires=[
        # rl.placement=disaggregated uses the experimental jax.experimental.transfer API, tested with
        # jax 0.10.2 (rl/rollout/transfer.py refuses at start-up, naming rl.placement, when it is missing)
        "jax>=0.7.0",
        "flax>=0.12.0",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.11.0",
        "grain>=0.2.10",
        "tensorstore>=0.1.70",
        "ml-collections>=1.0.0",
        "gcsfs>=2024.2.0",
        "absl-py>=2.1.0",
        "numpy>=1.26",
        "tqdm>=4.66",
        "tensorboardX>=2.6",
        "matplotlib>=3.8",
        "pillow>=10",              # images in chat records (data/images.py)
        "tokenizers>=0.19",
        "jinja2>=3.1",
        "math-verify>=0.9.0",
        "qwix>=0.1.8",             # weight-only quantisation of the sampler (sampling.quantize)
    ],
    extras_require={
        # gcp-storage-emulator: the local GCS server tests/test_storage.py runs gs:// paths against.
        # nbclient, nbformat, ipykernel: tests/e2e/test_notebook.py runs notebooks/quickstart.ipynb in a kernel.
        # pytest-xdist: the suite runs on two worker processes (-n 2; a JAX compile uses one core).
        # ruff, import-linter: .ci/run lints, format-checks and checks the import layers (pyproject.toml);
        # ruff within one minor version, since its formatter's style changes between them.
        "test": ["pytest>=8.0", "pytest-xdist>=3.5", "chex>=0.1.88", "gcp-storage-emulator>=2026.7.19", "nbclient>=0.10", "nbformat>=5.9",
                 "ipykernel>=6.29", "ruff>=0.17.6,<0.18", "import-linter>=2.1"],
        # Hugging Face interop: safetensors to read and write folders; gguf to import GGUF files
        # (models/hf/gguf.py; tested with 0.17.1 and 0.19.0); torch + transformers for the tests (install
        # the CPU build first: `pip install torch==2.13.0`), with accelerate, which transformers needs to
        # load a GGUF file (the reference of tests/models/hf/test_gguf.py).
        "hf": ["safetensors>=0.4.3", "gguf>=0.17.1", "transformers>=5.0", "torch>=2.4", "accelerate>=1.1.0"],
        # The TPU compiler: runs on TPU VMs, and compiles for TPU slices on any host
        # (tools/compile_plan.py, tests/plan/test_compile_plan.py). jax's own `tpu` extra pins libtpu to
        # the version that matches the jax it installs.
        "tpu": ["jax[tpu]"],
        # reasoning-gym's procedural datasets as RL domains (rl.domains=rg:<dataset>; rl/tasks/rg_domain.py),
        # their scorers behind posttrain's guard (rl/verifiers/rg.py); tested with 0.1.25
        "rg": ["reasoning-gym>=0.1.25"],
        # lm-eval: posttrain as an lm-eval model (`--model posttrain`, posttrain/eval/lm_harness.py) and
        # lm-eval tasks as eval suites (`eval.suites=lm_eval:<task>`); tested with 0.4.13, whose model
        # registry and TaskManager(include_defaults=) it uses; datasets builds the offline tasks' data.
        "eval": ["lm-eval>=0.4.13", "datasets>=2.16"],
    },
    entry_points={"console_scripts": ["posttrain-lm-eval=posttrain.eval.lm_eval_cli:main"]},
)
