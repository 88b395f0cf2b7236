"""scripts/setup.sh puts `adaptis` on PATH (scripts/link-cli.sh), as the README says it does.

setup.sh runs for real against a stub venv (its python and pip only record their arguments), so
nothing is installed and the test takes well under a second per run.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXPORT = 'export PATH="$HOME/.local/bin:$PATH"'
BASE_PATH = "/usr/bin:/bin"


def _stub_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name, body in {"python": "exit 0", "pip": f'echo "$*" >> "{venv}/pip.log"',
                       "adaptis": 'echo "stub adaptis $*"'}.items():
        exe = venv / "bin" / name
        exe.write_text(f"#!/bin/sh\n{body}\n")
        exe.chmod(0o755)
    return venv


def _env(home: Path, **extra: str) -> dict[str, str]:
    return {"HOME": str(home), "PATH": BASE_PATH, **extra}


def _setup(tmp_path: Path, venv: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "scripts/setup.sh"], cwd=REPO, capture_output=True, text=True,
                          env=_env(tmp_path / "home", ADAPTIS_VENV=str(venv), **extra),
                          timeout=60, check=False)


def test_setup_links_adaptis_and_says_how_to_get_it_on_path(tmp_path: Path) -> None:
    venv = _stub_venv(tmp_path)
    run = _setup(tmp_path, venv)
    assert run.returncode == 0, run.stderr
    # stdout is exactly the bin directory: the Makefile and others read its last line.
    assert run.stdout == f"{venv}/bin\n"
    link = tmp_path / "home" / ".local" / "bin" / "adaptis"
    assert link.is_symlink() and link.resolve() == (venv / "bin" / "adaptis").resolve()
    assert subprocess.run([str(link), "plan"], capture_output=True, text=True,
                          check=True).stdout == "stub adaptis plan\n"
    assert run.stderr.rstrip().splitlines()[-1].endswith(EXPORT), run.stderr
    assert "-e" in (venv / "pip.log").read_text()  # the editable install did run (stubbed)

    again = _setup(tmp_path, venv)  # idempotent: same link, same output
    assert again.returncode == 0 and again.stdout == run.stdout, again.stderr
    assert link.resolve() == (venv / "bin" / "adaptis").resolve()


def test_no_hint_when_the_directory_is_on_path(tmp_path: Path) -> None:
    venv = _stub_venv(tmp_path)
    home = tmp_path / "home"
    env = _env(home)
    env["PATH"] = f"{home}/.local/bin:{BASE_PATH}"
    run = subprocess.run(["bash", "scripts/link-cli.sh", f"{venv}/bin"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=30, check=False)
    assert run.returncode == 0 and "export PATH" not in run.stderr, run.stderr
    # Now on PATH, the bare command name works.
    out = subprocess.run(["adaptis", "crd"], env=env, capture_output=True, text=True, check=True)
    assert out.stdout == "stub adaptis crd\n"


def test_a_stale_link_is_replaced_and_a_real_file_is_kept(tmp_path: Path) -> None:
    old, new = _stub_venv(tmp_path / "old"), _stub_venv(tmp_path / "new")
    home = tmp_path / "home"

    def link_cli(venv: Path, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "scripts/link-cli.sh", f"{venv}/bin"], cwd=REPO,
                              env=_env(home, **extra), capture_output=True, text=True,
                              timeout=30, check=False)

    assert link_cli(old).returncode == 0
    assert link_cli(new).returncode == 0
    link = home / ".local" / "bin" / "adaptis"
    assert link.resolve() == (new / "bin" / "adaptis").resolve()
    link.unlink()
    link.write_text("#!/bin/sh\necho mine\n")
    kept = link_cli(new)
    assert kept.returncode == 0 and "not a link" in kept.stderr
    assert link.read_text() == "#!/bin/sh\necho mine\n"
    other = tmp_path / "bin-elsewhere"
    moved = link_cli(new, ADAPTIS_BIN_DIR=str(other))
    assert (other / "adaptis").is_symlink()
    assert moved.stderr.rstrip().endswith(f'export PATH="{other}:$PATH"'), moved.stderr
    missing = link_cli(tmp_path / "nowhere")
    assert missing.returncode == 1 and "run scripts/setup.sh" in missing.stderr


def test_readme_gives_the_same_command_in_its_first_section() -> None:
    readme = (REPO / "README.md").read_text()
    first = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    assert EXPORT in first and "~/.local/bin" in first
    script = (REPO / "scripts" / "setup.sh").read_text()
    assert re.search(r"bash scripts/link-cli\.sh \"\$VENV/bin\"", script)
    # setup.sh's stdout stays one line: nothing after the link step may echo to stdout.
    assert script.rstrip().splitlines()[-1] == 'echo "$VENV/bin"'
    assert os.access(REPO / "scripts" / "link-cli.sh", os.X_OK)
