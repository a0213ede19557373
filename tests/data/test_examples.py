"""Records → token arrays (`posttrain/data/examples.py`): an image part that cannot be read is
reported at the field and message it is in."""

import pytest

from posttrain.data.examples import RecordError, sft_example
from posttrain.data.tokenizer import ByteTokenizer
from tests.support.vision import SPEC

IMAGE, TEXT = {"type": "image", "image": "missing.png"}, {"type": "text", "text": "What is this?"}


@pytest.mark.parametrize(
    "record, place",
    [
        (
            {"prompt": [{"role": "user", "content": [IMAGE, TEXT]}], "response": "A cat."},
            r"'prompt'\[0\]\.content\[0\]",
        ),
        (
            {"prompt": "Hi", "response": [{"role": "assistant", "content": [TEXT, IMAGE]}]},
            r"'response'\[0\]\.content\[1\]",
        ),
        (
            {
                "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [TEXT, IMAGE]}],
                "response": "A cat.",
            },
            r"'prompt'\[1\]\.content\[1\]",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": [IMAGE]},
                    {"role": "assistant", "content": "A cat."},
                ]
            },
            r"'messages'\[2\]\.content\[0\]",
        ),
    ],
)
def test_missing_image_is_reported_in_its_own_field(record, place, tmp_path):
    with pytest.raises(RecordError, match=rf"field {place}.*missing\.png"):
        sft_example(record, ByteTokenizer(), images=SPEC, path=str(tmp_path / "records.jsonl"))
