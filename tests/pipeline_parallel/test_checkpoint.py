"""Checkpoints: the full training state round-trips bit for bit; anything wrong is a clear
error naming the file, never a silent wrong restore."""

import json
import os

import numpy as np
import pytest

from pipeline_parallel.checkpoint import (CheckpointError, TrainingState, latest_checkpoint,
                                          list_checkpoints, load_checkpoint, params_sha256,
                                          save_checkpoint)


def _state(step=4, seed=0, dtype=np.float64, slots=2) -> TrainingState:
    rng = np.random.default_rng(seed)
    shapes = [(5, 7), (7, 3)]
    params = tuple((rng.standard_normal(s).astype(dtype),
                    rng.standard_normal(s[1]).astype(dtype)) for s in shapes)
    opt = tuple(tuple((rng.standard_normal(s).astype(dtype),
                       rng.standard_normal(s[1]).astype(dtype)) for s in shapes)
                for _ in range(slots))
    return TrainingState(step=step, params=params, optimizer_t=step, optimizer_slots=opt,
                         losses=rng.standard_normal(step), data_position=step * 12,
                         rng_state={"bit_generator": "PCG64", "state": {"state": 7, "inc": 3}},
                         fingerprint={"model": "m", "lr": 0.01})


def _same(a: TrainingState, b: TrainingState) -> bool:
    arrays_a, arrays_b = a.arrays(), b.arrays()
    return (arrays_a.keys() == arrays_b.keys()
            and all(x.dtype == arrays_b[k].dtype and np.array_equal(x, arrays_b[k])
                    for k, x in arrays_a.items())
            and (a.step, a.optimizer_t, a.data_position, a.rng_state, a.fingerprint)
            == (b.step, b.optimizer_t, b.data_position, b.rng_state, b.fingerprint))


@pytest.mark.parametrize("dtype,slots", [(np.float64, 1), (np.float32, 2), (np.float16, 0)])
def test_round_trip_is_exact(tmp_path, dtype, slots):
    state = _state(dtype=dtype, slots=slots)
    path = save_checkpoint(str(tmp_path), state)
    assert os.path.basename(path) == "step-00000004"
    back = load_checkpoint(path, fingerprint=state.fingerprint)
    assert _same(state, back)
    assert params_sha256(back.params) == params_sha256(state.params)
    # no temporary directory is left behind
    assert sorted(os.listdir(tmp_path)) == ["step-00000004"]


def test_latest_and_directory_restore(tmp_path):
    for step in (2, 4, 6):
        save_checkpoint(str(tmp_path), _state(step=step, seed=step))
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [2, 4, 6]
    assert latest_checkpoint(str(tmp_path)).endswith("step-00000006")
    assert _same(load_checkpoint(str(tmp_path)), _state(step=6, seed=6))
    # a half-written (hidden temporary) checkpoint is ignored
    os.makedirs(tmp_path / ".step-00000008.tmp-1")
    assert latest_checkpoint(str(tmp_path)).endswith("step-00000006")
    # taking the same step again replaces it whole
    save_checkpoint(str(tmp_path), _state(step=6, seed=99))
    assert _same(load_checkpoint(str(tmp_path)), _state(step=6, seed=99))
    assert sorted(os.listdir(tmp_path)) == [".step-00000008.tmp-1", "step-00000002",
                                            "step-00000004", "step-00000006"]


def test_params_sha256_sees_every_bit():
    state = _state()
    params = [(w.copy(), b.copy()) for w, b in state.params]
    h = params_sha256(params)
    params[1][0].view(np.uint64)[2, 1] ^= 1          # flip the lowest mantissa bit
    assert params_sha256(params) != h
    as32 = [(w.astype(np.float32), b.astype(np.float32)) for w, b in state.params]
    assert params_sha256(as32) != params_sha256(state.params)   # dtype is part of the bytes


def _corrupt_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,message", [
    (lambda d: _corrupt_byte(d / "arrays.npz"), "arrays.npz: sha256"),
    (lambda d: (d / "arrays.npz").unlink(), "arrays.npz: cannot be read"),
    (lambda d: (d / "manifest.json").unlink(), "manifest.json: file missing"),
    (lambda d: (d / "manifest.json").write_text("{not json"), "manifest.json: not a readable"),
    (lambda d: (d / "manifest.json").write_text('{"format": "other/9"}'), "format 'other/9'"),
    (lambda d: (d / "manifest.json").write_text((d / "manifest.json").read_text().replace(
        '"step": 4', '"step": 5')), "manifest was altered"),
])
def test_damaged_checkpoint_is_a_clear_error(tmp_path, damage, message):
    path = save_checkpoint(str(tmp_path), _state())
    d = tmp_path / "step-00000004"
    damage(d)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert message in str(info.value)
    assert str(d) in str(info.value)


def test_array_swapped_inside_a_valid_npz_is_caught(tmp_path):
    """A well-formed arrays.npz whose content differs from the manifest (file hash
    updated too) is caught by the per-array hashes."""
    import hashlib
    path = save_checkpoint(str(tmp_path), _state())
    other = _state(seed=5).arrays()
    np.savez(os.path.join(path, "arrays.npz"), **other)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    with open(os.path.join(path, "arrays.npz"), "rb") as f:
        manifest["files"]["arrays.npz"] = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(CheckpointError, match="does not match the manifest"):
        load_checkpoint(path)


def test_missing_and_foreign_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        load_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="manifest.json: file missing"):
        load_checkpoint(str(tmp_path))             # an empty directory
    path = save_checkpoint(str(tmp_path), _state())
    with pytest.raises(CheckpointError, match=r"fingerprint.lr is 0.01 there, 0.02 now"):
        load_checkpoint(path, fingerprint={"model": "m", "lr": 0.02})


# --- the batch sampler's state ------------------------------------------------------------

@pytest.mark.parametrize("n,batch", [(10, 3), (12, 4), (7, 7), (5, 1)])
def test_sampler_epochs_are_permutations_and_state_restores(n, batch):
    from pipeline_parallel.sampler import BatchSampler, SamplerState
    sampler = BatchSampler(n, batch, seed=3)
    drawn = np.concatenate([sampler.next_indices() for _ in range(3 * n)])   # 3*batch epochs
    for e in range(3 * batch):
        assert sorted(drawn[e * n:(e + 1) * n]) == list(range(n))      # each sample once
    assert sampler.data_position == 3 * n * batch
    # a state taken anywhere, through JSON, continues with the same batches
    for k in range(0, 2 * n, 3):
        a = BatchSampler(n, batch, seed=3)
        for _ in range(k):
            a.next_indices()
        saved = json.loads(json.dumps(a.state.to_dict()))
        b = BatchSampler(n, batch, seed=3, state=SamplerState.from_dict(saved))
        assert b.data_position == a.data_position == k * batch
        for _ in range(n + 2):
            assert np.array_equal(a.next_indices(), b.next_indices())


def test_sampler_refuses_bad_sizes_and_states():
    from pipeline_parallel.sampler import BatchSampler, SamplerState
    with pytest.raises(ValueError, match=r"batch_size: must be in 1..5"):
        BatchSampler(5, 6)
    with pytest.raises(ValueError, match="sampler state: expected rng_state, epoch, position"):
        SamplerState.from_dict({"epoch": 1})
