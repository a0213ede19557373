"""gs:// paths end to end against a local GCS emulator (tests/support/gcs_emulator.py; no mocks): the
storage helpers, then an SFT run and an RLVR run whose data, workdir (metrics, TensorBoard,
config, orbax checkpoints through tensorstore, rollouts) and init_from are all on the emulator,
each stopped and resumed, with nothing written to the local working folder or temp folder."""

import json
import os
import tempfile

import numpy as np
import pytest

pytest.importorskip("gcp_storage_emulator", reason="pip install -e '.[test]' (gcp-storage-emulator)")

from posttrain import storage  # noqa: E402
from tests.support.gcs_emulator import gcs_emulator  # noqa: E402
from tests.support.typed_configs import TINY_DENSE

BUCKET = "posttrain-test"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The emulator's gs:// root for this module (bucket created, environment pointed at it)."""
    log = tmp_path_factory.mktemp("gcs") / "emulator.log"
    with gcs_emulator(BUCKET, str(log)):
        yield f"gs://{BUCKET}"


@pytest.mark.parametrize("where", ["local", "gs"])
def test_storage_helpers(where, gcs, tmp_path):
    root = str(tmp_path) if where == "local" else f"{gcs}/helpers"
    d = storage.join(root, "a", "b")
    storage.makedirs(d)
    path = storage.join(d, "x.jsonl")
    assert not storage.exists(path)
    storage.append_text(path, "1\n")
    storage.append_text(path, "2\n")
    assert storage.read_text(path) == "1\n2\n"
    assert storage.isfile(path) and storage.isdir(d) and not storage.isfile(d)
    storage.write_bytes(storage.join(d, "y.bin"), b"\x00\x01")
    assert storage.glob(storage.join(root, "a", "*", "*.jsonl")) == [path]
    storage.replace(storage.join(d, "y.bin"), storage.join(d, "z.bin"))
    assert not storage.exists(storage.join(d, "y.bin"))
    storage.copy_file(storage.join(d, "z.bin"), storage.join(root, "copy.bin"))
    with storage.open_file(storage.join(root, "copy.bin"), "rb") as f:
        assert f.read() == b"\x00\x01"
    if where == "gs":
        with pytest.raises(ValueError, match="cannot append"):
            storage.open_file(path, "a")


def test_append_log_uploads_on_flush_interval_and_close(gcs):
    """Remote AppendLog: rows reach the object on the first write after `flush_secs`, and on close;
    a new log over an existing object continues it."""
    path = f"{gcs}/log/metrics.jsonl"
    log = storage.AppendLog(path, flush_secs=3600)
    log.rewrite("a\n")
    assert storage.read_text(path) == "a\n"
    log.append("b\n")  # within flush_secs: kept in memory
    assert storage.read_text(path) == "a\n" and log.text() == "a\nb\n"
    log.close()
    assert storage.read_text(path) == "a\nb\n"
    again = storage.AppendLog(path, flush_secs=0)
    again.append("c\n")  # flush_secs=0: every write uploads
    assert storage.read_text(path) == "a\nb\nc\n"


# ---------------------------------------------------------------------------------------------
# Runs on gs://: one SFT and one RLVR run, each interrupted (run to a checkpoint, then resumed).

SFT_STEPS, RL_STEPS = 4, 3


def tiny_config(stage: str, workdir: str):
    from posttrain.config import base_config

    cfg = base_config()
    cfg.stage, cfg.workdir = stage, workdir
    m = cfg.model
    m.update(TINY_DENSE)
    cfg.train.batch_size, cfg.train.seq_len, cfg.train.log_every, cfg.train.progress = 8, 64, 1, False
    cfg.checkpoint.every, cfg.optim.warmup_steps = 2, 0
    cfg.compilation_cache = "off"
    return cfg


def write_data(root: str) -> dict:
    """SFT conversations in two files (read through a glob) and RL math tasks, on the store."""
    from posttrain.data.synthetic import arithmetic_records

    sft = arithmetic_records("sft", 64, seed=1)
    for i in range(2):
        storage.write_text(f"{root}/data/sft-{i}.jsonl", "".join(json.dumps(r) + "\n" for r in sft[i::2]))
    rng = np.random.default_rng(0)
    tasks = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in rng.integers(0, 50, (32, 2))]
    storage.write_text(f"{root}/data/tasks.jsonl", "".join(json.dumps(t) + "\n" for t in tasks))
    return {"sft": f"{root}/data/sft-*.jsonl", "tasks": f"{root}/data/tasks.jsonl"}


