"""Checkpoints of the full training state, written atomically and verified on load.

A checkpoint taken after ``N`` completed steps is the directory ``DIR/step-0000000N/``::

    arrays.npz      parameters, optimizer slots, per-step losses (numpy .npz, no pickle)
    manifest.json   format, step, optimizer step count t, data position and RNG state,
                    the run's fingerprint, and the sha256 of arrays.npz and of every array

Writing: both files go to a hidden temporary directory ``DIR/.step-...tmp-<pid>``; each
file is fsynced, then the directory, then it is renamed to ``step-0000000N`` and ``DIR``
is fsynced. A crash at any moment leaves either the complete checkpoint or none (a
hidden temporary directory that loading ignores).

Loading checks everything it reads: a missing file, unparsable JSON, a sha256 that does
not match, an array whose shape or dtype differs from the manifest, or a fingerprint that
is not the current run's raises :class:`CheckpointError` naming the file and what is
wrong, never a silent wrong restore.

:func:`params_sha256` hashes the canonical bytes of parameters (for each array in order:
dtype, shape, little-endian C-order bytes): equal hashes mean bit-identical parameters.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
from dataclasses import dataclass, field

import numpy as np

__all__ = ["TrainingState", "CheckpointError", "save_checkpoint", "load_checkpoint",
           "latest_checkpoint", "list_checkpoints", "params_sha256", "FORMAT"]

FORMAT = "vcluster-checkpoint/1"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_ARRAYS, _MANIFEST = "arrays.npz", "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or belongs to another run."""


@dataclass(frozen=True)
class TrainingState:
    """Everything needed to continue training exactly where it stopped.

    ``params[l] = (W_l, b_l)`` global arrays; ``optimizer_slots[k][l]`` the optimizer's
    k-th state (SGD: velocity; Adam: m, v) for layer l, shaped like the parameters;
    ``optimizer_t`` its step count; ``losses`` one full-batch loss per completed step;
    ``data_position`` samples consumed so far; ``rng_state`` the batch sampler's
    generator state (None when the full batch is used every step); ``fingerprint`` what
    identifies the run (model, optimizer, batch): a checkpoint restores only into the
    same run.
    """

    step: int
    params: tuple
    optimizer_t: int
    optimizer_slots: tuple
    losses: np.ndarray
    data_position: int = 0
    rng_state: dict | None = None
    fingerprint: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return (f"TrainingState(step={self.step}, layers={len(self.params)}, "
                f"optimizer_t={self.optimizer_t}, slots={len(self.optimizer_slots)}, "
                f"data_position={self.data_position})")

    def arrays(self) -> dict[str, np.ndarray]:
        """The state's arrays by their names in ``arrays.npz``."""
        out = {"losses": np.asarray(self.losses, dtype=np.float64)}
        for l, (w, b) in enumerate(self.params):
            out[f"param.{l}.w"], out[f"param.{l}.b"] = w, b
        for k, slot in enumerate(self.optimizer_slots):
            for l, (w, b) in enumerate(slot):
                out[f"opt.{k}.{l}.w"], out[f"opt.{k}.{l}.b"] = w, b
        return out


