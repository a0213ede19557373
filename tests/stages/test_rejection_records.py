"""Rejection sampling's SFT records of image tasks (issue 29): written as `{"messages"}` with image
paths that resolve from the record's own file, so the next SFT stage decodes the images (pure
Python, no JAX compile)."""

import json

import numpy as np
from PIL import Image

from posttrain.config import base_config
from posttrain.data.images import ImageSpec
from posttrain.data.pipeline import sft_batches
from posttrain.data.sources import SkipLog
from posttrain.data.tokenizer import ByteTokenizer
from posttrain.rl.envs.base import Task
from posttrain.rl.tasks.files import read_task_files
from posttrain.stages.rejection_records import Candidate, sft_record, write_jsonl

BYTE = ByteTokenizer()
SPEC = ImageSpec(image_size=8, patch_size=4, token_id=BYTE.image_id)


def image_prompt(path: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": path}, {"type": "text", "text": "Colour?"}]}]


def test_image_task_records_load_back_through_sft_with_their_images(tmp_path, monkeypatch):
    tasks_dir = tmp_path / "tasks"
    (tasks_dir / "img").mkdir(parents=True)
    Image.new("RGB", (10, 10), (255, 0, 0)).save(tasks_dir / "img" / "red.png")
    Image.new("RGB", (10, 10), (0, 0, 255)).save(tasks_dir / "blue.png")
    record = {"prompt": image_prompt("img/red.png"), "answer": "red", "verifier": "label", "choices": ["red", "blue"]}
    (tasks_dir / "train.jsonl").write_text(json.dumps(record) + "\n")
    [(_, from_file)] = read_task_files(str(tasks_dir / "train.jsonl"), (), SkipLog("raise"))["user"]
    # a task whose image path is relative to the sampler's working directory (a registered domain's)
    monkeypatch.chdir(tmp_path)
    by_hand = Task("hand:1", tuple(image_prompt("tasks/blue.png")), None)
    cfg = base_config()
    kept = [Candidate("user", from_file, 0, "red", 3, 1.0, {}), Candidate("user", by_hand, 1, "blue", 4, 1.0, {})]
    out = tmp_path / "run" / "rejection" / "sft.jsonl"
    write_jsonl(str(out), [sft_record(c, {"policy": "p"}, cfg, None) for c in kept])

    written = [json.loads(line) for line in out.read_text().splitlines()]
    for r, colour in zip(written, ("red", "blue")):
        assert set(r) == {"messages", "provenance"}
        user, assistant = r["messages"]
        assert user["content"][1] == {"type": "text", "text": "Colour?"}
        assert assistant == {"role": "assistant", "content": colour}
    assert written[1]["messages"][0]["content"][0]["image"] == str(tmp_path / "tasks" / "blue.png")
    monkeypatch.chdir(tmp_path / "run")  # the next stage reads from elsewhere: the paths still resolve
    batch = next(
        sft_batches(
            str(out),
            BYTE,
            batch_size=2,
            seq_len=32,
            seed=0,
            process_index=0,
            process_count=1,
            images=SPEC,
            shuffle=False,
            packing=False,
        )
    )
    slots = batch["inputs"] == BYTE.image_id
    assert (slots.sum(1) == SPEC.num_patches).all()
    colours = [tuple(np.round(p.reshape(-1, 3).mean(0) * 255).astype(int)) for p in batch["patches"][slots][::4]]
    assert colours == [(255, 0, 0), (0, 0, 255)]
    assert [BYTE.decode(t[m > 0]) for t, m in zip(batch["targets"], batch["loss_mask"])][0].startswith("red")


def test_text_prompts_are_still_prompt_response_records():
    task = Task("t:1", ({"role": "user", "content": "What is 3+4?"},), None)
    r = sft_record(Candidate("user", task, 0, "7", 1, 1.0, {}), {}, base_config(), None)
    assert (r["prompt"], r["response"]) == ("What is 3+4?", "7")
