"""The docs are tied to the code: the tag table to ``graph.tags.KEYS``, the list of commands to the
modules that have a ``__main__``, the README's length; and comments say what and why, not which
issue or when."""

from __future__ import annotations

import dataclasses
import os
import re

from graph_trainer.graph import tags
from tests.conftest import ROOT

README_MAX_LINES = 200
CODE_FOLDERS = ("graph_trainer", "models", "suites", "scripts", "tests", "benchmarks")
CODE_FILES = ("train.py", "integration_tests.py", "integration_dry_run.py", "integration_graph_checks.py")


def _read(*path: str) -> str:
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


def _block(text: str, tag: str) -> str:
    found = re.search(rf"<!-- {tag}: begin -->\n(.*?)<!-- {tag}: end -->", text, re.S)
    assert found, f"docs/architecture.md has no {tag} block"
    return found.group(1)


def tag_table() -> str:
    """``tags.KEYS`` as the markdown table docs/architecture.md shows."""
    rows = ["| key | written by | read by |", "|---|---|---|"]
    for doc in tags.KEYS:
        keys = ", ".join(f"`{key}`" for key in doc.keys)
        rows.append(f"| {keys} | {doc.written_by} | {doc.read_by} |")
    return "\n".join(rows) + "\n"


def _key_constants() -> set[str]:
    """The keys defined in graph/tags.py's keys section."""
    source = _read("graph_trainer", "graph", "tags.py")
    section = source[source.index("# --- keys") : source.index("# --- values")]
    return {value for name, value in re.findall(r'^([A-Z_]+) = "([a-z_]+)"$', section, re.M) if name != "CUSTOM"}


def test_the_tag_table_is_tags_keys():
    documented = [key for doc in tags.KEYS for key in doc.keys]
    assert len(documented) == len(set(documented)), "a key is documented twice"
    assert set(documented) == _key_constants()
    assert _block(_read("docs", "architecture.md"), "tags") == tag_table()


def _modules_with_main() -> list[str]:
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "graph_trainer")):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and 'if __name__ == "__main__":' in _read(path):
                module = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
                found.append(module)
    return sorted(found)


def test_the_commands_are_the_modules_with_a_main():
    listed = re.findall(r"^\| `python -m ([\w.]+)` \|", _block(_read("docs", "architecture.md"), "commands"), re.M)
    assert sorted(listed) == _modules_with_main()
    assert all(module.startswith("graph_trainer.cli.") for module in listed), "a command outside cli/"


def test_the_readme_is_short():
    lines = _read("README.md").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; at most {README_MAX_LINES}"


def _code_files() -> list[str]:
    paths = [os.path.join(ROOT, name) for name in CODE_FILES]
    for top in CODE_FOLDERS:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            paths += [os.path.join(folder, name) for name in files if name.endswith(".py")]
    return sorted(paths)


WHEN_OR_WHICH_ISSUE = re.compile(r"\b[Ii]ssue \d+|\b20\d\d-\d\d(-\d\d)?\b")
"""A comment or docstring that names an issue (the word and its number) or a date: the code's
history, which belongs in commit messages and docs/performance.md, not beside the code."""


def test_code_says_what_and_why_not_which_issue_or_when():
    found = []
    for path in _code_files():
        for number, line in enumerate(_read(path).splitlines(), 1):
            if WHEN_OR_WHICH_ISSUE.search(line):
                found.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def _setting(root, path: str):
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def test_the_torchtitan_table_names_settings_both_trainers_have():
    """Every setting in the first two columns of docs/architecture.md's torchtitan table is a field
    of ``torchtitan.trainer.Trainer.Config`` (0.3.0) and of our ``JobConfig``; the table is the map
    the configuration's refusals name ours from (``config_loading.TORCHTITAN_NAMES``), whose earlier
    torchtitan names each name a field of ours too."""
    from torchtitan.trainer import Trainer

    from graph_trainer.config import JobConfig
    from graph_trainer.config_loading import EARLIER_TORCHTITAN_NAMES, TORCHTITAN_NAMES

    table = _block(_read("docs", "architecture.md"), "torchtitan flags")
    rows = re.findall(r"^\| `([\w.]+)` \| `([\w.]+)` \|", table, re.M)
    assert len(rows) >= 30
    assert dict(rows) == TORCHTITAN_NAMES and len(rows) == len(TORCHTITAN_NAMES)
    for earlier, our_name in EARLIER_TORCHTITAN_NAMES.items():
        assert earlier not in TORCHTITAN_NAMES
        assert not dataclasses.is_dataclass(_setting(JobConfig(), our_name)), our_name
    theirs, ours = Trainer.Config(), JobConfig()
    for torchtitan_name, our_name in rows:
        _setting(theirs, torchtitan_name)  # AttributeError names a setting torchtitan does not have
        assert not dataclasses.is_dataclass(_setting(ours, our_name)), our_name
