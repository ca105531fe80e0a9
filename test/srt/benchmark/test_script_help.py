"""The scripts' --help shows their usage examples as written: a module docstring whose example
command continues over lines with a trailing backslash must be a raw string, or Python joins the
lines and argparse prints one mangled line (the scripts pass __doc__ to argparse as is)."""

import ast
import pathlib

BENCH = pathlib.Path(__file__).resolve().parents[3] / "benchmark" / "oea"


def docstrings():
    """(path, source text of the module docstring, its value) of every script under benchmark/oea."""
    for path in sorted(BENCH.rglob("*.py")):
        source = path.read_text()
        first = ast.parse(source).body[:1]
        if first and isinstance(first[0], ast.Expr) and isinstance(first[0].value, ast.Constant):
            yield path, ast.get_source_segment(source, first[0]), first[0].value.value


def test_scripts_are_found():
    assert any(path.name == "trial.py" for path, _, _ in docstrings())


def test_continued_example_lines_survive_in_the_docstring():
    mangled = [str(path.relative_to(BENCH)) for path, source, value in docstrings()
               if " \\\n" in source and " \\\n" not in value]
    assert not mangled, f"make these module docstrings raw (r\"\"\"): {mangled}"
