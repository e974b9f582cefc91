"""The README's set-up commands are the ones CI runs."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def readme_commands():
    setup = read("README.md").split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", setup, re.S)


def test_readme_starts_with_the_set_up_commands():
    commands = readme_commands()
    assert len(commands) == 2
    assert "examples/train_under_budget.py" in commands[0] and "pytest" in commands[1]
    assert all("\n" not in c for c in commands), "each set-up command is one line"


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = [c for c in readme_commands() if "pytest" in c]
    assert len(test_command) == 1
    ci_lines = [line.strip() for line in read(".ci", "run").splitlines()]
    assert test_command[0].strip() in ci_lines
