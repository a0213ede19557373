"""Convert a GGUF file (llama.cpp) into a Hugging Face model folder that every posttrain HF path reads.

    python tools/gguf_to_hf.py SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2 [--dtype float32]

    # then train, sample or evaluate from it as from any HF folder:
    python -m posttrain.main --config configs/hf.py:models/smollm2 --config.stage=sft ...

Tensors are dequantised by the `gguf` library (float32 by default, which keeps every dequantised
value exact); config.json, tokenizer.json, tokenizer_config.json (special tokens, chat template) and
generation_config.json come from the file's metadata (`posttrain.models.hf.gguf`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", help="the .gguf file (local)")
    p.add_argument("out", help="the Hugging Face folder to write (local or gs://)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="stored dtype")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from posttrain.models.hf.gguf import gguf_to_hf

    start = time.perf_counter()
    try:
        hf = gguf_to_hf(args.gguf, args.out, dtype=args.dtype)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.out} ({hf['architectures'][0]}, {hf['num_hidden_layers']} layers, vocab {hf['vocab_size']}) "
        f"in {time.perf_counter() - start:.1f} s; start from it with --config configs/hf.py:{args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
