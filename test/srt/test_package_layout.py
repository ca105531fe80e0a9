"""The serving plugin never imports the CPU harness (`sglang_oea.cpu`): a GPU server loads none of it.

SGLang's plugin loader loads and calls every entry point of its group in every server process, so
the harness's own entry point (sglang_oea.cpu_entry) is checked too: it imports the harness only
where the CPU stand-in `sgl_kernel` is the one a process would import.
"""

import ast
import json
import os
import pathlib
import subprocess
import sys

import sglang_oea
from sglang_oea.cpu import harness
from sglang_oea.cpu_entry import STUB_DIR

PACKAGE = pathlib.Path(sglang_oea.__file__).parent
ENTRY_MODULES = {"cpu_serve.py", "tiny_model.py"}  # thin command-line entries into the harness
PLUGIN_ENTRY = "cpu_entry.py"  # entry point `oea_cpu_harness`: imports the harness inside register() only

# Every entry point of this distribution in SGLang's plugin group, loaded and then called as
# sglang.srt.plugins.load_plugins does: first as on a GPU server (the stand-in not on sys.path),
# then with the stand-in first on sys.path, as cpu_serve's PYTHONPATH puts it (the harness
# entry point called again). The sglang_oea.cpu modules and HookRegistry's targets after each.
LOAD_ENTRY_POINTS = """
import importlib, importlib.metadata as md, json, sys
def seen():
    from sglang.srt.plugins.hook_registry import HookRegistry
    cpu = sorted(m for m in sys.modules if m == "sglang_oea.cpu" or m.startswith("sglang_oea.cpu."))
    return {"cpu_modules": cpu, "hook_targets": sorted(HookRegistry._hooks)}
eps = [ep for ep in md.distribution("sglang-oea").entry_points if ep.group == "sglang.srt.plugins"]
plugins = {ep.name: ep.load() for ep in eps}
for register in plugins.values():
    register()
gpu = seen()
sys.path.insert(0, sys.argv[1])
importlib.invalidate_caches()
plugins["oea_cpu_harness"]()
print(json.dumps({"entry_points": sorted(plugins), "gpu": gpu, "cpu": seen()}))
"""


def statements(tree: ast.AST, functions: bool = True):
    """Every node of `tree`; without the bodies of functions when functions=False (what runs at import)."""
    for node in ast.iter_child_nodes(tree):
        yield node
        if functions or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from statements(node, functions)


def imported_modules(path: pathlib.Path, functions: bool = True):
    """Every module name an import statement in `path` names (relative imports resolved); only
    those run at import time when functions=False."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(("sglang_oea",) + path.relative_to(PACKAGE).parent.parts)
    for node in statements(tree, functions):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def is_harness(name: str) -> bool:
    return name == "sglang_oea.cpu" or name.startswith("sglang_oea.cpu.")


def plugin_modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] != "cpu" and str(rel) not in ENTRY_MODULES | {PLUGIN_ENTRY}:
            yield path


def test_plugin_modules_do_not_import_the_cpu_harness():
    paths = list(plugin_modules())
    assert any(p.name == "plugin.py" for p in paths) and any(p.name == "oea_route.py" for p in paths)
    offenders = {
        str(p.relative_to(PACKAGE)): name
        for p in paths
        for name in imported_modules(p)
        if is_harness(name)
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


def test_the_harness_entry_point_imports_the_harness_only_when_called():
    entry = PACKAGE / PLUGIN_ENTRY
    assert "sglang_oea.cpu.harness" in set(imported_modules(entry)), "the scan sees register()'s import"
    assert not [name for name in imported_modules(entry, functions=False) if is_harness(name)]


def test_a_gpu_server_loading_every_entry_point_imports_no_harness_module():
    """SGLang loads every entry point of the group in every process (unless SGLANG_PLUGINS names
    some): without the stand-in on the path, as on a GPU server, no sglang_oea.cpu module is
    imported and no harness hook registered; with it, the harness registers its hooks."""
    # The installed distribution's own metadata and modules: no PYTHONPATH (it holds the stand-in).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SGLANG_USE_CPU_ENGINE", "SGLANG_PLUGINS")}
    result = subprocess.run([sys.executable, "-c", LOAD_ENTRY_POINTS, STUB_DIR], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["entry_points"] == ["oea", "oea_cpu_harness"], seen["entry_points"]
    assert seen["gpu"]["cpu_modules"] == [], "a GPU server imported the CPU harness"
    assert harness.PARALLEL_GROUP not in seen["gpu"]["hook_targets"]
    assert "sglang_oea.cpu.harness" in seen["cpu"]["cpu_modules"]
    assert {harness.PARALLEL_GROUP, harness.TORCH_NATIVE_EXTEND} <= set(seen["cpu"]["hook_targets"])
