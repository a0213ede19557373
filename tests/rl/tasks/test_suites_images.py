"""`eval.suites` files with image prompts (issue 29): tasks carry the images resolved against the
suite file, the suite's environment shows them to a vision model as placeholders and patches, and a
text-only model refuses them naming file:line (pure Python, no JAX compile)."""

import json

import numpy as np
import pytest
from PIL import Image

from posttrain.data.sources import DataError
from posttrain.data.tokenizer import ByteTokenizer
from posttrain.rl.envs.images import episode_patches
from posttrain.rl.tasks.suites import make_suites
from posttrain.rl.verifiers.label import LabelTask
from posttrain.rl.verifiers.math import MathTask
from tests.support.typed_configs import run_cfg

BYTE = ByteTokenizer()


def image_suite(tmp_path) -> str:
    (tmp_path / "data" / "img").mkdir(parents=True)
    Image.new("RGB", (10, 10), (255, 0, 0)).save(tmp_path / "data" / "img" / "red.png")
    ask = lambda q: [
        {"role": "user", "content": [{"type": "image", "image": "img/red.png"}, {"type": "text", "text": q}]}
    ]
    records = [
        {"prompt": ask("How many bars?"), "answer": 3},
        {"prompt": ask("Colour?"), "answer": "red", "verifier": "label", "choices": ["red", "blue"]},
        {"prompt": "What is 3+4?", "answer": 7},  # text prompts mix in
    ]
    path = tmp_path / "data" / "suite.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def config(tmp_path, suite: str, encoder: str):
    return run_cfg(
        {
            "eval.suites": f"img={suite}",
            "model.vocab_size": 264,  # the byte tokenizer's image placeholder (263) is a token of the model
            "model.vision.encoder": encoder,
            "model.vision.image_size": 8,
            "model.vision.patch_size": 4,
        },
        workdir=str(tmp_path / "run"),
    )


def test_image_suite_shows_its_images_to_a_vision_model(tmp_path):
    suite = image_suite(tmp_path)
    domain = make_suites(config(tmp_path, suite, "linear"), BYTE)["img"]
    tasks = list(domain.tasks)
    assert [t.id for t in tasks] == ["img:1", "img:2", "img:3"]
    assert tasks[0].target == MathTask("3") and tasks[1].target == LabelTask("red", ("red", "blue"))
    image = tasks[0].prompt[0]["content"][0]["image"]
    assert image == str(tmp_path / "data" / "img" / "red.png")  # resolved against the suite's folder
    env = domain.make_env()
    tokens = env.reset(tasks[0])
    assert tokens.count(BYTE.image_id) == 4  # (8 / 4)² placeholder tokens
    patches = episode_patches(env, tokens)
    at = np.asarray(tokens) == BYTE.image_id
    np.testing.assert_allclose(patches[at].reshape(4, 16, 3), np.broadcast_to([1.0, 0.0, 0.0], (4, 16, 3)))
    assert not patches[~at].any()
    assert BYTE.image_id not in domain.make_env().reset(tasks[2])  # a text prompt: no image


def test_image_suite_for_a_text_only_model_is_refused_naming_file_and_line(tmp_path):
    suite = image_suite(tmp_path)
    with pytest.raises(ValueError, match=r"eval.suites: img=.*suite.jsonl:1 has an image prompt.*encoder='none'"):
        make_suites(config(tmp_path, suite, "none"), BYTE)


def test_missing_image_in_a_suite_names_file_and_line(tmp_path):
    suite = image_suite(tmp_path)
    (tmp_path / "data" / "img" / "red.png").unlink()
    with pytest.raises(DataError, match=r"suite.jsonl:1: .*not found"):
        make_suites(config(tmp_path, suite, "linear"), BYTE)
