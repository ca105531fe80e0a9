"""The wheel built from python/ installs into an environment that already has SGLang, and SGLang
loads the plugin from it (README, "Install").

Which environment. The case to test is "an existing environment with sglang==0.5.23 and no
sglang_oea". The test venv (.venv) has SGLang, but also the editable install of sglang_oea, which
lives in its site-packages as three entries: an `__editable__.sglang_oea-*.pth` file, the finder
module it imports, and a `sglang_oea-*.dist-info` whose entry point SGLang's plugin loader finds
(importlib.metadata scans every sys.path entry). Two obvious routes fail:
- `python -m venv --system-site-packages` run with the test venv's python builds on the *base*
  interpreter (venv uses sys._base_executable), so the new env sees the base site-packages, which
  has no SGLang, and not the test venv's;
- a .pth file that adds the test venv's site-packages as a whole brings the editable install
  along: its .pth is not processed there, but its dist-info and entry point are.
So the new env is made from the base interpreter without system site-packages, and a .pth file
calls site.addsitedir() on a filtered view of the test venv's site-packages: a folder of symlinks
to every entry except those named after sglang_oea (and __pycache__). The view's own .pth files run
as they do in the test venv. The new env's own site-packages comes first on sys.path, so the wheel
installs there and is imported from there. The test checks that `import sglang_oea` fails before
the install and resolves inside the new env's site-packages after it.

The wheel is built from a copy of python/, so that the build writes nothing into the checkout.
Nothing here needs the network: `pip wheel --no-build-isolation` uses the test venv's setuptools,
`pip install --no-deps --no-index` takes the wheel file only. No server is started: SGLang's
`launch_server --help` (on the CPU engine) is enough to show that the plugin was loaded, since the
flag group is added by the plugin's hook. About 40 s on 2 cores, most of it in the two --help runs.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from sglang_oea.cpu.serve import cpu_environment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAG_GROUP = "Opportunistic Expert Activation (sglang-oea)"
ENTRY_POINT = "oea = sglang_oea.plugin:register"
# The harness's entry point: a module that imports nothing of sglang_oea.cpu on a GPU server.
HARNESS_ENTRY_POINT = "oea_cpu_harness = sglang_oea.cpu_entry:register"
TIMEOUT_S = 240

# The new env's own view: where sglang_oea, its entry point and SGLang resolve from.
PROBE = """
import importlib.metadata as md, importlib.util, json, sysconfig
spec = importlib.util.find_spec("sglang_oea")
sglang = importlib.util.find_spec("sglang")
plugins = [(ep.name, ep.value, str(ep.dist.locate_file(""))) for ep in md.entry_points(group="sglang.srt.plugins")]
print(json.dumps({
    "purelib": sysconfig.get_path("purelib"),
    "sglang_oea": spec.origin if spec else None,
    "sglang": sglang.origin if sglang else None,
    "sglang_version": md.version("sglang"),
    "plugins": plugins,
}))
"""
# In the new env after the install: SGLang's --help under the wheel's own cpu_environment().
HELP_WITH_WHEEL = (
    "import os, sys; from sglang_oea.cpu.serve import STUB_DIR, cpu_environment; print(STUB_DIR, flush=True); "
    "os.execve(sys.executable, [sys.executable, '-m', 'sglang.launch_server', '--help'], cpu_environment())"
)


def clean_environment() -> dict:
    """os.environ without anything that would put the test venv or the checkout on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


def run(cmd, env, cwd) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{cmd} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def build_wheel(out_dir) -> str:
    """The wheel of python/, built from a copy (a build writes build/ and *.egg-info next to the source)."""
    src = out_dir / "src"
    shutil.copytree(os.path.join(ROOT, "python"), src,
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist"))
    dist = out_dir / "dist"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(dist), str(src)], clean_environment(), out_dir)
    wheels = sorted(dist.glob("sglang_oea-*.whl"))
    assert len(wheels) == 1, wheels
    return str(wheels[0])


