"""Loading a script of benchmarks/ as a module, for the tests of its pure-Python parts; a script's ``--rescore``
output of rows a test wrote."""
import importlib.util
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str):
    """``benchmarks/<name>.py`` as a module (with benchmarks/ on the path while it loads: some scripts import
    others of that folder, e.g. ``decode`` or ``tune_router``)."""
    spec = importlib.util.spec_from_file_location(f"evenflow_bench_{name}_script", BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return mod


def switches_at_launch(monkeypatch, module, launcher: str, names) -> list:
    """Record the module switches ``names`` of ``module`` as each call of its ``launcher`` finds them (a list that
    grows a dict a launch): what a benchmark's knob row actually launched with."""
    seen = []
    launch = getattr(module, launcher)

    def spy(*args, **kwargs):
        seen.append({name: getattr(module, name) for name in names})
        return launch(*args, **kwargs)

    monkeypatch.setattr(module, launcher, spy)
    return seen


def rescored(main, rows: list[dict], path: Path, capsys) -> str:
    """What ``main(["--rescore", path])`` prints of a result file holding ``rows`` (written to ``path``)."""
    path.write_text(json.dumps({"header": {}, "meta": {}, "rows": rows}))
    main(["--rescore", str(path)])
    return capsys.readouterr().out
