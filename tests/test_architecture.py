"""The layers contract (pyproject.toml, checked by ``lint-imports`` in CI) covers every module, and
docs/architecture.md draws the same picture."""

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
}
"""Packages whose own module is empty of imports: they hold layers, they are not one."""


def _layers() -> list[str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        contracts = tomli.load(f)["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    return layers


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


def test_architecture_doc_shows_the_contract_layers():
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        text = f.read()
    block = re.search(r"<!-- layers: begin -->\n```\n(.*?)```\n<!-- layers: end -->", text, re.S)
    assert block, "docs/architecture.md has no layers block"
    drawn = [line.strip() for line in block.group(1).splitlines() if line.strip()]
    assert drawn == [layer.strip() for layer in _layers()]