def site_packages_view(view_dir) -> str:
    """A folder of symlinks to the test venv's site-packages, minus the sglang_oea install."""
    site_packages = sysconfig.get_path("purelib")
    view_dir.mkdir()
    for name in sorted(os.listdir(site_packages)):
        if "sglang_oea" in name.lower().replace("-", "_") or name == "__pycache__":
            continue
        os.symlink(os.path.join(site_packages, name), view_dir / name)
    return str(view_dir)


def make_env_with_sglang(env_dir, view: str) -> str:
    """A fresh venv on the base interpreter that sees `view` as a site dir; returns its python."""
    run([sys._base_executable, "-m", "venv", "--without-pip", str(env_dir)], clean_environment(), env_dir.parent)
    python = str(env_dir / "bin" / "python")
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = run([python, "-c", where], clean_environment(), env_dir.parent).stdout.strip()
    with open(os.path.join(purelib, "_sglang_from_test_venv.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({view!r})\n")
    return python


def probe(python: str, cwd) -> dict:
    return json.loads(run([python, "-c", PROBE], clean_environment(), cwd).stdout)


def oea_help_lines(text: str) -> list:
    return [line for line in text.splitlines() if FLAG_GROUP in line or "--oea-k0" in line]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_carries_entry_point_stub_and_pin(wheel):
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = whl.read(f"{info}/entry_points.txt").decode()
        metadata = whl.read(f"{info}/METADATA").decode()
    for module in ("plugin.py", "hooks.py", "cpu_serve.py", "kernels/oea_route.py", "cpu/stub/sgl_kernel/__init__.py"):
        assert f"sglang_oea/{module}" in names, f"{module} missing from {wheel}: {sorted(names)}"
    assert "[sglang.srt.plugins]" in entry_points and ENTRY_POINT in entry_points, entry_points
    assert HARNESS_ENTRY_POINT in entry_points and "sglang_oea/cpu_entry.py" in names, entry_points
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    from sglang_oea.flags import SUPPORTED_SGLANG_SPEC

    pins = [Requirement(line.split(":", 1)[1]) for line in metadata.splitlines() if line.startswith("Requires-Dist: sglang")]
    assert [(r.name, r.specifier) for r in pins] == [("sglang", SpecifierSet(SUPPORTED_SGLANG_SPEC))], metadata


def test_wheel_installs_beside_sglang_and_the_plugin_loads(wheel, tmp_path):
    python = make_env_with_sglang(tmp_path / "env", site_packages_view(tmp_path / "view"))

    before = probe(python, tmp_path)
    assert before["sglang_oea"] is None, f"sglang_oea visible before the install: {before}"
    assert before["sglang"] and before["sglang_version"] == "0.5.23", before
    assert not [p for p in before["plugins"] if p[0] == "oea"], before["plugins"]
    help_env = cpu_environment(clean_environment())  # the checkout's stand-in sgl_kernel only
    check = run([python, "-c", "import importlib.util as u; print(u.find_spec('sglang_oea'))"], help_env, tmp_path)
    assert check.stdout.strip() == "None", check.stdout
    plain = run([python, "-m", "sglang.launch_server", "--help"], help_env, tmp_path)
    assert "--tp-size" in plain.stdout, plain.stdout[-2000:]
    assert not oea_help_lines(plain.stdout), oea_help_lines(plain.stdout)

    run([python, "-m", "pip", "install", "--no-deps", "--no-index", wheel], clean_environment(), tmp_path)

    after = probe(python, tmp_path)
    assert after["sglang_oea"] and after["sglang_oea"].startswith(after["purelib"] + os.sep), after
    assert after["sglang_version"] == "0.5.23" and after["sglang"] == before["sglang"], after
    oea = [p for p in after["plugins"] if p[0] == "oea"]
    assert oea == [["oea", "sglang_oea.plugin:register", after["purelib"]]], after["plugins"]
    loaded = run([python, "-c", HELP_WITH_WHEEL], clean_environment(), tmp_path)
    stub_dir = loaded.stdout.splitlines()[0]
    assert stub_dir.startswith(after["purelib"] + os.sep), stub_dir
    lines = oea_help_lines(loaded.stdout)
    assert any(FLAG_GROUP in line for line in lines) and any("--oea-k0" in line for line in lines), \
        loaded.stdout[-3000:]
