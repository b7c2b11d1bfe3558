"""The image tag `make deploy` pushes to ECR (`scripts/deploy.sh image-tag`). The repository is
IMMUTABLE and a tag already there is not rebuilt, so the tag must change whenever what
`docker build .` sends changes (the Dockerfile's COPY sources, tracked or not, less what
.gitignore ignores) and stay the same for the same tree. Run in a scratch git repository holding
the real Dockerfile, .dockerignore, .gitignore and scripts/deploy*.sh."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.conftest import ROOT


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in (
        "Dockerfile", ".dockerignore", ".gitignore",
        "scripts/deploy.sh", "scripts/deploy-settings.sh", "scripts/deploy-image-tag.sh",
        "scripts/deploy-terraform.sh",
    ):  # fmt: skip
        shutil.copy(ROOT / name, repo / name)
    for name, text in {
        "pyproject.toml": "[project]\nname = 'x'\n",
        "setup.py": "",
        "README.md": "x\n",
        "constraints.txt": "",
        "appliance/__init__.py": "",
        "appliance/train.py": "STEPS = 1\n",
        "appliance/configs/a10.yaml": "lora_rank: 8\n",
        "docs/notes.md": "notes\n",
    }.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "first")
    return repo


def image_tag(repo: Path) -> str:
    result = subprocess.run(
        ["bash", "scripts/deploy.sh", "image-tag"], cwd=repo, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_a_clean_tree_is_tagged_with_its_commit(repo) -> None:
    assert image_tag(repo) == git(repo, "rev-parse", "--short=12", "HEAD")


def test_a_new_module_not_yet_added_changes_the_tag(repo) -> None:
    commit = git(repo, "rev-parse", "--short=12", "HEAD")
    new = repo / "appliance" / "new_module.py"
    new.write_text("x = 1\n")
    first = image_tag(repo)
    assert first.startswith(f"{commit}-dirty-")
    assert image_tag(repo) == first  # the same tree: the same tag (found in ECR, not rebuilt)
    new.write_text("x = 2\n")
    second = image_tag(repo)
    assert second.startswith(f"{commit}-dirty-") and second != first
    new.write_text("x = 1\n")
    assert image_tag(repo) == first
    # names count, not only bytes: the same file under another name is another image
    new.rename(repo / "appliance" / "other_module.py")
    assert image_tag(repo) not in (first, second, commit)


def test_edits_to_tracked_files_of_the_build_context_change_the_tag(repo) -> None:
    commit = git(repo, "rev-parse", "--short=12", "HEAD")
    train = repo / "appliance" / "train.py"
    train.write_text("STEPS = 2\n")
    edited = image_tag(repo)
    assert edited.startswith(f"{commit}-dirty-")
    git(repo, "add", "appliance/train.py")  # staged or not, the context is the same
    assert image_tag(repo) == edited
    (repo / "Dockerfile").write_text((repo / "Dockerfile").read_text() + "# edit\n")
    assert image_tag(repo) != edited
    train.unlink()
    (repo / "Dockerfile").write_text((ROOT / "Dockerfile").read_text())
    deleted = image_tag(repo)  # a deleted file is not in the context
    assert deleted.startswith(f"{commit}-dirty-") and deleted != edited


def test_files_outside_the_build_context_or_ignored_leave_the_tag_alone(repo) -> None:
    commit = git(repo, "rev-parse", "--short=12", "HEAD")
    (repo / "docs" / "notes.md").write_text("edited\n")
    (repo / "docs" / "new.md").write_text("new\n")
    cache = repo / "appliance" / "__pycache__"
    cache.mkdir()
    (cache / "train.cpython-312.pyc").write_bytes(b"\0")
    assert image_tag(repo) == commit
