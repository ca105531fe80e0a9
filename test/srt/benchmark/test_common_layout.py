"""benchmark/oea/common/ is what the purpose folders share: its modules import from common/ and
the standard library or third-party packages only, never from a purpose folder (the arrows run
from serving/, studies/, gpu/, ... into common/, not back)."""

import ast
import pathlib

BENCH = pathlib.Path(__file__).resolve().parents[3] / "benchmark" / "oea"
PURPOSE_FOLDERS = {p.name for p in BENCH.iterdir() if p.is_dir() and (p / "__init__.py").exists()} - {"common"}


def imported_roots(path: pathlib.Path):
    """The top-level package of every module `path` imports (absolute imports)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


def test_purpose_folders_are_found():
    assert {"serving", "studies", "gpu"} <= PURPOSE_FOLDERS


def test_common_imports_no_purpose_folder():
    back = {f"{path.name} imports {root}" for path in (BENCH / "common").glob("*.py")
            for root in imported_roots(path) if root in PURPOSE_FOLDERS}
    assert not back, sorted(back)
