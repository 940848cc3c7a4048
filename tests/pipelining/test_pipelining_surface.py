"""Tests for pipelining's user-facing surface: the schedule grid (text and HTML), size
errors, ``Pipeline`` on a mesh, and the ``vcluster schedule`` command."""

import pytest

import pipelining as pl
from mesh import Mesh
from pipelining import (Pipeline, Schedule, format_grid, gpipe, interleaved_1f1b, make_schedule,
                        one_f_one_b, zero_bubble)
from vcluster.cli.schedule_cmd import add_parser

from tests.cli_helpers import run_cli
from tests.pipelining.test_pipelining import FLAT_CASES


# ------------------------------------------------------------------ grid
def test_grid_text():
    s = one_f_one_b(2, 2)
    expected = "\n".join([
        "step  rank 0  rank 1",
        "   0  0F0     .",
        "   1  0F1     1F0",
        "   2  .       1B0",
        "   3  0B0     1F1",
        "   4  .       1B1",
        "   5  0B1     .",
    ])
    assert format_grid(s) == s.grid() == str(s) == expected
    assert format_grid(s, empty="-").splitlines()[1] == "   0  0F0     -"


@pytest.mark.parametrize("name,p,m", FLAT_CASES[::3])
def test_grid_cells_hold_every_action_once(name, p, m):
    s = make_schedule(name, p, m)
    cells = pl.grid_cells(s)
    placed = [a for row in cells for a in row if a is not None]
    assert sorted(map(str, placed)) == sorted(str(a) for row in s for a in row)
    assert all(any(row) for row in cells)  # as-soon-as-possible: no all-idle step
    assert len(cells) == max(step for row in pl.unit_timelines(s) for _, step in row) + 1


def test_html_grid():
    s = zero_bubble(2, 2)
    html = s._repr_html_()
    assert html.startswith("<table") and html.count("<tr>") == 1 + len(pl.grid_cells(s))
    assert "0W1" in html and "rank 1" in html


def test_schedule_shape_errors_and_repr():
    s = gpipe(2, 3)
    assert repr(s) == ("Schedule(name='gpipe', ranks=2, microbatches=3, virtual_stages=1, "
                       "actions=<12 actions on 2 ranks>)")
    with pytest.raises(ValueError, match=r"rank 2 is out of range; valid ranks are 0..1"):
        s[2]
    with pytest.raises(ValueError, match=r"stage 2 is out of range; valid stages are 0..1"):
        s.rank_of(2)
    with pytest.raises(ValueError, match=r"2 lists for ranks=2; got 1"):
        Schedule("x", 2, 1, 1, [()])
    with pytest.raises(TypeError, match=r"actions\[0\]\[0\] must be an Action"):
        Schedule("x", 1, 1, 1, [["0F0"]])
    with pytest.raises(ValueError, match="Schedule: microbatches must be an int >= 1"):
        Schedule("x", 1, 0, 1, [()])


# ------------------------------------------------------------------ errors
def test_interleaved_needs_m_multiple_of_p():
    with pytest.raises(ValueError, match=r"microbatches m=6 must be a multiple of ranks p=4.*"
                                         r"m mod p = 2.*try m = 4 or 8"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match=r"m=3 must be a multiple of ranks p=4.*try m = 4"):
        make_schedule("interleaved_1f1b", 4, 3, 3)
    with pytest.raises(ValueError, match=r"virtual_stages v must be an int >= 1, got 0"):
        interleaved_1f1b(2, 2, 0)


def test_unknown_schedule_name_lists_names():
    with pytest.raises(ValueError, match=r"unknown schedule 'pipedream'; choose from gpipe, "
                                         r"1f1b, interleaved_1f1b, zero_bubble"):
        make_schedule("pipedream", 2, 2)
    assert pl.SCHEDULE_NAMES == ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


@pytest.mark.parametrize("name", pl.SCHEDULE_NAMES)
def test_bad_sizes(name):
    with pytest.raises(ValueError, match=r"ranks p must be an int >= 1, got 0"):
        make_schedule(name, 0, 4)
    with pytest.raises(ValueError, match=r"microbatches m must be an int >= 1, got 0"):
        make_schedule(name, 2, 0)
    with pytest.raises(TypeError, match=r"ranks p must be an int >= 1, got 2.5"):
        make_schedule(name, 2.5, 4)
    if name != "interleaved_1f1b":
        with pytest.raises(ValueError, match=r"virtual_stages must be 1.*got 2"):
            make_schedule(name, 2, 2, virtual_stages=2)
        assert make_schedule(name, 2, 2, virtual_stages=1).virtual_stages == 1


