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
