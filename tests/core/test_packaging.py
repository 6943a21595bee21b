"""The wheel a user installs (not the editable checkout) holds every module and imports."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import textwrap
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAYOUT = {"asyncrl": "asyncrl", "roles": "asyncrl/roles", "pipelines": "asyncrl/pipelines"}


def test_the_wheel_holds_every_module_and_imports_outside_the_repository(tmp_path):
    src = tmp_path / "src"  # build from a copy: the build writes build/ and *.egg-info next to setup.py
    for name in (*LAYOUT, "setup.py", "pyproject.toml", "README.md"):
        path = ROOT / name
        if not path.exists():
            continue
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("asyncrl-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    expected = {f"{LAYOUT[top]}/{p.relative_to(ROOT / top).as_posix()}"
                for top in LAYOUT for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts}
    assert sorted(expected - shipped) == [], "modules missing from the wheel"
    assert "asyncrl/roles/engines/hf.py" in shipped
    static = {n for n in zipfile.ZipFile(wheel).namelist() if "/viewer_static/" in n}
    assert {f"asyncrl/pipelines/observe/viewer_static/{f}" for f in ("view.html", "uPlot.iife.min.js", "uPlot.min.css",
                                                              "NOTICE", "uPlot.LICENSE")} <= static

    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    probe = textwrap.dedent(f"""
        import sys
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
        sys.path.insert(0, {str(site)!r})
        import asyncrl, asyncrl.roles.engines.hf, asyncrl.pipelines.trainers.trainer, asyncrl.pipelines.observe.viewer
        assert "uPlot" in asyncrl.pipelines.observe.viewer.render_html(None)  # the page's package data is installed
        print(asyncrl.__file__, asyncrl.roles.engines.hf.__file__, asyncrl.pipelines.trainers.trainer.__file__)
    """)
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = proc.stdout.split()
    assert len(files) == 3 and all(f.startswith(str(site)) for f in files), proc.stdout


def test_the_torch_floor_is_what_the_code_needs():
    """torch's lower bound is tensordict's own floor (2.11; the core runs there): a higher
    pin would shut out users on 2.11/2.12 for nothing."""
    import importlib.metadata
    import tomllib

    from packaging.requirements import Requirement

    deps = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    ours = next(r for r in deps if r.name == "torch")
    theirs = next(Requirement(r) for r in importlib.metadata.requires("tensordict") or []
                  if Requirement(r).name == "torch")
    floor = lambda req: min(s.version for s in req.specifier if s.operator == ">=")  # noqa: E731
    assert floor(ours).split(".")[:2] == floor(theirs).split(".")[:2] == ["2", "11"]
    assert not ours.specifier.contains("2.15.0")  # the upper bound stays: 2.15 is untested
