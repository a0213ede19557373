"""A tiny Hugging Face tokenizer folder (byte-level BPE trained here) and the ChatML template."""

import json

import fsspec

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_hf_folder(root: str, config: dict | None, specials: tuple[str, ...] = ()) -> str:
    """A tiny byte-level BPE trained here (with extra special tokens `specials`), saved with a
    tokenizer_config.json under `root`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["Be brief. What is 2+2? It is 4, naïvely. And 3+3 is 6."] * 20, trainer)
    with fsspec.open(f"{root}/tokenizer.json", "w") as f:
        f.write(tok.to_str())
    if config is not None:
        with fsspec.open(f"{root}/tokenizer_config.json", "w") as f:
            json.dump(config, f)
    return root