def run_twice(cfg, steps: int, first: int):
    """Run `cfg` to step `first` (a checkpoint), then again to `steps` (resumes); the results."""
    from posttrain.main import run

    cfg.train.steps = first
    a = run(cfg)
    cfg.train.steps = steps
    return a, run(cfg)


def local_files(*folders: str) -> set[str]:
    return {os.path.join(r, f) for d in folders for r, _, fs in os.walk(d) for f in fs}


@pytest.fixture(scope="module")
def gs_runs(gcs, tmp_path_factory):
    """SFT (2 steps, then resumed to 4) and RLVR from it (2, then 3) with every path on gs://, run
    from an empty working folder with an empty temp folder and cache home; what they left there."""
    cwd, tmp, cache = (tmp_path_factory.mktemp(n) for n in ("cwd", "tmp", "cache"))
    mp = pytest.MonkeyPatch()
    # metrics.jsonl uploads only when flushed, and each writer notes at close whether rows were still
    # waiting: the loops flush before every checkpoint (the last step always checkpoints).
    from functools import partialmethod

    from posttrain.core.metrics import MetricsWriter

    mp.setattr(storage.AppendLog, "__init__", partialmethod(storage.AppendLog.__init__, flush_secs=3600))
    pending_at_close, close = [], MetricsWriter.close
    mp.setattr(MetricsWriter, "close", lambda self: (pending_at_close.append(self._log.pending), close(self)))
    mp.chdir(cwd)
    mp.setattr(tempfile, "tempdir", str(tmp))
    mp.setenv("TMPDIR", str(tmp))
    mp.setenv("XDG_CACHE_HOME", str(cache))
    try:
        data = write_data(f"{gcs}/in")
        sft = tiny_config("sft", f"{gcs}/runs/sft")
        sft.sft.train_files, sft.sft.gate = data["sft"], ""
        sft.seed = 1  # its weights differ from a fresh (seed 0) policy: init_from is visible
        sft_results = run_twice(sft, SFT_STEPS, 2)
        rl = tiny_config("rlvr", f"{gcs}/runs/rl")
        rl.init_from = sft.workdir
        r = rl.rl
        r.train_files, r.prompts_per_step, r.group_size, r.max_new_tokens = data["tasks"], 2, 4, 12
        r.eval_every, r.rollouts_every, r.verifier_workers = 0, 1, 2
        rl_results = run_twice(rl, RL_STEPS, 2)
        yield {
            "sft": (sft, sft_results),
            "rl": (rl, rl_results),
            "pending_at_close": pending_at_close,
            "local": local_files(str(cwd), str(tmp), str(cache)),
            "cache": str(cache),
        }
    finally:
        mp.undo()


def test_gs_runs_write_nothing_locally(gs_runs):
    """No `gs:` folder, no file in the working or temp folder; the only local file of posttrain's
    is the remote workdir's lock, kept in the user's cache folder (an object store has no flock).
    (matplotlib, imported by the stages, keeps its font list in the cache folder too.)"""
    allowed = [os.path.join(gs_runs["cache"], d) + os.sep for d in (os.path.join("posttrain", "locks"), "matplotlib")]
    assert {f for f in gs_runs["local"] if not f.startswith(tuple(allowed))} == set()
    assert any(f.startswith(allowed[0]) for f in gs_runs["local"])


def test_gs_metrics_reach_the_store_before_each_checkpoint(gs_runs):
    """A run killed after a checkpoint and resumed from it finds every row up to it in a gs://
    metrics.jsonl: nothing was left waiting for the writer's close (4 runs: 2 SFT, 2 RL)."""
    assert gs_runs["pending_at_close"] == [False] * 4


