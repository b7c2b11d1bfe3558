"""The tracking backends by the names the Hugging Face Trainer's `report_to` uses, the Python
package each needs, and how to install it (pyproject's extras: `appliance[tracking]` for all)."""

from __future__ import annotations

import importlib.util

BACKENDS = ("tensorboard", "mlflow", "wandb", "trackio")
NONE = "none"  # --report-to none: no tracking (the default)

#: the module a backend imports, and the pip requirement that brings it
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow-skinny"),  # the client; a sqlite:/// store also needs sqlalchemy
    "wandb": ("wandb", "wandb"),
    "trackio": ("trackio", "trackio"),
}


def parse_report_to(values: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """`--report-to` as given (comma-separated, repeated, `none`) as backend names, each once,
    in the order given; `none` alone means none."""
    names: list[str] = []
    for value in values:
        for name in str(value).split(","):
            name = name.strip().lower()
            if name and name != NONE and name not in names:
                names.append(name)
    return tuple(names)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def backend_problems(names: tuple[str, ...], option: str = "--report-to") -> list[str]:
    """One line per backend in `names` that is unknown or whose package is not installed."""
    problems = []
    for name in names:
        if name not in PACKAGES:
            problems.append(
                f"{option}: {name!r} is not a tracker: give some of {', '.join(BACKENDS)} "
                f"(comma-separated), or {NONE}"
            )
            continue
        module, requirement = PACKAGES[name]
        if not _installed(module):
            problems.append(
                f"{option} {name}: the {requirement} package is not installed here: pip install "
                f"'appliance[{name}]' (or 'appliance[tracking]' for every tracker)"
            )
    return problems
