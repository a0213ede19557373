"""Long-context RLVR (issue 28 item 3): task files of long documents (tools/long_context_tasks.py)
with held-out names disjoint from training ones, and an RLVR run on them with the sampler's KV
cache and the learner's attention split over `mesh.sequence = 2` that trains as `sequence = 1`."""

from __future__ import annotations

import importlib.util
import json
import re

import numpy as np

from posttrain.config import base_config
from posttrain.data.tokenizer import ByteTokenizer
from posttrain.stages import rlvr as loop
from tests.support.paths import ROOT
from tests.support.rl_runs import TIMING, rows, tiny
from tests.support.typed_configs import typed

_spec = importlib.util.spec_from_file_location("long_context_tasks", ROOT / "tools" / "long_context_tasks.py")
tasks_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tasks_tool)
write_tasks, task_records = tasks_tool.main, tasks_tool.task_records

ASKED = re.compile(r"What is the (?:code|magic number) of (\w+)\?|^(\w+)=\?$", re.M)


def asked_names(records) -> set[str]:
    """The name each problem asks about (the thing to retrieve)."""
    return {next(g for g in ASKED.findall(r["prompt"])[-1] if g) for r in records}


def test_held_out_documents_name_nothing_training_documents_mention():
    kinds, lengths = ("needle", "multihop", "recall"), (200, 320)
    train = task_records("train", 60, lengths, kinds)
    held_out = task_records("eval", 30, lengths, kinds)
    names = asked_names(held_out)
    assert len(names) > 20  # names drawn per problem (a few may repeat within the split)
    text = "\n".join(r["prompt"] for r in train)
    assert not [n for n in names if re.search(rf"\b{n}\b", text)]
    assert asked_names(train).isdisjoint(names)
    for r in held_out:  # exact integer answers, found in the document (a multi-hop one by arithmetic)
        assert re.fullmatch(r"-?\d+", r["answer"]) and r["domain"].startswith("long_context_")
    tok = ByteTokenizer()
    assert {r["difficulty"] for r in train} == set(lengths)
    assert all(r["difficulty"] - 64 <= len(tok.encode(r["prompt"])) <= r["difficulty"] for r in train)  # filled


def test_long_context_rlvr_on_a_sequence_sharded_mesh_trains_as_one_shard(tmp_path):
    """Two steps on 240-token multi-hop documents, sampling one step ahead of the learner
    (`rl.max_staleness = 1`) with an entropy bonus (so the first update moves the weights even
    when no answer is right): every logged metric of the run with `mesh.sequence = 2` (KV cache and
    learner split along the sequence) drawing through continuous batching equals the static
    `sequence = 1` run's."""
    write_tasks(["--out", str(tmp_path / "tasks"), "--lengths", "240", "--train", "16", "--eval", "4"])
    train = str(tmp_path / "tasks" / "train.jsonl")
    assert all(len(json.loads(line)["prompt"]) > 200 for line in open(train))
    runs = {}
    for sequence in (1, 2):
        cfg = tiny(tmp_path / f"seq{sequence}", train_files=train, max_new_tokens=8)
        cfg.rl.arithmetic_size = base_config().rl.arithmetic_size
        cfg.train.steps = 2
        cfg.model.moe.num_experts = 0  # dense: compiles faster
        cfg.mesh.data, cfg.mesh.expert, cfg.mesh.tensor, cfg.mesh.sequence = -1, 1, 2, sequence
        cfg.rl.max_staleness, cfg.rl.entropy_coef = 1, 0.01
        if sequence == 2:
            cfg.sampling.continuous_batching, cfg.sampling.num_slots, cfg.sampling.refill_batch = True, 4, 2
        loop.run(typed(cfg))
        runs[sequence] = rows(tmp_path / f"seq{sequence}")
    assert len(runs[1]) == len(runs[2]) == 2
    # How many batches wait in the queue when a step logs is scheduling, not learning: with
    # `max_staleness = 1` the sampler may or may not have finished the next batch by then.
    scheduling = (*TIMING, "rl/buffer_size")
    for a, b in zip(runs[1], runs[2]):
        assert sorted(a) == sorted(b)
        for key in a:
            if key not in scheduling:
                np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-6, err_msg=f"step {a['step']} {key}")
    assert any(k.startswith("tasks/long_context_multihop") for k in runs[1][-1])
    assert runs[2][0]["grad_norm"] > 0 and runs[2][-1]["rl/staleness_max"] == 1