@pytest.mark.parametrize("name,steps", [("sft", SFT_STEPS), ("rl", RL_STEPS)])
def test_gs_run_resumes_and_writes_its_workdir(gs_runs, name, steps):
    from posttrain.core.checkpoint import Checkpointer
    from posttrain.core.metrics import read_metrics

    cfg, (first, second) = gs_runs[name]
    wd = cfg.workdir
    assert [r["step"] for r in first.rows] == [0, 1]
    assert [r["step"] for r in second.rows] == list(range(2, steps))  # resumed at the step-2 checkpoint
    rows = [r for r in read_metrics(wd) if "event" not in r]
    assert [r["step"] for r in rows] == list(range(steps))  # one uninterrupted file
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in first.rows + second.rows], rtol=1e-6)
    assert json.loads(storage.read_text(f"{wd}/config.json"))["train"]["steps"] == steps
    events = storage.glob(f"{wd}/tensorboard/events.out.tfevents.*")
    assert len(events) == 2 and all(b"loss" in storage.open_file(e, "rb").read() for e in events)
    ckpt = Checkpointer(f"{wd}/checkpoints", every=0, keep=1, async_save=False, create=False)
    assert ckpt.all_steps() == [2, steps]
    ckpt.close()


def test_gs_rl_run_logs_rollouts(gs_runs):
    cfg = gs_runs["rl"][0]
    logged = storage.glob(f"{cfg.workdir}/rollouts/*.jsonl")
    assert [p.rsplit("/", 1)[1] for p in logged] == [f"{s:07d}.jsonl" for s in range(RL_STEPS)]
    rec = json.loads(storage.read_text(logged[-1]).splitlines()[0])
    assert rec["step"] == RL_STEPS - 1 and rec["prompt"]


def test_gs_rl_run_started_from_the_gs_init_from(gs_runs):
    """The RL policy after 2 updates is the SFT run's final weights (read from gs://) moved by at
    most what 2 Adam steps can move a weight (about lr each), not a fresh (other seed) policy."""
    import jax
    from flax import nnx

    from posttrain.core.init import load_model_state
    from posttrain.models.decoder import Decoder
    from posttrain.parallel import mesh_and_rules, use_sharding

    cfg = gs_runs["rl"][0]
    make = lambda: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    mesh, rules = mesh_and_rules(cfg)
    with use_sharding(mesh, rules):
        sft, _, sft_step = load_model_state(gs_runs["sft"][0].workdir, make, mesh, rules)
        rl, _, _ = load_model_state(cfg.workdir, make, mesh, rules, step=2)
    assert sft_step == SFT_STEPS
    moved = max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(jax.tree.leaves(rl), jax.tree.leaves(sft))
    )
    assert moved <= 3 * 2 * cfg.optim.lr, moved  # a fresh seed-0 policy is ~0.1-1 away


def test_hf_export_to_gs_equals_the_local_export(gs_runs, tmp_path):
    """tools/convert_hf.py --run gs://... --to_hf gs://...: the same files, byte for byte, as an
    export of that run to a local folder."""
    pytest.importorskip("safetensors")
    from posttrain.core.hf_convert import read_run_config, run_to_hf
    from posttrain.parallel import DEFAULT_RULES, make_mesh

    cfg = read_run_config(gs_runs["sft"][0].workdir)
    mesh, out = make_mesh(dict(fsdp=-1)), f"gs://{BUCKET}/hf/sft"
    assert run_to_hf(cfg, out, mesh, DEFAULT_RULES, progress=False) == run_to_hf(
        cfg, str(tmp_path), mesh, DEFAULT_RULES, progress=False
    )
    names = sorted(os.listdir(tmp_path))
    assert "model.safetensors" in names and "config.json" in names
    assert [p.rsplit("/", 1)[1] for p in storage.glob(f"{out}/*")] == names
    for name in names:
        with storage.open_file(f"{out}/{name}", "rb") as f:
            assert f.read() == (tmp_path / name).read_bytes(), name


def test_plot_and_error_log_of_a_gs_workdir(gs_runs):
    """tools/plot_metrics.py and the error log on a gs:// workdir: written there, not locally."""
    from posttrain.core.plot import load_runs, plot
    from posttrain.main import write_error_log

    wd = gs_runs["sft"][0].workdir
    assert [r["step"] for r in load_runs(wd)["."]] == list(range(SFT_STEPS))
    png = plot(wd, f"{wd}/metrics.png")
    with storage.open_file(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    for attempt in range(2):
        assert write_error_log(wd, ValueError(f"boom {attempt}")) == f"{wd}/error.log"
    text = storage.read_text(f"{wd}/error.log")
    assert "ValueError: boom 0" in text and "ValueError: boom 1" in text
