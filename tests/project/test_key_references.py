"""Where the scenario's ``microbatches`` and ``schedule`` keys are read (issue 25: "at most
10 files outside tests/ and docs/ reference them, by AST").

A file *references a key* when it uses the key's name as a mapping key: a subscript
(``par["schedule"]``), a key of a dict display (``{"microbatches": ...}``) or the first
argument of a mapping's ``get``/``pop``/``setdefault``. The same words as the names of
the library's parameters, fields and flags (``MLP.fit(microbatches=)``,
``Schedule.microbatches``, ``ParallelConfig.schedule``, ``vcluster schedule``, the
``--microbatches`` flag, an error's label) are not references to the keys: each layer
names its own arguments. The count covers every Python file of the project's packages,
benchmarks and scripts."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = ("vcluster", "mesh", "sharding", "pipelining", "tensor_parallel", "pipeline_parallel",
         "reports", "benchmarks", "scripts")
KEYS = ("microbatches", "schedule")
MAPPING_METHODS = ("get", "pop", "setdefault")


def key_uses(tree: ast.AST, key: str) -> int:
    """How many times ``key`` is used as a mapping key in ``tree`` (module docstring)."""
    def is_key(node) -> bool:
        return isinstance(node, ast.Constant) and node.value == key
    uses = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_key(node.slice):
            uses += 1
        elif isinstance(node, ast.Dict):
            uses += sum(is_key(k) for k in node.keys if k is not None)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in MAPPING_METHODS and node.args and is_key(node.args[0]):
            uses += 1
    return uses


def files_referencing(key: str) -> list[str]:
    out = []
    for top in TREES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if key_uses(ast.parse(path.read_text()), key):
                out.append(str(path.relative_to(ROOT)))
    return out


def test_the_counter_sees_every_form_and_nothing_else():
    tree = ast.parse('a["schedule"]; {"schedule": 1}; d.get("schedule"); d.pop("schedule", 0)\n'
                     'f(schedule=1); x.schedule; g("schedule"); ("schedule", 2)\n'
                     'def h(schedule): pass')
    assert key_uses(tree, "schedule") == 4


def test_at_most_ten_files_reference_the_keys():
    files = sorted(set(files_referencing("microbatches")) | set(files_referencing("schedule")))
    assert 0 < len(files) <= 10, files
    # the scenario package reads them in its parser, its model and the two workloads
    # that take a pipeline; the rest name the plan table's columns of the same names
    scenario = [f for f in files if f.startswith("vcluster/scenario/")]
    assert scenario == ["vcluster/scenario/model.py", "vcluster/scenario/schema.py",
                        "vcluster/scenario/workloads/mlp.py",
                        "vcluster/scenario/workloads/transformer.py"], scenario
