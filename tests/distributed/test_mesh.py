"""Meshes and multi-process runs: the mesh from config, shardings, the schedule's mesh
record; in subprocesses with forced host devices, a GRPO step on 4 devices against 1, replay
bits on the sharded learner, checkpoints across device counts, and two processes joined by
`jax.distributed` (gloo CPU collectives).

Device counts must be fixed before jax starts, so multi-device checks run in subprocesses with
`XLA_FLAGS=--xla_force_host_platform_device_count=N --xla_cpu_multi_thread_eigen=false`.
The default suite runs the 4-device sharded replay and the checkpoint round trip; the GRPO step
on 4 devices against 1, the 8-device cases and the two-process run are under `-m slow` (each
starts cold processes that spend most of their time compiling).
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from looprl.config import ExperimentConfig, MeshConfig, apply_overrides
from looprl.distributed.mesh import mesh_record, mesh_shape, param_specs, replay_compatible
from looprl.distributed.multihost import distributed_settings
from looprl.errors import ConfigError

HERE = Path(__file__).resolve().parent
STEP = HERE / "grpo_step_worker.py"
WORKER = HERE / "mesh_worker.py"


def _env(devices: int, **extra) -> dict:
    env = dict(os.environ)  # PYTHONPATH and the rest pass through
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count="
               f"{devices} --xla_cpu_multi_thread_eigen=false", **extra)
    return env


def _start(args, devices: int, **extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *map(str, args)], env=_env(devices, **extra),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 600) -> None:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"subprocess timed out:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]


def _load_step(path: Path):
    z = np.load(path)
    meta = json.loads(str(z["meta"]))
    flat = np.concatenate([z[k].ravel() for k in sorted(z.files) if k != "meta"])
    return meta, flat


# --- in-process --------------------------------------------------------------------------------

def test_mesh_shape_fills_the_rest_and_names_the_bad_key():
    assert mesh_shape(-1, 1, 1, n_devices=8) == (8, 1, 1)
    assert mesh_shape(2, -1, 1, n_devices=8) == (2, 4, 1)
    assert mesh_shape(n_devices=1) == (1, 1, 1)  # the default on one device: no split
    with pytest.raises(ConfigError, match=r"'mesh.data'.*mesh.fsdp=3.*does not divide"):
        mesh_shape(-1, 3, 1, n_devices=8)
    with pytest.raises(ConfigError, match="product"):
        mesh_shape(2, 2, 1, n_devices=8)
    with pytest.raises(ConfigError, match="mesh.tensor"):
        MeshConfig(tensor=2)
    cfg = apply_overrides(ExperimentConfig(), ["mesh.data=2", "fsdp=4"])
    assert (cfg.mesh.data, cfg.mesh.fsdp) == (2, 4)


class _FakeMesh:
    shape = {"data": 2, "fsdp": 4, "tensor": 1}


def test_fsdp_shards_the_largest_divisible_axis_and_replicates_the_rest():
    tree = {"q": np.zeros((2, 64, 96)), "down": np.zeros((2, 384, 64)), "bias": np.zeros((1,)),
            "odd": np.zeros((3, 5))}
    specs = param_specs(tree, _FakeMesh())
    assert specs == {"q": P(None, None, "fsdp"), "down": P(None, "fsdp", None), "bias": P(),
                     "odd": P()}


def test_distributed_settings_from_arguments_and_environment(monkeypatch):
    for k in ("LOOPRL_COORDINATOR", "LOOPRL_NUM_PROCESSES", "LOOPRL_PROCESS_ID",
              "LOOPRL_DISTRIBUTED"):
        monkeypatch.delenv(k, raising=False)
    assert distributed_settings() is None  # alone: no jax.distributed.initialize
    assert distributed_settings("10.0.0.1:1234", 4, 3) == {
        "coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}
    assert distributed_settings(auto=True) == {}  # TPU / SLURM auto-detection
    monkeypatch.setenv("LOOPRL_COORDINATOR", "h:1")
    monkeypatch.setenv("LOOPRL_NUM_PROCESSES", "2")
    monkeypatch.setenv("LOOPRL_PROCESS_ID", "1")
    assert distributed_settings() == {"coordinator_address": "h:1", "num_processes": 2,
                                      "process_id": 1}
    with pytest.raises(ConfigError, match="--process-id"):
        distributed_settings(process_id=5)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        distributed_settings("nohostport")


def test_replay_is_claimed_only_where_no_contraction_axis_was_split():
    one = mesh_record(None)
    four = dict(one, axes={"data": 4, "fsdp": 1, "tensor": 1}, devices=4, row_shards=4)
    assert replay_compatible(one, four)[0] and replay_compatible(None, four)[0]
    split = dict(four, contraction_sharded=True, param_sharding={"o_proj": "P(None, 'tensor')"})
    assert replay_compatible(split, split)[0]
    ok, why = replay_compatible(split, four)
    assert not ok and "contraction" in why


def test_schedule_records_the_mesh_and_reads_files_without_one(tmp_path):
    from looprl.model.config import preset
    from looprl.model.looped import init_params
    from looprl.sampling.sampler import SamplingConfig, generate
    from looprl.sampling.schedule import RolloutBatch, Schedule
    cfg = preset("tiny", vocab_size=32, hidden_size=64, intermediate_size=128, num_heads=2,
                 num_kv_heads=2, head_dim=32)
    rb = generate(cfg, init_params(cfg, 0), [[3, 4]], SamplingConfig(max_new_tokens=2))
    assert rb.schedule.mesh == mesh_record(None) and rb.schedule.devices == 1
    rb.save(tmp_path / "r.npz")
    assert RolloutBatch.load(tmp_path / "r.npz").schedule == rb.schedule
    old = rb.schedule.to_dict()
    del old["mesh"]  # a format-1 file written before meshes
    assert Schedule.from_dict(old, version=1).mesh is None


# --- subprocesses with forced host devices -------------------------------------------------------

@pytest.mark.parametrize("devices,extra", [
    # slow (159 s on a 2-core AMD EPYC): two cold processes; the default suite's mesh checks are
    # the sharded replay below (4 devices) and the in-process tests above
    pytest.param(4, [], marks=pytest.mark.slow),
    # 8 devices, micro-batches of 2 rows: padded with 6 token-less rows each
    pytest.param(8, ["learner.microbatch_size=2"], marks=pytest.mark.slow)])
def test_grpo_step_on_n_devices_matches_1_device(tmp_path, devices, extra):
    """Same loss and updated parameters (relative L2 <= 1e-6, fp32) on a data x fsdp = N/2 x 2
    mesh as on one device; replay exact on both."""
    procs = [_start([STEP, tmp_path / "one.npz", *extra], 1),
             _start([STEP, tmp_path / "four.npz", "mesh.fsdp=2", *extra], devices)]
    for p in procs:
        _finish(p)
    m1, w1 = _load_step(tmp_path / "one.npz")
    m4, w4 = _load_step(tmp_path / "four.npz")
    assert m1["mesh"] is None and m4["mesh"] == {"data": devices // 2, "fsdp": 2, "tensor": 1}
    assert m1["replay_exact_fraction"] == 1.0 and m4["replay_exact_fraction"] == 1.0
    assert m1["reward_mean"] == m4["reward_mean"]  # the same rollout
    assert abs(m4["loss"] - m1["loss"]) <= 1e-6 * abs(m1["loss"])
    assert np.linalg.norm(w4 - w1) <= 1e-6 * np.linalg.norm(w1)
    assert not np.array_equal(w1, np.zeros_like(w1))


@pytest.mark.parametrize("devices, policies", [
    (4, "deferred"),  # the default suite: deferred holds dense's work and its pending windows
    pytest.param(4, "dense", marks=pytest.mark.slow),  # 127 s for both on a 2-core AMD EPYC
    pytest.param(8, "dense,deferred", marks=pytest.mark.slow)])
def test_sharded_learner_replays_the_sharded_sampler_bit_for_bit(tmp_path, devices, policies):
    _finish(_start([WORKER, "replay", tmp_path, policies], devices))
    res = json.loads((tmp_path / "replay.json").read_text())
    assert res["devices"] == devices
    assert sorted(k for k in res if k != "devices") == sorted(policies.split(","))
    for policy in policies.split(","):
        r = res[policy]
        assert r["schedule_devices"] == devices and r["schedule_mesh"]["row_shards"] == devices
        assert r["tokens_equal_one_device"] and r["exits_equal_one_device"]
        assert r["emitted"] > 50
        assert r["replay_exact"] == 1.0
        assert r["stock_exact"] < 1.0  # the negative control can fail
        replay = [c for c in r["cells"] if c["method"] == "replay"]
        assert {(c["devices"], c["params"]) for c in replay} == {(devices, "sampler"),
                                                                 (devices, "updated")}
        assert all(c["exact_fraction"] == 1.0 for c in replay), replay
        # rows are batch-invariant: the sharded learner also equals the one-device sampler
        assert all(c["exact_fraction_vs_one_device_sampler"] == 1.0 for c in replay), replay


def test_checkpoints_cross_device_counts(tmp_path):
    """Written on 1 device, restored onto 4 (fsdp-sharded); written on 4 from sharded arrays,
    restored on 1 — same bits."""
    from looprl.io.checkpoint import load_model_checkpoint, load_train_state, save_model_checkpoint
    sys.path.insert(0, str(HERE))
    import mesh_worker
    p0 = mesh_worker.params0()
    save_model_checkpoint(tmp_path / "ck1", p0, mesh_worker.CFG, None)
    _finish(_start([WORKER, "ckpt", tmp_path], 4))
    res = json.loads((tmp_path / "ckpt.json").read_text())
    assert res["restored_bits_equal"]
    assert res["specs"]["['layers']['q_proj']"] == "P(None, None, 'fsdp')"
    assert res["sharded_leaves"] > 5
    got, cfg, _, _ = load_model_checkpoint(tmp_path / "ckN")
    assert cfg == mesh_worker.CFG
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(p0)):
        assert np.array_equal(np.asarray(a).view(np.uint32), (b * 2.0).view(np.uint32))
    state = jax.tree.leaves(load_train_state(tmp_path / "ckN"))  # adam: count, mu, nu
    assert len(state) == 2 * len(jax.tree.leaves(p0)) + 1
    assert all(not np.any(x) for x in state)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two cold processes joined by gloo: 116 s on a 2-core AMD EPYC
def test_two_processes_run_a_grpo_step_and_a_checkpoint_round_trip(tmp_path):
    """Two processes x 2 CPU devices joined by jax.distributed (gloo), parameters fsdp-sharded
    across both: one GRPO step (same numbers as one device, see above) and a checkpoint that
    both write and read back bit for bit."""
    port = _free_port()
    procs = [_start([STEP, tmp_path / "two.npz", "mesh.data=1", "mesh.fsdp=4"], 2,
                    LOOPRL_COORDINATOR=f"127.0.0.1:{port}", LOOPRL_NUM_PROCESSES="2",
                    LOOPRL_PROCESS_ID=str(i), LOOPRL_TEST_CKPT=str(tmp_path / "ck"))
             for i in range(2)]
    for p in procs:
        _finish(p, timeout=400)
    meta, flat = _load_step(tmp_path / "two.npz")
    assert meta["processes"] == 2 and meta["devices"] == 4
    assert meta["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert meta["replay_exact_fraction"] == 1.0 and np.isfinite(meta["loss"])
    assert meta["ckpt_roundtrip_bits"]
    from looprl.io.checkpoint import load_model_checkpoint
    got, _, _, _ = load_model_checkpoint(tmp_path / "ck")
    saved = np.concatenate([np.asarray(got_leaf).ravel() for _, got_leaf in sorted(
        ((jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_leaves_with_path(got)),
        key=lambda kv: kv[0])])
    assert np.array_equal(saved.view(np.uint32), flat.view(np.uint32))


@pytest.mark.slow  # 31 s
def test_verify_cells_on_one_device_keep_the_two_batchings_and_no_mesh_cells():
    """With one device visible, `looprl verify` has no `devices` > 1 cells (and its rollout
    cells are unchanged: `same` and `different` batching on one device)."""
    sys.path.insert(0, str(HERE))
    import mesh_worker

    from looprl.verify.matrix import VerifyOptions, _cell_group, updated_params
    from looprl.sampling.sampler import SamplingConfig, generate
    p = mesh_worker.params0()
    rb = generate(mesh_worker.CFG, p, mesh_worker.PROMPTS,
                  SamplingConfig(max_new_tokens=4, exit_threshold=0.7), group_size=2, seed=1)
    opts = VerifyOptions(min_tokens=1, min_early_exit_fraction=0.0)
    pu = updated_params(mesh_worker.CFG, p, rb, opts.update_learning_rate, 0)
    cells = _cell_group(mesh_worker.CFG, p, pu, rb, weights="random", opts=opts, n_devices=1,
                        log=lambda *a: None)
    assert {(c["batching"], c["devices"]) for c in cells} == {("same", 1), ("different", 1)}
    assert len(cells) == 2 * 2 * 3 and all("exact_fraction_vs_one_device_sampler" not in c
                                           for c in cells)
    assert all(c["exact_fraction"] == 1.0 for c in cells if c["method"] == "replay")


def test_train_cli_rejects_a_bad_coordinator_before_starting(capsys):
    from looprl.cli import main
    smoke = HERE.parents[1] / "experiments" / "tiny_arith_smoke.py"
    assert main(["train", str(smoke), "--coordinator", "no-port", "--num-processes", "2",
                 "--process-id", "0"]) == 2
    assert "--coordinator: expected HOST:PORT" in capsys.readouterr().err


def test_a_run_may_resume_on_another_mesh():
    from looprl.train.resume import check_resume_config
    saved = apply_overrides(ExperimentConfig(), ["mesh.data=1", "mesh.fsdp=4"])
    check_resume_config(saved, ExperimentConfig(), "saved config")  # no ConfigError
    with pytest.raises(ConfigError, match="seed"):
        check_resume_config(saved, apply_overrides(saved, ["seed=3"]), "saved config")
