"""The runtime (what apps embed) stands on its own: no torch, no transformers, no training,
exporters or measuring code, checked by what an import really loads and by the source."""

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("torch", "transformers", "edgespec.training", "edgespec.exporters", "edgespec.measure",
             "edgespec.cli", "edgespec.chat")


def test_importing_the_runtime_loads_no_training_or_export_code():
    mods = [f"edgespec.runtime.{p.stem}" for p in sorted((ROOT / "runtime").glob("*.py"))
            if p.stem != "__init__"]
    code = ("import json, sys\n" + "".join(f"import {m}\n" for m in mods)
            + "print(json.dumps(sorted(sys.modules)))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    loaded = json.loads(res.stdout)
    assert set(mods) <= set(loaded)
    bad = [m for m in loaded if m.split(".")[0] in FORBIDDEN or m.startswith(FORBIDDEN)]
    assert not bad, bad


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_runtime_sources_never_import_upward():
    """Lazy imports count too: none of the runtime's files names a forbidden module anywhere."""
    for path in sorted((ROOT / "runtime").glob("*.py")):
        bad = [m for m in _imports(path) if m.split(".")[0] in FORBIDDEN or m.startswith(FORBIDDEN)]
        assert not bad, (path.name, bad)


def test_core_modules_import_nothing_above_them():
    """edgespec/ (errors, io, cache, targets, GGUF reading, prompts) sits below everything."""
    above = ("edgespec.runtime", "edgespec.training", "edgespec.exporters", "edgespec.measure")
    for path in sorted((ROOT / "edgespec").glob("*.py")):
        if path.stem in ("cli", "__main__"):
            continue
        bad = [m for m in _imports(path) if m.startswith(above)]
        assert not bad, (path.name, bad)


def test_no_private_names_cross_modules():
    """A leading underscore means private to its module: nothing imports one from elsewhere."""
    for folder in ("edgespec", "runtime", "training", "exporters", "measure", "scripts"):
        for path in sorted((ROOT / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("edgespec"):
                    private = [a.name for a in node.names if a.name.startswith("_") and not a.name.endswith("__")]
                    assert not private, (path.name, node.module, private)


def test_the_decode_loop_knows_no_engine():
    """The loop and its parts (verifier, policies, the spec, the engine interface) see engines
    only through runtime/engine.py: none imports llama.cpp, onnxruntime or an engine module."""
    engines = ("llama_cpp", "onnxruntime", "edgespec.runtime.llama_target", "edgespec.runtime.ort_target",
               "edgespec.runtime.batching")
    for name in ("decoding", "verify", "policies", "spec", "engine"):
        bad = [m for m in _imports(ROOT / "runtime" / f"{name}.py") if m.startswith(engines)]
        assert not bad, (name, bad)
