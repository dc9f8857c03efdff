"""kvsieve/__init__.py in a source checkout: a Python started in the repo root
(python -m / -c, or a Ray worker whose driver ran there) finds the root's
kvsieve/ before the installed package. It must still import the subpackages
that pyproject's package-dir maps to the folders beside it; an installed
kvsieve (subpackages inside) must be left as it is."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The dev install's editable finder would map kvsieve.* anyway: drop it, as
# on a machine where kvsieve was installed from a wheel.
NO_EDITABLE = "import sys; sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, '__name__', '') != '_EditableFinder']"


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", f"{NO_EDITABLE}\n{code}"], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_the_checkout_root_imports_the_mapped_subpackages():
    out = _run("import kvsieve.service.config as c, kvsieve.radix_ext.memory_plan as m\nprint(c.__file__)\n"
               "print(m.__file__)", REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(REPO / "service/config.py"), str(REPO / "radix_ext/memory_plan.py")]


def test_an_installed_layout_keeps_its_own_path(tmp_path):
    site = tmp_path / "site"
    (site / "kvsieve" / "service").mkdir(parents=True)
    shutil.copy(REPO / "kvsieve" / "__init__.py", site / "kvsieve" / "__init__.py")
    (site / "kvsieve" / "service" / "__init__.py").write_text("WHERE = 'installed'\n")
    (site / "service").mkdir()  # a site's top-level package of that name is not a checkout's folder
    (site / "service" / "__init__.py").write_text("WHERE = 'beside'\n")
    out = _run("import kvsieve, kvsieve.service as s\nprint(len(kvsieve.__path__), s.WHERE)", site)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "installed"]
