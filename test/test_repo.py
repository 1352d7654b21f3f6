"""Rules of the repository's shape: the serving path imports none of the wings, the plugin imports the core only,
tests stand alone, and code cites only the repository's own docs."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
WINGS = ("ess.reference", "ess.harness", "ess.analysis", "ess.cli", "matplotlib")


def loaded_after(imports: str) -> list[str]:
    code = f"import sys\n{imports}\nprint('\\n'.join(m for m in sys.modules if m.startswith({WINGS!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return [m for m in out.stdout.split() if m]


def test_the_core_imports_none_of_the_wings():
    core = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "ess" / "core").rglob("*.py")
                  if p.stem != "__init__")
    assert loaded_after("\n".join(f"import {m}" for m in core)) == []


def test_the_analysis_imports_nothing_of_the_reference_model():
    """The wings stand one above the other: the reference model may use the analysis (its timing), never the reverse."""
    analysis = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "ess" / "analysis").rglob("*.py")
                      if p.stem != "__init__")
    loaded = loaded_after("\n".join(f"import {m}" for m in analysis))
    assert [m for m in loaded if m.startswith(("ess.reference", "ess.harness", "ess.cli"))] == []


def test_the_plugin_imports_the_core_only():
    pytest.importorskip("sglang")
    mods = ("runtime", "validate", "sizing", "hooks.registry", "pool", "cpu", "cpu.patches", "cpu.kernels", "cpu.indexer_forward",
            "cpu.flash_mla_interface", "cpu.resolution")
    assert loaded_after("\n".join(f"import sglang_ess.{m}" for m in mods)) == []


def python_files(*folders):
    return [p for f in folders for p in (ROOT / f).rglob("*.py")]


def test_tests_edit_no_path_and_import_no_test_module():
    tests = {p.stem for p in python_files("test")}
    for path in python_files("test"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                raise AssertionError(f"{path.relative_to(ROOT)} touches sys.path")
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name.split(".")[0] not in tests, f"{path.relative_to(ROOT)} imports test module {name}"


def test_code_cites_only_the_repositorys_docs():
    for path in python_files("ess", "python", "benchmark", "test", "scripts", "docker"):
        text = path.read_text()
        for outside in ("ess-design.md", "../shared", "shared/docs"):
            assert outside not in text or path.name == "test_repo.py", f"{path.relative_to(ROOT)} cites {outside}"


PRODUCT = ("ess", "python", "benchmark", "scripts")
KERNELS = ("ess/core/kernels",)  # kernels may run longer: a kernel and its launch read best in one file
MAX_LINES = 600


def test_no_two_modules_share_a_file_name():
    names: dict[str, list[str]] = {}
    for path in python_files(*PRODUCT):
        if path.stem != "__init__" and "stubs" not in path.parts:
            names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}


def test_files_a_reader_holds_at_once():
    long = []
    for path in python_files(*PRODUCT, "test"):
        rel = str(path.relative_to(ROOT))
        if not rel.startswith(KERNELS) and len(path.read_text().splitlines()) > MAX_LINES:
            long.append(rel)
    assert long == [], f"over {MAX_LINES} lines: {long}"


def test_one_standin_sgl_kernel():
    assert [str(p.relative_to(ROOT)) for p in (ROOT / "python").rglob("sgl_kernel")] == [
        "python/sglang_ess/cpu/standin/sgl_kernel"]


def test_the_docs_fit_a_reader():
    """docs/ and the README together stay under 150K characters: facts live once, dated results beside their JSON."""
    size = sum(len(p.read_text()) for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    assert size < 150_000, f"docs/ + README.md: {size} characters"