def _array_sha256(a: np.ndarray) -> str:
    h = hashlib.sha256()
    a = np.ascontiguousarray(a)
    h.update(a.dtype.newbyteorder("<").str.encode())
    h.update(repr(tuple(a.shape)).encode())
    h.update(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
    return h.hexdigest()


def params_sha256(params) -> str:
    """sha256 of the canonical bytes of ``params`` ((W, b) per layer, or flat arrays)."""
    h = hashlib.sha256()
    for item in params:
        for a in (item if isinstance(item, (tuple, list)) else (item,)):
            h.update(_array_sha256(np.asarray(a)).encode())
    return h.hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def save_checkpoint(directory: str, state: TrainingState) -> str:
    """Write ``state`` atomically under ``directory``; return the checkpoint's path."""
    os.makedirs(directory, exist_ok=True)
    arrays = state.arrays()
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    blob = buf.getvalue()
    manifest = {
        "format": FORMAT, "step": int(state.step), "optimizer_t": int(state.optimizer_t),
        "layers": len(state.params), "optimizer_slots": len(state.optimizer_slots),
        "data_position": int(state.data_position), "rng_state": state.rng_state,
        "fingerprint": state.fingerprint,
        "files": {_ARRAYS: hashlib.sha256(blob).hexdigest()},
        "arrays": {name: {"sha256": _array_sha256(a), "shape": list(a.shape),
                          "dtype": a.dtype.str} for name, a in arrays.items()},
    }
    final = os.path.join(directory, step_dir_name(state.step))
    tmp = os.path.join(directory, f".{step_dir_name(state.step)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        _write_synced(os.path.join(tmp, _ARRAYS), blob)
        _write_synced(os.path.join(tmp, _MANIFEST),
                      (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
        _fsync_dir(tmp)
        old = None
        if os.path.exists(final):            # taken again (a resumed run): replace it whole
            old = os.path.join(directory, f".{step_dir_name(state.step)}.old-{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """Complete checkpoints under ``directory`` as (step, path), oldest first."""
    if not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(directory, name)):
            out.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(out)


def latest_checkpoint(directory: str) -> str | None:
    """The path of the newest checkpoint under ``directory`` (None if there is none)."""
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def _read_manifest(path: str) -> dict:
    mpath = os.path.join(path, _MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path}: no such directory; nothing to restore")
    if not os.path.isfile(mpath):
        raise CheckpointError(f"checkpoint {mpath}: file missing; {path} is not a complete "
                              f"checkpoint (nor a directory holding step-NNNNNNNN checkpoints)")
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {mpath}: not a readable JSON manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"checkpoint {mpath}: format {got!r}; expected {FORMAT!r}")
    return manifest


def _read_arrays(path: str, manifest: dict) -> dict[str, np.ndarray]:
    apath = os.path.join(path, _ARRAYS)
    try:
        with open(apath, "rb") as f:
            blob = f.read()
    except OSError as exc:
        raise CheckpointError(f"checkpoint {apath}: cannot be read ({exc.strerror})") from None
    expected = manifest.get("files", {}).get(_ARRAYS)
    actual = hashlib.sha256(blob).hexdigest()
    if actual != expected:
        raise CheckpointError(f"checkpoint {apath}: sha256 {actual} does not match the "
                              f"manifest's {expected}; the file is corrupt")
    try:
        with np.load(io.BytesIO(blob), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {apath}: not a readable .npz ({exc})") from None
    listed = manifest.get("arrays", {})
    if set(listed) != set(arrays):
        diff = sorted(set(listed) ^ set(arrays))
        raise CheckpointError(f"checkpoint {apath}: arrays {diff} differ from the manifest")
    for name, a in arrays.items():
        meta = listed[name]
        if list(a.shape) != meta["shape"] or a.dtype.str != meta["dtype"] \
                or _array_sha256(a) != meta["sha256"]:
            raise CheckpointError(f"checkpoint {apath}: array {name!r} does not match the "
                                  "manifest (shape, dtype or sha256)")
    return arrays


def load_checkpoint(path: str, fingerprint: dict | None = None) -> TrainingState:
    """Read and verify the checkpoint at ``path`` (a ``step-N`` directory, or a directory
    of checkpoints: its newest). ``fingerprint``: the current run's; it must match."""
    if not os.path.isfile(os.path.join(path, _MANIFEST)) and list_checkpoints(path):
        path = latest_checkpoint(path)
    manifest = _read_manifest(path)
    if fingerprint is not None and manifest.get("fingerprint") != fingerprint:
        saved = manifest.get("fingerprint") or {}
        keys = sorted(set(saved) | set(fingerprint))
        key = next(k for k in keys if saved.get(k) != fingerprint.get(k))
        raise CheckpointError(
            f"checkpoint {os.path.join(path, _MANIFEST)}: belongs to another run: "
            f"fingerprint.{key} is {saved.get(key)!r} there, {fingerprint.get(key)!r} now")
    arrays = _read_arrays(path, manifest)
    step, named = manifest.get("step"), _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    if step != len(arrays["losses"]) or (named and int(named.group(1)) != step):
        raise CheckpointError(f"checkpoint {os.path.join(path, _MANIFEST)}: step {step!r} "
                              f"disagrees with the directory name and the {len(arrays['losses'])} "
                              "losses recorded; the manifest was altered")
    n, slots = manifest["layers"], manifest["optimizer_slots"]
    params = tuple((arrays[f"param.{l}.w"], arrays[f"param.{l}.b"]) for l in range(n))
    opt = tuple(tuple((arrays[f"opt.{k}.{l}.w"], arrays[f"opt.{k}.{l}.b"]) for l in range(n))
                for k in range(slots))
    return TrainingState(step=manifest["step"], params=params,
                         optimizer_t=manifest["optimizer_t"], optimizer_slots=opt,
                         losses=arrays["losses"], data_position=manifest["data_position"],
                         rng_state=manifest["rng_state"], fingerprint=manifest["fingerprint"])
