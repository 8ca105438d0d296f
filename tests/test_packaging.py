"""The built wheel and sdist hold every module and data file, and the wheel works outside the source tree.

The package is assembled from four folders (``kvpress/``, ``kernels/``, ``policies/``, ``evals/``,
mapped to ``kvpress.*`` by setup.cfg's ``package_dir``), so a subpackage missing from setup.cfg's
``packages`` is invisible in an editable install and breaks only installed copies. This test builds
both distributions from a copy of the source, compares their file lists with the source tree, then
installs the wheel (``--no-deps``) into a fresh virtual environment and runs the command line there,
from a folder outside the repository, checking that the installed copy is what gets imported.
"""

import configparser
import os
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import kvpress

REPO = Path(__file__).resolve().parents[1]
TOP_FILES = ("setup.cfg", "pyproject.toml", "README.md")


def _setup_cfg(root: Path) -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(root / "setup.cfg")
    return cfg


def _package_dirs(cfg) -> dict[str, str]:
    """setup.cfg's ``package_dir``: package name -> source folder."""
    lines = [line.split("=") for line in cfg["options"]["package_dir"].strip().splitlines()]
    return {name.strip(): folder.strip() for name, folder in lines}


def _source_folder(package: str, package_dirs: dict[str, str]) -> str:
    """The source folder of ``package`` (a subpackage lives inside its closest mapped parent)."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        parent = ".".join(parts[:n])
        if parent in package_dirs:
            return "/".join([package_dirs[parent], *parts[n:]])
    raise AssertionError(f"{package} has no folder in setup.cfg's package_dir")


def expected_files(root: Path) -> dict[str, str]:
    """Installed path -> source path of every file the distributions must hold: each .py under the
    mapped folders, and each file that a ``package_data`` pattern names."""
    cfg = _setup_cfg(root)
    package_dirs = _package_dirs(cfg)
    expected = {}
    for package, folder in package_dirs.items():
        target = package.replace(".", "/")
        for path in (root / folder).rglob("*.py"):
            if "__pycache__" not in path.parts:
                rel = path.relative_to(root / folder).as_posix()
                expected[f"{target}/{rel}"] = f"{folder}/{rel}"
    for package, patterns in cfg["options.package_data"].items():
        folder = _source_folder(package, package_dirs)
        for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
            matches = [p for p in (root / folder).glob(pattern) if p.is_file()]
            assert matches, f"package_data {package} = {pattern}: no file in {folder}/ matches"
            for path in matches:
                rel = path.relative_to(root / folder).as_posix()
                expected[f"{package.replace('.', '/')}/{rel}"] = f"{folder}/{rel}"
    return expected


def _run(cmd, **kwargs):
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, **kwargs)
    assert done.returncode == 0, f"{cmd} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_packages_cover_every_source_folder():
    """Every folder with an ``__init__.py`` is a package that setup.cfg lists (read without building)."""
    cfg = _setup_cfg(REPO)
    package_dirs = _package_dirs(cfg)
    listed = set(cfg["options"]["packages"].split())
    found = set()
    for package, folder in package_dirs.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            found.add(".".join([package, *rel]))
    assert found - listed == set(), f"packages missing from setup.cfg: {sorted(found - listed)}"
    assert (REPO / "kvpress" / "py.typed").is_file()


def test_wheel_and_sdist_hold_every_file_and_the_wheel_runs_installed(tmp_path):
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for folder in set(_package_dirs(_setup_cfg(REPO)).values()):
        if "/" not in folder:
            shutil.copytree(REPO / folder, src / folder, ignore=ignore, dirs_exist_ok=True)
    for name in TOP_FILES:
        shutil.copy2(REPO / name, src / name)
    expected = expected_files(src)

    # the wheel: exactly the expected files, plus its metadata
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
          str(src)], cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("kvpress_toolkit-*.whl")
    assert wheel.name.startswith(f"kvpress_toolkit-{kvpress.__version__}-")
    with zipfile.ZipFile(wheel) as zf:
        names = {n for n in zf.namelist() if not n.endswith("/")}
    contents = {n for n in names if ".dist-info/" not in n}
    assert sorted(set(expected) - contents) == [], "files missing from the wheel"
    assert sorted(contents - set(expected)) == [], "files in the wheel that setup.cfg does not name"

    # the sdist: every source file of the wheel and the build files
    script = "from setuptools import build_meta as b; print(b.build_sdist('sdist'))"
    name = _run([sys.executable, "-c", script], cwd=src).stdout.strip().splitlines()[-1]
    with tarfile.open(src / "sdist" / name) as tf:
        members = {m.name.split("/", 1)[1] for m in tf.getmembers() if m.isfile()}
    assert sorted({*expected.values(), *TOP_FILES} - members) == [], "files missing from the sdist"

    # a fresh environment that sees this one's packages (torch, transformers) but not the editable
    # install: site folders listed in a .pth are put on sys.path without running their own .pth files
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)])
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    parents = [p for p in [*site.getsitepackages(), site.getusersitepackages()] if os.path.isdir(p)]
    Path(purelib, "_parent_env.pth").write_text("\n".join(parents) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "--quiet",
          str(wheel)])

    work = tmp_path / "work"  # outside the repository: nothing there shadows the installed package
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONNOUSERSITE="1", KVPRESS_DEVICE="cpu")
    bindir = python.parent

    def run(*cmd):
        return _run(list(cmd), cwd=work, env=env).stdout

    out = run(str(python), "-c", "import kvpress, kvpress.evals.tasks, kvpress.evals.lm_eval_tasks as t; "
              "print(kvpress.__file__); print(sorted(p.name for p in t.INCLUDE_PATH.glob('*.yaml')))")
    installed = Path(out.splitlines()[0]).resolve()
    assert installed.is_relative_to(venv.resolve()), f"imported {installed}, not the wheel installed in {venv}"
    assert "kvpress_niah_single.yaml" in out.splitlines()[1]
    kvp = str(bindir / "kvpress")
    assert run(kvp, "--version").strip() == f"kvpress-toolkit {kvpress.__version__}"
    listing = run(kvp, "policies")
    for policy in kvpress.list_policies():
        assert f"\n{policy} " in listing
    # a tiny eval and its report (random weights: the scores mean nothing; runs in seconds)
    run(kvp, "eval", "--model", "random-tiny", "--policies", "full,window", "--budgets", "64", "--lengths", "512",
        "--tasks", "niah_single", "--samples", "1", "--out", "out", "--no-plots", "--no-progress")
    assert (work / "out" / "results.jsonl").is_file()
    report = run(kvp, "report", "out")
    assert "window" in report and "512" in report

