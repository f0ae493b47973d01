"""The tests' imports of each other's helpers resolve, also those inside tests that run only on a GPU machine (one
imported a helper that a refactor had renamed, and failed only there)."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

HERE = Path(__file__).parent
LOCAL = {p.stem for p in HERE.glob("*.py")}
IMPORTS = sorted({(node.module, alias.name, p.name)
                  for p in HERE.glob("*.py") for node in ast.walk(ast.parse(p.read_text()))
                  if isinstance(node, ast.ImportFrom) and node.module in LOCAL for alias in node.names})


@pytest.mark.parametrize(("module", "name", "importer"), IMPORTS)
def test_a_tests_import_of_another_test_modules_name_resolves(module, name, importer):
    assert hasattr(importlib.import_module(module), name), f"{importer}: {module} has no {name}"
