"""Every name a Python file of the project reads at module level or in a function is bound somewhere it can come from:
the module (def, class, import, assignment), an enclosing scope, or builtins. The GPU-only files (integration/,
the kernel tests) never run on CPU, so an undefined name there would first show as a NameError on a GPU machine (a
refactor once deleted a helper the vLLM layer test still called). Parsed with the standard library's symtable, which
resolves scopes the way the compiler does; nothing is imported or run.
"""
import builtins
import symtable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("flashmla_backend", "tests", "integration", "benchmarks", "csrc")
BUILTINS = set(dir(builtins)) | {"__file__", "__name__", "__doc__", "__spec__", "__builtins__", "__path__",
                                 "__loader__", "__package__", "__annotations__", "__dict__"}


def _sources():
    found = [p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")] + list(ROOT.glob("*.py"))
    return sorted(p for p in found if ".test-envs" not in p.parts and "build" not in p.parts)


def _module_names(top: symtable.SymbolTable) -> set[str]:
    return {s.get_name() for s in top.get_symbols()
            if s.is_assigned() or s.is_imported() or s.is_namespace() or s.is_declared_global()}


def _undefined(path: Path) -> list[str]:
    top = symtable.symtable(path.read_text(), str(path), "exec")
    bound = _module_names(top) | BUILTINS
    # Names declared `global` and assigned inside functions are module names too.
    stack = list(top.get_children())
    while stack:
        t = stack.pop()
        stack.extend(t.get_children())
        bound |= {s.get_name() for s in t.get_symbols() if s.is_declared_global() and s.is_assigned()}
    if any(s.get_name() == "*" for s in top.get_symbols()):
        return []  # a star import binds names symtable cannot see
    missing = []
    stack = [top]
    while stack:
        t = stack.pop()
        stack.extend(t.get_children())
        for s in t.get_symbols():
            name = s.get_name()
            if not s.is_referenced() or name in bound:
                continue
            # At module level a referenced name is unbound when nothing assigns or imports it; in a function an
            # implicit global (not local, not free from an enclosing function) must be a module name.
            if (t is top and not (s.is_assigned() or s.is_imported())) or (t is not top and s.is_global()):
                missing.append(f"{path.relative_to(ROOT)}: {name!r} in {t.get_name()} (line {t.get_lineno()})")
    return missing


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_name_read_is_bound(path):
    assert not _undefined(path)


def test_the_check_finds_an_undefined_name(tmp_path, monkeypatch):
    """The check itself: a function calling a helper that no longer exists is reported; a defined one is not."""
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\ndef f():\n    return helper(os.sep)\n\nclass C:\n    x = 1\n    def m(self):\n"
                   "        return self.x\n")
    good = tmp_path / "good.py"
    good.write_text("def helper(x):\n    return x\n\ndef f():\n    def g():\n        return helper(1)\n    return g\n")
    assert [m.split(": ", 1)[1] for m in _undefined(bad)] == ["'helper' in f (line 3)"]
    assert _undefined(good) == []
