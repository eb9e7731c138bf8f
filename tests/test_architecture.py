"""The layers contracts (pyproject.toml, checked by ``lint-imports`` in CI) cover every module and
every folder, and docs/architecture.md draws the same picture."""

import ast
import os
import re

import tomli

from tests.conftest import ROOT

CONTAINERS = {
    "graph_trainer",
    "graph_trainer.checkpoint",
    "graph_trainer.cli",
    "graph_trainer.compiler",
    "graph_trainer.data",
    "graph_trainer.distributed",
    "graph_trainer.loop",
    "models",
    "models.llama3",
    "models.deepseek_v3",
    "models.qwen3",
}
"""Packages whose own module is empty of imports: they hold layers, they are not one."""


def _contracts() -> list[dict]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomli.load(f)["tool"]["importlinter"]["contracts"]


def _layers() -> list[str]:
    """The main layers contract: the one without containers."""
    (layers,) = [c["layers"] for c in _contracts() if c["type"] == "layers" and "containers" not in c]
    return layers


def _folder_contracts() -> dict[str, list[str]]:
    """Each folder's own layers contract: container -> its layers, highest first."""
    found = {}
    for c in _contracts():
        if c["type"] == "layers" and "containers" in c:
            (container,) = c["containers"]
            assert container not in found, f"{container} has two layers contracts"
            assert c.get("exhaustive"), f"the contract of {container} must be exhaustive"
            found[container] = c["layers"]
    return found


def _doc_block(tag: str) -> list[str]:
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        text = f.read()
    block = re.search(rf"<!-- {tag}: begin -->\n```\n(.*?)```\n<!-- {tag}: end -->", text, re.S)
    assert block, f"docs/architecture.md has no {tag} block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def _modules() -> list[str]:
    found = []
    for package in ("graph_trainer", "models"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.relpath(os.path.join(folder, name), ROOT)[: -len(".py")]
                    found.append(path.replace(os.sep, ".").removesuffix(".__init__"))
    return sorted(found)


def test_every_module_is_in_exactly_one_layer():
    listed = [m.strip() for layer in _layers() for m in re.split(r"[|:]", layer)]
    assert len(listed) == len(set(listed))
    for module in _modules():
        if module in CONTAINERS:
            continue
        owners = [m for m in listed if module == m or module.startswith(m + ".")]
        assert len(owners) == 1, f"{module} is in {len(owners)} layers of pyproject.toml: {owners}"


def test_containers_import_nothing():
    for package in CONTAINERS:
        path = os.path.join(ROOT, *package.split("."), "__init__.py")
        with open(path) as f:
            assert not re.search(r"^\s*(import|from)\s", f.read(), re.M), f"{path} imports something"


def test_every_folder_orders_its_modules():
    """Every package of graph_trainer below the top has a layers contract of its own."""
    packages = {
        m for m in _modules() if m.startswith("graph_trainer.") and os.path.isdir(os.path.join(ROOT, *m.split(".")))
    }
    assert set(_folder_contracts()) == packages


def test_architecture_doc_shows_the_contract_layers():
    assert _doc_block("layers") == [layer.strip() for layer in _layers()]
    drawn = [f"{container}: {' > '.join(layers)}" for container, layers in _folder_contracts().items()]
    assert _doc_block("folders") == drawn


MAX_FUNCTION_LINES = 80
"""A function fits on a screen: from its ``def`` line to its last, docstring included."""
FUNCTION_LIMIT_SOURCES = ("graph_trainer", "models", "suites", "scripts", "train.py", "integration_tests.py")
FUNCTION_LIMIT_SOURCES += ("integration_dry_run.py", "integration_graph_checks.py")


def _python_files(*names: str) -> list[str]:
    paths = []
    for name in names:
        path = os.path.join(ROOT, name)
        if os.path.isfile(path):
            paths.append(path)
        for folder, _, files in os.walk(path):
            paths += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    return sorted(paths)


def test_no_function_is_longer_than_a_screen():
    long = []
    for path in _python_files(*FUNCTION_LIMIT_SOURCES):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


MAX_MODULE_LINES = 500
"""A module is read in one sitting; a longer one holds more than one concern."""


def test_no_module_is_longer_than_a_sitting():
    long = []
    for path in _python_files(*FUNCTION_LIMIT_SOURCES, "benchmarks"):
        with open(path, encoding="utf-8") as f:
            lines = sum(1 for _ in f)
        if lines > MAX_MODULE_LINES:
            long.append(f"{os.path.relpath(path, ROOT)}: {lines} lines")
    assert not long, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(long)
