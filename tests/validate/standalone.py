"""Run a validate/ script the way it runs on a GPU box: copied into a folder without kvsim."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

VALIDATE = Path(__file__).resolve().parents[2] / "validate"


def run_alone(folder: Path, names: tuple[str, ...], argv: list[str]) -> tuple[str, str]:
    """Copy ``names`` from validate/ into ``folder``, run the first with ``argv`` in a fresh,
    isolated interpreter (``python3 script.py`` puts the script's folder first on sys.path)
    and return (its last stdout line, its stderr). The last line reads
    ``exit <status> kvsim [<kvsim packages it imported>]``."""
    for name in names:
        (folder / name).write_text((VALIDATE / name).read_text())
    script = folder / names[0]
    probe = (
        "import runpy, sys\n"
        f"sys.path.insert(0, {str(folder)!r})\n"
        f"sys.argv = [{str(script)!r}, *{argv!r}]\n"
        "code = 0\n"
        "try:\n"
        f"    runpy.run_path({str(script)!r}, run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        "names = {m.split('.')[0] for m in sys.modules}\n"
        "print('exit', code, 'kvsim', sorted(names & {'sim', 'validate', 'dashboard'}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", probe], cwd=folder, capture_output=True, text=True
    )
    lines = done.stdout.strip().splitlines()
    return (lines[-1] if lines else ""), done.stderr
