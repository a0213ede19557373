"""Per-process choices agreed across processes (`parallel.agree`), and `auto` context parallelism
decided from an agreed estimate that counts remat (pure host code, and one traced model)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.config import RunConfig
from posttrain.models.attention import AttentionKernel
from posttrain.ops import context_parallel as cp
from posttrain.parallel import DEFAULT_RULES, Disagreement, agree, make_mesh, use_sharding
from posttrain.parallel import agreement as agreement_module


def two_processes(monkeypatch, views):
    """Pretend to be one of 2 processes whose exchange returns `views`; the values sent are kept."""
    sent = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(agreement_module, "allgather_json", lambda v: sent.append(v) or views)
    return sent


def test_agree_single_process_is_the_identity_without_a_collective(monkeypatch):
    monkeypatch.setattr(agreement_module, "allgather_json", lambda v: pytest.fail("no exchange with one process"))
    assert agree("ring", name="strategy") == "ring"
    assert agree(3, name="x", reduce="min") == 3
    assert agree([4, 2], name="steps", reduce="intersection") == {2, 4}
    with pytest.raises(ValueError, match="reduce='median'"):
        agree(1, name="x", reduce="median")


def test_agree_checks_or_reduces_every_process_view(monkeypatch):
    two_processes(monkeypatch, ["all_gather", "ring"])
    with pytest.raises(Disagreement, match="strategy: process 0: 'all_gather', process 1: 'ring'"):
        agree("all_gather", name="strategy")
    two_processes(monkeypatch, [(1, 2), [1, 2]])  # JSON turns tuples into lists on the way
    two_processes(monkeypatch, [[1, 2], [1, 2]])
    assert agree((1, 2), name="pair") == (1, 2)  # equal views: this process's own value
    two_processes(monkeypatch, [16 * 2**30, 2**20])
    assert agree(16 * 2**30, name="bytes", reduce="min") == 2**20
    assert agree(16 * 2**30, name="bytes", reduce="max") == 16 * 2**30
    two_processes(monkeypatch, [False, True])
    assert agree(False, name="stop", reduce="any") is True and agree(False, name="ok", reduce="all") is False
    sent = two_processes(monkeypatch, [[2, 4], [2]])
    assert agree({4, 2}, name="steps", reduce="intersection") == {2}
    assert agree({4, 2}, name="steps", reduce="union") == {2, 4}
    assert sent[-1] == [2, 4]  # sets travel as sorted lists


def test_device_memory_table_by_kind():
    GiB = 2**30
    assert cp.kind_memory_bytes("TPU v5 lite") == 16 * GiB
    assert cp.kind_memory_bytes("TPU v5") == cp.kind_memory_bytes("TPU v5p") == 95 * GiB
    assert cp.kind_memory_bytes("TPU v6 lite") == cp.kind_memory_bytes("TPU v4") == 32 * GiB
    assert cp.kind_memory_bytes("NVIDIA H100 80GB HBM3") == 80 * GiB
    assert cp.kind_memory_bytes("NVIDIA A100-SXM4-40GB") == 40 * GiB
    assert cp.kind_memory_bytes("NVIDIA A100-SXM4-80GB") == 80 * GiB
    assert cp.kind_memory_bytes("NVIDIA H200") == 141 * 10**9
    assert cp.kind_memory_bytes("cpu") is None


def test_auto_estimate_counts_remat_and_uses_the_agreed_smallest_memory(monkeypatch):
    """remat=none keeps every layer's gathered K/V; the device memory is the smallest any process
    reports (here another process's), so every process resolves `auto` alike."""
    assert cp.live_layers("none", 28) == 28 and cp.live_layers("full", 28) == cp.live_layers("dots", 28) == 1
    one = cp.gathered_kv_bytes((1, 4096, 8, 128), 8, 2)
    assert cp.gathered_kv_bytes((1, 4096, 8, 128), 8, 2, layers=28) == 28 * one
    mesh = make_mesh(dict(data=8))
    assert cp.local_memory_bytes(mesh) == (cp.DEFAULT_DEVICE_BYTES, "default")  # CPU reports none
    cp._agreed_memory.cache_clear()
    two_processes(monkeypatch, [16 * 2**30, 2**30])  # process 1's devices are smaller
    try:
        assert cp.device_memory_bytes(mesh) == (2**30, "another process")
        budget = 2**30 // 16
        full = cp.auto_estimate("auto", (1, 256, 2, 64), 4, 4, 1, mesh)
        none = cp.auto_estimate("auto", (1, 256, 2, 64), 4, 4, 48, mesh)
        assert full["kv_bytes"] <= budget < none["kv_bytes"]
        assert (full["strategy"], none["strategy"]) == ("all_gather", "ring")
        assert none["device_bytes"] == 2**30 and none["budget_bytes"] == budget
    finally:
        cp._agreed_memory.cache_clear()


def test_auto_memory_of_abstract_devices_comes_from_the_table():
    """Ahead-of-time compiles (abstract TPU devices cannot be asked) use the device kind's HBM."""
    from posttrain.plan import aot

    if not aot.libtpu_available():
        pytest.skip("libtpu not installed")
    mesh = make_mesh(dict(data=4), aot.tpu_devices("v5e:2x2"))
    assert cp.local_memory_bytes(mesh) == (16 * 2**30, "table (TPU v5 lite)")


def test_auto_in_a_traced_model_follows_remat_and_is_recorded(monkeypatch):
    """The same layer kernel and length: all_gather under remat=full (one layer's K/V live), ring under
    remat=none (both layers'), with a device memory that fits one layer's only; the choice is
    recorded (what `compile_plan` reports) with its numbers."""
    monkeypatch.setattr(cp, "reported_memory_bytes", lambda device: 3 * 2**19)  # budget 96 KiB
    cp._agreed_memory.cache_clear()
    cfg = RunConfig().model.replace(num_layers=2, attention="blockwise", attention_block=64, context_parallel="auto")
    # gathered K/V + float32 grads of one layer: 2·256·2·8·(4+4) bytes = 64 KiB
    q, kv = jax.ShapeDtypeStruct((1, 256, 4, 8), jnp.float32), jax.ShapeDtypeStruct((1, 256, 2, 8), jnp.float32)
    pos = jax.ShapeDtypeStruct((1, 256), jnp.int32)
    choices = {}
    try:
        with use_sharding(make_mesh(dict(data=2, sequence=4)), DEFAULT_RULES):
            for remat in ("full", "none"):
                with cp.recorded() as seen:
                    jax.eval_shape(AttentionKernel.from_config(cfg.replace(remat=remat)), q, kv, kv, pos, pos)
                choices[remat] = seen
    finally:
        cp._agreed_memory.cache_clear()
    (full,), (none,) = choices["full"], choices["none"]
    assert full["layers"] == 1 and none["layers"] == 2 and none["kv_bytes"] == 2 * full["kv_bytes"]
    assert full["device_bytes"] == 3 * 2**19 and full["device_source"] == "reported"
    assert np.isclose(full["kv_bytes"], 2 * 256 * 2 * 8 * (4 + 4))
    assert (full["strategy"], none["strategy"]) == ("all_gather", "ring")


def test_evaluation_steps_while_any_process_has_a_batch(monkeypatch):
    """Packed SFT slices give processes different numbers of evaluation batches: this process has
    1, the other 2. Both step twice (a process without a batch collectively steps on all-padding
    rows of weight 0), so the metric is that of the real batches only (on main this process
    stopped after 1 step and the other hung in the next one's collective)."""
    from flax import nnx

    from posttrain.stages import common

    class Scale(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(()))

    def metric(model, batch):
        n = batch["loss_mask"].sum()
        return {"loss": (batch["x"] * batch["loss_mask"]).sum() * model.w / jnp.maximum(n, 1)}, n

    mine = [{"x": np.full((2, 3), 2.0, np.float32), "loss_mask": np.ones((2, 3), np.int32)}]
    other_has = iter([True, True, False])  # the other process: batches at steps 1 and 2, then done
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(agreement_module, "allgather_json", lambda v: [v, next(other_has)])
    seen = []
    monkeypatch.setattr(common, "put_batch", lambda b: seen.append(b) or jax.tree.map(jnp.asarray, b))
    out = common.make_evaluator(metric, lambda: iter(mine))(Scale())
    assert len(seen) == 2 and not seen[1]["loss_mask"].any()  # stepped on padding after its own batch
    assert out == {"loss": 2.0}


def test_checkpoints_to_read_are_those_every_process_lists(tmp_path, monkeypatch):
    """A run still saving may add a checkpoint between two processes' looks: the eval stage's steps
    and init_from's newest step are those every process lists (here the other one lacks 6)."""
    import types

    from posttrain.core.checkpoint import Checkpointer
    from posttrain.stages.eval import checkpoint_steps

    ckpt = Checkpointer(str(tmp_path / "checkpoints"), every=1, keep=3, async_save=False)
    for step in (2, 4, 6):
        ckpt.save(step, {"params": {"w": jnp.full((2,), float(step))}})
    ckpt.close()
    monkeypatch.setattr(agreement_module, "jax", types.SimpleNamespace(process_count=lambda: 2))
    monkeypatch.setattr(
        agreement_module,
        "allgather_json",
        lambda v: [v, [x for x in v if x != 6] if isinstance(v, list) else min(v, 4)],
    )
    assert checkpoint_steps(RunConfig().replace({"eval.steps": "latest"}), str(tmp_path)) == [4]
    assert checkpoint_steps(RunConfig().replace({"eval.steps": "all"}), str(tmp_path)) == [2, 4]
    reader = Checkpointer(str(tmp_path / "checkpoints"), every=0, keep=1, create=False)
    target = {"params": {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}}
    step, trees, _, _ = reader.restore_newest(target)
    reader.close()
    assert step == 4 and float(trees["params"]["w"][0]) == 4.0


def test_alert_stops_are_agreed_across_processes(monkeypatch):
    """alerts.on = "stop": a rule may read a local fact (throughput_stall: this host's clock), so a
    process whose rules did not fire stops too when another's did (on main it kept going alone
    into the next step's collective)."""
    from posttrain.core.alerts import AlertMonitor, AlertStop
    from posttrain.core.harness import Harness

    run = Harness("sft", 10, None, None, workdir="", progress=False, alerts=AlertMonitor({}, mode="stop"))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(agreement_module, "allgather_json", lambda fired: [fired, True])  # the other one's fired
    with pytest.raises(AlertStop, match="step 3 .*another process's alerts fired"):
        run.alert(3, {"loss": 1.0})
    monkeypatch.setattr(agreement_module, "allgather_json", lambda fired: [fired, False])
    run.alert(4, {"loss": 1.0})  # nobody's fired: carry on
    with pytest.raises(AlertStop, match="nonfinite"):
        run.alert(5, {"loss": float("nan")})  # this one's fired: its own message