# ------------------------------------------------------------------ Pipeline
def test_pipeline_on_a_mesh():
    mesh = Mesh((2, 4), ("dp", "pp"))
    pipe = Pipeline(mesh, "pp", stages=8, microbatches=8, schedule="interleaved_1f1b")
    assert (pipe.ranks, pipe.virtual_stages, pipe.stages, pipe.microbatches) == (4, 2, 8, 8)
    assert pipe.schedule == interleaved_1f1b(4, 8, 2)
    assert pipe.stages_of(1) == (pl.PipelineStage(1, 1, 0, False, False),
                                 pl.PipelineStage(5, 1, 1, False, False))
    assert pipe.stage(0).is_first and pipe.stage(7).is_last and not pipe.stage(3).is_last
    assert pipe.rank_groups == mesh.groups("pp") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert pipe.group_of(6) == (4, 5, 6, 7) and pipe.position_of(6) == 2
    assert pipe.actions_of(6) == pipe.schedule[2]
    assert [st_.index for st_ in pipe.stages_on(5)] == [1, 5]
    assert pipe.rank_of_stage(7, 1) == 3 and pipe.rank_of_stage(7, 4) == 7
    assert len(pipe.all_stages) == 8
    assert "schedule='interleaved_1f1b'" in repr(pipe)


def test_pipeline_defaults_and_schedule_objects():
    mesh = Mesh((3,), ("pp",))
    assert Pipeline(mesh, microbatches=4).schedule == one_f_one_b(3, 4)
    assert Pipeline(mesh, microbatches=3, schedule="interleaved_1f1b").stages == 6
    z = zero_bubble(3, 5)
    assert Pipeline(mesh, schedule=z).schedule is z


def test_pipeline_errors():
    mesh = Mesh((2, 4), ("dp", "pp"))
    with pytest.raises(ValueError, match=r"stages=6 must be a multiple of p=4"):
        Pipeline(mesh, "pp", stages=6, microbatches=4, schedule="interleaved_1f1b")
    with pytest.raises(ValueError, match=r"'gpipe' runs one stage per rank.*stages=8.*v=2"):
        Pipeline(mesh, "pp", stages=8, microbatches=4, schedule="gpipe")
    with pytest.raises(ValueError, match=r"ranks=2 but mesh axis 'pp' has size p=4"):
        Pipeline(mesh, "pp", schedule=gpipe(2, 2))
    with pytest.raises(ValueError, match=r"axis 'tp' is not one of the mesh's axes"):
        Pipeline(mesh, "tp", microbatches=2)
    with pytest.raises(TypeError, match="microbatches is required"):
        Pipeline(mesh, "pp")
    with pytest.raises(ValueError, match="unknown schedule 'x'"):
        Pipeline(mesh, "pp", microbatches=2, schedule="x")
    with pytest.raises(TypeError, match="mesh must be a mesh.Mesh"):
        Pipeline((2, 4), "pp", microbatches=2)


# ------------------------------------------------------------------ CLI
def _cli(argv):
    return run_cli(add_parser, argv)


def test_cli_prints_grid_and_bubble(capsys):
    assert _cli(["schedule", "1f1b", "--ranks", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert format_grid(one_f_one_b(4, 8)) in out
    assert "bubble fraction (simulated)    0.2727" in out
    assert "bubble fraction (closed form)  0.2727  (p-1)/(m+p-1)" in out


@pytest.mark.parametrize("argv,has_closed_form", [
    (["schedule", "gpipe", "-p", "2", "-m", "3"], True),
    (["schedule", "interleaved_1f1b", "--ranks", "2", "--microbatches", "4",
      "--virtual-stages", "3", "--costs", "1,3,1"], True),
    (["schedule", "zero_bubble", "--ranks", "3", "--microbatches", "6", "--costs", "2,3,1"], True),
    (["schedule", "zero_bubble", "--ranks", "3", "--microbatches", "2"], False),
])
def test_cli_every_schedule(argv, has_closed_form, capsys):
    assert _cli(argv) == 0
    out = capsys.readouterr().out
    assert "step  rank 0" in out and "bubble fraction (simulated)" in out
    sim = out.split("bubble fraction (simulated)")[1].split()[0]
    closed = out.split("bubble fraction (closed form)")[1].split()[0]
    assert closed == (sim if has_closed_form else "n/a")


@pytest.mark.parametrize("argv", [
    ["schedule", "pipedream"],
    ["schedule", "1f1b", "--ranks", "0"],
    ["schedule", "1f1b", "--costs", "1,1,1"],
    ["schedule", "1f1b", "--costs", "1,2"],
])
def test_cli_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        _cli(argv)
    assert info.value.code == 2


def test_cli_bad_sizes_raise_value_error():
    with pytest.raises(ValueError, match=r"m=6 must be a multiple of ranks p=4"):
        _cli(["schedule", "interleaved_1f1b", "--ranks", "4", "--microbatches", "6"])
    with pytest.raises(ValueError, match=r"virtual_stages must be 1"):
        _cli(["schedule", "gpipe", "--virtual-stages", "2"])


def test_the_vcluster_command_as_users_type_it():
    """`vcluster schedule 1f1b --ranks 4 --microbatches 8` through the real entry point."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    for argv in (["1f1b"], ["interleaved_1f1b", "--virtual-stages", "2"]):
        proc = subprocess.run([sys.executable, "-m", "vcluster", "schedule", *argv, "--ranks",
                               "4", "--microbatches", "8"], capture_output=True, text=True,
                              timeout=60, env=env)
        assert proc.returncode == 0, proc.stderr
        assert "3B0" in proc.stdout and "bubble fraction (simulated)" in proc.stdout
