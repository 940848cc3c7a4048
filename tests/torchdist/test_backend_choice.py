"""The torch engine's backend choice (issue 27: one GPU, many ranks).

NCCL refuses two ranks on one GPU, so ``auto`` picks NCCL only when every rank can have
its own GPU and says once, in one line, when it falls back to gloo although GPUs are
present; ``nccl`` with too few GPUs fails on the host before any process starts. The
rule is a pure function of (backend, ranks, GPUs), tested here directly; the host's GPU
count is faked by patching ``torch.cuda`` in this process only (the ranks, in their own
processes, are real gloo ranks that receive the host's choice).
"""

import importlib.util
import time
import warnings

import numpy as np
import pytest

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="torch is not installed"),
              pytest.mark.timeout(300)]

from mesh import Mesh  # noqa: E402
from vcluster.torchdist import (TorchCluster, backend_choice, choose_backend,  # noqa: E402
                                visible_gpus)


@pytest.fixture
def fake_gpus(monkeypatch):
    """``fake_gpus(n)``: this process sees n CUDA devices (0: CUDA is not available)."""
    import torch

    def fake(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return fake


@pytest.fixture
def no_process(monkeypatch):
    """Starting any process from the TorchCluster module fails the test."""
    import vcluster.torchdist.cluster as cluster_module

    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[0] if args else kwargs}")
    monkeypatch.setattr(cluster_module.subprocess, "Popen", refuse)


@pytest.mark.parametrize("backend, ranks, gpus, expected", [
    ("auto", 8, 8, "nccl"), ("auto", 8, 16, "nccl"), ("auto", 1, 1, "nccl"),
    ("auto", 8, 1, "gloo"), ("auto", 8, 7, "gloo"), ("auto", 8, 0, "gloo"),
    ("auto", None, 1, "nccl"), ("auto", None, 0, "gloo"),
    ("nccl", 8, 8, "nccl"), ("nccl", None, 1, "nccl"),
    ("gloo", 8, 8, "gloo"), ("gloo", 8, 0, "gloo"), ("gloo", None, 1, "gloo"),
])
def test_the_rule(backend, ranks, gpus, expected):
    """auto: NCCL when every rank can have its own GPU, else gloo; None ranks: this
    process alone (torchrun: one local GPU per rank)."""
    assert choose_backend(backend, ranks, gpus) == expected
    assert backend_choice(backend, ranks, gpus)[0] == expected


def test_auto_says_why_only_when_gpus_are_too_few():
    """One line naming ranks and GPUs when GPUs are present but too few; nothing when
    there is no CUDA at all (unremarkable) or when NCCL was chosen."""
    _, note = backend_choice("auto", 8, 1)
    assert note is not None and "\n" not in note
    for part in ("chose gloo", "8 ranks", "1 GPU,", "one GPU per rank", "backend='gloo'",
                 "at most 1 devices"):
        assert part in note, (part, note)
    assert "2 GPUs" in backend_choice("auto", 4, 2)[1]
    assert backend_choice("auto", 8, 0) == ("gloo", None)
    assert backend_choice("auto", 8, 8) == ("nccl", None)
    assert backend_choice("gloo", 8, 1) == ("gloo", None)


def test_nccl_with_too_few_gpus_names_ranks_gpus_and_the_fix():
    with pytest.raises(ValueError) as err:
        choose_backend("nccl", 8, 1)
    text = str(err.value)
    for part in ("backend='nccl'", "one GPU per rank", "8 ranks", "1 GPU;", "backend='gloo'",
                 "'auto'", "a mesh of at most 1 devices"):
        assert part in text, (part, text)
    with pytest.raises(ValueError, match=r"8 ranks, no GPU \(CUDA is not available\); "
                                         r"use backend='gloo' or 'auto'$"):
        choose_backend("nccl", 8, 0)
    with pytest.raises(ValueError, match=r"this rank, no GPU"):
        choose_backend("nccl", None, 0)


@pytest.mark.parametrize("args, message", [
    (("mpi", 8, 1), r"backend must be auto, gloo or nccl, got 'mpi'"),
    (("auto", 0, 1), r"world_size must be a positive int or None, got 0"),
    (("auto", 2.0, 1), r"world_size must be a positive int or None, got 2.0"),
    (("auto", 8, -1), r"gpu_count must be an int >= 0 or None, got -1"),
    (("gloo", 8, True), r"gpu_count must be an int >= 0 or None, got True"),
])
def test_bad_arguments_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        choose_backend(*args)


