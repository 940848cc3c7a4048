"""Reading a scenario: YAML -> ``--set`` overrides -> schema -> model -> cross-field rules.

Every sweep point is built and checked here too, so a bad point fails before anything
runs. ``--set key.path=value`` parses ``value`` as YAML (``--set parallel.tp=4``,
``--set run.check=true``, ``--set workload.sizes=[8,16,8]``).
"""

from __future__ import annotations

from pathlib import Path

from .errors import ScenarioError
from .model import Scenario, set_path
from .schema import check_document
from .semantics import check_semantics

__all__ = ["load_scenario", "parse_override", "scenario_from_dict", "sweep_points"]


def _yaml_load(text: str):
    """``yaml.safe_load`` that also reads ``1e-4`` as a number (YAML 1.2 floats; PyYAML's
    1.1 rules need a dot, ``1.0e-4``)."""
    import re
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"))
    return yaml.load(text, Loader=Loader)


def parse_override(text: str) -> tuple[str, object]:
    """``"a.b=value"`` -> ``("a.b", yaml(value))``."""
    import yaml
    key, sep, raw = str(text).partition("=")
    key = key.strip()
    if not sep or not key or not all(p.isidentifier() for p in key.split(".")):
        raise ScenarioError("--set", text, "KEY.PATH=VALUE, e.g. parallel.tp=4",
                            "not a key path and a value")
    try:
        value = _yaml_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ScenarioError(f"--set {key}", raw, "a YAML value (number, text, true/false, "
                            "[list], {mapping})", f"not valid YAML: {exc}") from None
    return key, value


def _read(path: Path) -> dict:
    import yaml
    if not path.is_file():
        raise ScenarioError("FILE", str(path), "an existing scenario YAML file", "no such file")
    try:
        document = _yaml_load(path.read_text("utf-8"))
    except yaml.YAMLError as exc:
        raise ScenarioError("<root>", str(path), "a YAML mapping", f"not valid YAML: {exc}") \
            from None
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise ScenarioError("<root>", document, "a YAML mapping of sections "
                            "(workload, cluster, parallel, run, ...)", "not a mapping")
    return document


def _point_error(exc: ScenarioError, values: dict) -> ScenarioError:
    point = ", ".join(f"{k}={v!r}" for k, v in values.items())
    return ScenarioError(exc.path, exc.value, exc.allowed,
                         f"{exc.reason} (sweep point {point})".strip())


def sweep_points(scenario: Scenario) -> list[tuple[dict, Scenario]]:
    """``[({path: value}, the point's Scenario)]``; one point without a sweep."""
    out = []
    for values, doc in scenario.point_documents():
        try:
            check_document(doc)
            point = Scenario.from_document(doc, scenario.name, scenario.base_dir)
            check_semantics(point)
        except ScenarioError as exc:
            raise (_point_error(exc, values) if values else exc) from None
        out.append((values, point))
    return out


def scenario_from_dict(document: dict, name: str = "scenario", overrides=(),
                       base_dir: str = ".") -> Scenario:
    """A validated :class:`Scenario` from a plain mapping (see :func:`load_scenario`)."""
    import copy
    document = copy.deepcopy(document)
    for item in overrides:
        key, value = parse_override(item) if isinstance(item, str) else item
        set_path(document, key, value)
    check_document(document)
    scenario = Scenario.from_document(document, name, base_dir)
    sweep_points(scenario)           # every point checked (schema and cross-field rules)
    return scenario


def load_scenario(path, overrides=()) -> Scenario:
    """Read, override, validate: a :class:`Scenario`, or :class:`ScenarioError` naming
    the file, the key path, the value and what is allowed."""
    path = Path(path)
    try:
        return scenario_from_dict(_read(path), path.stem, overrides,
                                  str(path.parent.resolve()))
    except ScenarioError as exc:
        raise exc.in_file(str(path)) from None
