"""The repository rules that can be checked mechanically: install metadata, README commands, imports."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_pyproject_has_registry_section_and_dependencies():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = {_name(d) for d in meta["project"]["dependencies"]}
    for needed in ("torch", "faiss-cpu", "triton", "safetensors", "zstandard", "filelock"):
        assert needed in deps, needed
    # the default install is what the nodes need inside ComfyUI: demo / diffusers / open_clip are extras
    for optional in ("diffusers", "open-clip-torch", "scikit-image", "transformers", "torchvision"):
        assert optional not in deps, optional
    extras = {name: {_name(d) for d in reqs} for name, reqs in meta["project"]["optional-dependencies"].items()}
    assert "open-clip-torch" in extras["openclip"] and "diffusers" in extras["diffusers"]
    assert "scikit-image" in extras["demo"] and "psycopg" in extras["fleet"]
    assert "pytest" in extras["dev"] and "chorus-ii" in extras["dev"]  # dev = every extra + the test tools
    comfy = meta["tool"]["comfy"]
    assert {"PublisherId", "DisplayName", "Icon", "requires-comfyui"} <= set(comfy)
    assert re.fullmatch(r">=0\.3\.\d+", comfy["requires-comfyui"])


def test_requirements_txt_mirrors_pyproject_except_torch():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = {_name(d) for d in meta["project"]["dependencies"]} - {"torch", "torchvision"}
    lines = [ln for ln in (ROOT / "requirements.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert {_name(ln) for ln in lines} == deps


def test_readme_opens_with_setup_and_test_commands_and_ci_runs_the_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    # the console script, not ``python -m chorus demo``: run from the pack root, ``-m`` puts the root on
    # sys.path, where the pack's ``kernels/`` shadows the ``kernels`` distribution transformers imports
    assert "&& chorus demo" in blocks[0] and "pip install" in blocks[0] and "python -m chorus demo" not in blocks[0]
    assert 'chorus = "chorus.__main__:main"' in (ROOT / "pyproject.toml").read_text()
    assert blocks[1].strip() == "pytest"
    ci = (ROOT / ".ci" / "run").read_text()
    assert '/pytest"' in ci and '"$PYTEST"' in ci and "-m pytest" not in ci and "-eq 5" in ci


def test_core_packages_import_without_comfyui():
    code = ("import sys, chorus, chorus.kernels, chorus.cache_store, chorus.engine, chorus.hosts.diffusers; "
            "bad = [m for m in sys.modules if m == 'comfy' or m.startswith(('comfy.', 'comfy_api'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_the_pack_root_is_not_on_the_test_path_and_diffusers_wan_imports():
    """The pack root is the ``chorus`` package, whose sub-folders (``kernels``, ``nodes``, ``engine``) would
    shadow top-level modules of the same names if the root were on ``sys.path``: transformers 5.x imports
    the ``kernels`` distribution, which the pack's ``kernels/`` then replaced (every diffusers test failed).
    Tests import the pack and its benchmarks as ``chorus.*``."""
    assert not any(Path(p or ".").resolve() == ROOT for p in sys.path), sys.path
    pytest.importorskip("diffusers")
    from diffusers import WanTransformer3DModel  # noqa: F401  (imports transformers' model stack)


def test_engine_imports_neither_comfyui_nor_diffusers():
    """``import chorus.engine`` alone (a fresh interpreter) loads no ComfyUI and no diffusers module."""
    code = ("import sys, chorus.engine; "
            "tops = {m.split('.')[0] for m in sys.modules}; "
            "bad = sorted(t for t in tops if t in ('comfy', 'diffusers') or t.startswith('comfy_')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_every_pack_package_is_installed():
    """Each folder of the pack with an ``__init__.py`` (outside tests/ and benchmarks/) is listed in
    ``[tool.setuptools] packages``, so ``pip install`` ships it."""
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for init in ROOT.rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts and (rel.parts[0] in ("tests", "benchmarks", "build") or rel.parts[0].startswith(".")):
            continue
        if all((ROOT / Path(*rel.parts[:i]) / "__init__.py").exists() for i in range(len(rel.parts))):
            found.add(".".join(("chorus",) + rel.parts))
    assert found - packages == set()