def test_the_gpu_count_comes_from_torch_cuda(fake_gpus):
    """gpu_count=None asks torch.cuda: its device count, 0 when CUDA is not available;
    the one-argument form keeps working."""
    fake_gpus(1)
    assert visible_gpus() == 1
    assert choose_backend("auto", 8) == "gloo" and choose_backend("auto", 1) == "nccl"
    assert choose_backend("auto") == "nccl" and choose_backend("nccl") == "nccl"
    fake_gpus(0)
    assert visible_gpus() == 0
    assert choose_backend() == "gloo" and choose_backend("gloo") == "gloo"
    with pytest.raises(ValueError, match="no GPU"):
        choose_backend("nccl")


@pytest.mark.parametrize("gpus, expected", [
    (1, (r"^TorchCluster: backend='nccl' needs one GPU per rank: 8 ranks, 1 GPU; use "
         r"backend='gloo' or 'auto', or a mesh of at most 1 devices$")),
    (4, r"8 ranks, 4 GPUs; .* a mesh of at most 4 devices$"),
    (0, (r"^TorchCluster: backend='nccl' needs one GPU per rank: 8 ranks, no GPU \(CUDA is "
         r"not available\); use backend='gloo' or 'auto'$")),
])
@pytest.mark.alone   # fails within 2 s of wall clock
def test_nccl_fails_fast_on_the_host(fake_gpus, no_process, gpus, expected):
    """No process is started (Popen refuses) and the error comes at once."""
    import torch  # noqa: F401  (imported before the clock starts)
    fake_gpus(gpus)
    start = time.monotonic()
    with pytest.raises(ValueError, match=expected):
        TorchCluster(Mesh((2, 4), ("dp", "tp")), backend="nccl")
    assert time.monotonic() - start < 2.0


def test_auto_on_one_gpu_runs_gloo_ranks_and_warns_once(fake_gpus, monkeypatch):
    """8 ranks, 1 (faked) GPU: the host chooses gloo, warns in one line, and the real gloo
    ranks it starts use it; a second cluster from the same line warns no more."""
    fake_gpus(1)
    mesh = Mesh((2, 4), ("dp", "tp"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        monkeypatch.delitem(globals(), "__warningregistry__", raising=False)
        for _ in range(2):
            with TorchCluster(mesh, timeout_s=60.0) as cluster:
                assert cluster.backend == "gloo" and cluster.info["torch_backend"] == "gloo"
                sums = cluster.run(lambda dev: dev.all_reduce(np.ones(2), None))
                assert [s.tolist() for s in sums] == [[8.0, 8.0]] * 8
    notes = [w for w in caught if "chose gloo" in str(w.message)]
    assert len(notes) == 1, [str(w.message) for w in caught]
    text = str(notes[0].message)
    assert notes[0].category is UserWarning and notes[0].filename == __file__
    assert text.startswith("TorchCluster: backend 'auto' chose gloo") and "\n" not in text
    assert "8 ranks" in text and "1 GPU" in text


def test_gloo_never_counts_gpus(monkeypatch):
    """backend='gloo' decides without asking torch.cuda (the start is skipped here)."""
    import torch

    def ask():
        raise AssertionError("torch.cuda was asked")
    monkeypatch.setattr(torch.cuda, "is_available", ask)
    monkeypatch.setattr(torch.cuda, "device_count", ask)
    monkeypatch.setattr(TorchCluster, "_start", lambda self: None)
    assert choose_backend("gloo", 8) == "gloo"
    assert TorchCluster(Mesh((2,), ("x",)), backend="gloo").backend == "gloo"


def test_bench_collectives_says_once_why_gloo(fake_gpus, capsys):
    """``vcluster bench collectives --engine torch`` on 8 devices and one (faked) GPU:
    gloo ranks, and exactly one line saying why."""
    from vcluster.cli.main import main
    fake_gpus(1)
    code = main(["bench", "collectives", "--engine", "torch", "--devices", "8",
                 "--sizes", "8B", "--ops", "all_reduce", "--paths", "copy", "--reps", "2"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    lines = [line for line in (out + err).splitlines() if "gloo" in line and "GPU" in line]
    assert len(lines) == 1, out + err
    assert lines[0].startswith("torch engine: backend 'auto' chose gloo (CPU tensors), not "
                               "NCCL: 8 ranks, 1 GPU"), lines[0]
    assert "(gloo), same sizes:" in out


def test_bench_collectives_says_nothing_without_cuda_or_with_enough_gpus(fake_gpus, capsys):
    """No CUDA at all: gloo, and no line about it; a GPU per rank: NCCL, silently (the
    command's side only, up to the choice)."""
    from vcluster.cli.bench_cmd import _torch_backend
    fake_gpus(0)
    assert _torch_backend(8) == "gloo"
    fake_gpus(8)
    assert _torch_backend(8) == "nccl"
    assert capsys.readouterr().out == ""
