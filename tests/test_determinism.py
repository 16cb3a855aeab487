"""`looprl.determinism.environment`: the one environment record of every report."""
from looprl import determinism

KEYS = {"jax", "jaxlib", "python", "backend", "device_kind", "device_count", "cpu_model",
        "cpu_count", "cpu_affinity", "xla_flags", "threads_pinned", "intra_op_threads",
        "platform", "git_commit", "git_dirty", "accelerator_pins", "accel_matmul"}


def test_environment_record_holds_the_union_of_both_former_records(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    env = determinism.environment()
    assert set(env) == KEYS
    assert env["backend"] == "cpu" and env["threads_pinned"] is True
    assert env["intra_op_threads"] == 1
    assert set(env["accelerator_pins"]) == {*determinism.ACCELERATOR_FLAGS,
                                            *determinism.ACCELERATOR_ENV}
    assert env["git_dirty"] in (True, False, None)
    assert env["git_commit"] is None or len(env["git_commit"]) == 40
