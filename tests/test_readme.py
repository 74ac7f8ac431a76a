"""The README's two set-up commands are the ones CI and users run."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```bash\n")[1:3]
    return [b.split("\n```")[0].strip() for b in blocks]


def test_ci_runs_the_readme_test_command():
    install_and_launch, install_and_test = commands()
    assert "pytest" in install_and_test and "torch==2.13.0" in install_and_test
    assert install_and_test in (ROOT / ".ci" / "run").read_text()
    assert "torch==2.13.0" in install_and_launch and install_and_launch.endswith("strata-gui")


def test_powershell_commands_install_the_same_and_need_no_activated_venv():
    text = (ROOT / "README.md").read_text()
    ps = [b.split("\n```")[0].strip() for b in text.split("```powershell\n")[1:3]]
    assert len(ps) == 2
    launch, test = ps
    bash_launch, bash_test = commands()
    for win, lin in ((launch, bash_launch), (test, bash_test)):
        assert win.startswith("py -m venv .venv; ") and "&&" not in win  # Windows PowerShell 5.1 has no &&
        pip = lin.split("-m pip install ")[1].split(" && ")[0]
        assert f".venv\\Scripts\\python -m pip install {pip}" in win
    assert launch.endswith(".venv\\Scripts\\strata-gui") and test.endswith(".venv\\Scripts\\python -m pytest -q")
    assert "scripts/install.py" in text and (ROOT / "scripts" / "install.py").is_file()
    # no bare console command in the examples: each is the venv's program, by path
    for line in text.splitlines():
        assert not line.lstrip().startswith(("strata-bench ", "strata-gui ")), line


def test_the_windows_workflow_runs_the_readmes_powershell_commands():
    """.github/workflows/windows.yml: the CPU suite with the README's PowerShell test command,
    verbatim, and the frozen build through packaging/build.ps1."""
    text = (ROOT / "README.md").read_text()
    _, ps_test = [b.split("\n```")[0].strip() for b in text.split("```powershell\n")[1:3]]
    workflow = (ROOT / ".github" / "workflows" / "windows.yml").read_text()
    assert ps_test in workflow
    assert "runs-on: windows-latest" in workflow and "packaging\\build.ps1" in workflow
    assert "py scripts\\install.py --dry-run" in workflow
