"""What every command shares: its errors as `error: ...` lines (friendly_errors: no traceback,
exit 1; a missing optional dependency named with its install), the --data glob hint and the
grouped --help of train (PatternHint, GroupedHelp), a train flag's help text for other commands."""

from __future__ import annotations

import functools
import math
import sys

import click

from appliance.config import (
    FIELDS,
    HELP_GROUPS,
    KEY_ALIASES,
    flag,
)
from appliance.errors import ApplianceError, ConfigError, cause_chain
from appliance.interrupt import RunInterrupted, stopped_at_once


def _check_values(kwargs: dict) -> None:
    """Any command's options: a NUL byte (os calls raise a bare ValueError on one) or a number
    that is not finite (nan passes every range check) is one line naming the option."""
    problems = []
    for name, value in kwargs.items():
        option = "--" + name.replace("_", "-")
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, str) and "\0" in v:
                problems.append(f"{option}: {v!r} holds a NUL byte: give it without one")
            elif isinstance(v, float) and not math.isfinite(v):
                problems.append(f"{option}: {v} is not a finite number")
    if problems:
        raise ConfigError("\n".join(problems))


def friendly_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            _check_values(kwargs)
            return fn(*args, **kwargs)
        except ApplianceError as e:
            for line in str(cause_chain(e)[-1]).splitlines() or [type(e).__name__]:
                click.echo(f"error: {line}", err=True)
            sys.exit(1)
        except RunInterrupted as e:  # stopped at a step boundary, checkpoint written
            click.echo(str(e), err=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except SystemError as e:  # a Ctrl-C inside Ray's Cython code comes out as one
            if not stopped_at_once(e):
                raise
            click.echo("interrupted", err=True)
            sys.exit(130)
        except ModuleNotFoundError as e:  # a dependency left out (pip --no-deps, a GPU image)
            package = (e.name or "").partition(".")[0]
            if package not in MISSING_HINTS:
                raise
            command = click.get_current_context().info_name
            click.echo(f"error: `appliance {command}` needs {MISSING_HINTS[package]}", err=True)
            sys.exit(1)

    return wrapper


# dependencies whose absence is an install to fix, not a bug: what to install, and what runs
# without it (the GPU machine's image has neither Ray nor boto3)
_BOTO3_HINT = "boto3 for s3:// paths, which is not installed here: pip install 'boto3>=1.34'"
MISSING_HINTS = {
    "ray": "Ray, which is not installed here: pip install 'ray[default]>=2.40' "
    "(eval and bench run without it)",
    "boto3": _BOTO3_HINT,
    "botocore": _BOTO3_HINT,  # boto3's own dependency, missing with it
}


class PatternHint(click.Command):
    """A command taking --data: "unexpected extra arguments" after it is, nearly always, a glob
    pattern left unquoted that the shell expanded into file names; the error says so."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        given = any(a == "--data" or a.startswith("--data=") for a in args)
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as e:  # --learning-rate: the appliance's own name, --lr
            own = KEY_ALIASES.get(e.option_name.lstrip("-").replace("-", "_"))
            if own and any(own == p.name for p in self.params):
                e.possibilities = [flag(own)]
            raise
        except click.UsageError as e:
            if given and "unexpected extra argument" in e.message:
                e.message += (
                    ": if --data is a pattern, quote it, or the shell expands it into file names "
                    "(--data 'data/*.jsonl')"
                )
            raise


class GroupedHelp(PatternHint):
    """A command whose --help lists its options in the sections of config.HELP_GROUPS (in that
    order), then whatever no group names under "Other options"."""

    ALIASES = {"config_file": "config"}  # click parameter name -> the name HELP_GROUPS uses

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records: dict[str, tuple[str, str]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                records[self.ALIASES.get(param.name or "", param.name or "")] = record
        for title, names in [*HELP_GROUPS.items(), ("Other options", tuple(records))]:
            rows = [records.pop(n) for n in names if n in records]
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


def train_flag_help(name: str) -> str:
    """A train flag's help text (config/schema.py), for the same flag of another command."""
    return FIELDS[name].metadata["help"]
