"""The serving plugin never imports the CPU harness (`sglang_oea.cpu`): a GPU server loads none of it."""

import ast
import pathlib

import sglang_oea

PACKAGE = pathlib.Path(sglang_oea.__file__).parent
ENTRY_MODULES = {"cpu_serve.py", "tiny_model.py"}  # thin command-line entries into the harness


def imported_modules(path: pathlib.Path):
    """Every module name an import statement in `path` names (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(("sglang_oea",) + path.relative_to(PACKAGE).parent.parts)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def plugin_modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] != "cpu" and str(rel) not in ENTRY_MODULES:
            yield path


def test_plugin_modules_do_not_import_the_cpu_harness():
    paths = list(plugin_modules())
    assert any(p.name == "plugin.py" for p in paths) and any(p.name == "oea_route.py" for p in paths)
    offenders = {
        str(p.relative_to(PACKAGE)): name
        for p in paths
        for name in imported_modules(p)
        if name == "sglang_oea.cpu" or name.startswith("sglang_oea.cpu.")
    }
    assert not offenders, f"plugin modules import the CPU harness: {offenders}"


def test_import_scan_sees_a_harness_import():
    # The scan itself: a module written like the entry points is caught.
    probe = PACKAGE / "cpu_serve.py"
    assert "sglang_oea.cpu.serve" in set(imported_modules(probe))


def test_entry_modules_are_thin():
    for name in ENTRY_MODULES:
        code = (PACKAGE / name).read_text()
        assert len(code.splitlines()) <= 8, f"{name} should only hand over to sglang_oea.cpu"
