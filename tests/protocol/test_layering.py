"""protocol/ sits at the bottom of the import graph: no other neuroshard package, no web framework."""

import ast
from pathlib import Path

import pytest

PROTOCOL = Path(__file__).resolve().parents[2] / "protocol"
FORBIDDEN = ("aiohttp", "fastapi", "starlette", "boto3", "sqlalchemy", "torch")


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


@pytest.mark.parametrize("path", sorted(PROTOCOL.glob("*.py")), ids=lambda p: p.name)
def test_protocol_imports_nothing_above_it(path: Path) -> None:
    for name in _imports(path):
        top = name.split(".")[0]
        assert top not in FORBIDDEN, f"{path.name} imports {name}"
        assert not (top == "neuroshard" and not name.startswith("neuroshard.protocol")), (
            f"{path.name} imports {name}: protocol must not depend on another neuroshard package"
        )
