"""The command line in the user's own terms (issue 56): ``vcluster --version`` answers,
and a mixture of experts with the GPT block is refused naming the flag the user typed."""

import subprocess
import sys

import pytest

from vcluster import __version__
from vcluster.cli.main import main

pytestmark = pytest.mark.timeout(120)


def test_version_prints_the_package_version():
    proc = subprocess.run([sys.executable, "-m", "vcluster", "--version"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"vcluster {__version__}"


SHAPE = ["--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "128", "--vocab",
         "1000", "--dp", "8", "--ep", "2", "--global-batch", "16"]


def test_experts_with_the_gpt_block_are_refused_by_flag(capsys):
    """The program's experts are SwiGLU: under the GPT block (GELU, 4h) they would be a
    model 1.5x its MLP that nobody trains, so --experts is refused with --arch gpt."""
    assert main(["simulate", "train", "--experts", "8", *SHAPE]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vcluster: error: --experts=8: ")
    assert "allowed: 0 with arch='gpt' (experts need a SwiGLU block: arch='llama')" in err
    # the Llama block takes them
    assert main(["simulate", "train", "--arch", "llama", "--kv-heads", "4", "--experts", "8",
                 *SHAPE]) == 0
    assert "8 experts, top-2, ep=2" in capsys.readouterr().out


def _flags_without_help(parser, path):
    """(command, flag) of every option of ``parser`` and its subcommands that has no help."""
    import argparse
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _flags_without_help(sub, path + [name])
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)) \
                and (not action.help or action.help == argparse.SUPPRESS):
            yield " ".join(path), "/".join(action.option_strings) or action.dest


def test_every_flag_of_every_command_has_help():
    from vcluster.cli.main import build_parser
    assert list(_flags_without_help(build_parser(), ["vcluster"])) == []
