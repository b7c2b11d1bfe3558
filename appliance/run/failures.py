"""How the driver reads a failure on Ray: wait for every result or the telling failure
(`gather`), and tell the failures a restart cannot fix (`unrecoverable`: a user error, in the
chain or raised by an actor's __init__) from those it may (a dead actor, a broken collective)."""

from __future__ import annotations

import importlib
import re

from appliance.errors import ApplianceError, cause_chain


class RestartsExhausted(ApplianceError):
    """More actor failures than --max-restarts allows."""


def gather(refs: list, grace: float = 30.0) -> list:
    """ray.get of every ref, raising as soon as one fails. A failure that names no dead actor
    (a rank whose collective broke because a peer died) waits up to `grace` seconds for the
    others, to raise the peer's death instead: that is what recovery needs to see."""
    import ray
    from ray.exceptions import RayActorError

    def telling(e: BaseException) -> bool:
        return any(isinstance(c, RayActorError | ApplianceError) for c in cause_chain(e))

    results: dict = {}
    waiting = list(refs)
    while waiting:
        [ready], waiting = ray.wait(waiting, num_returns=1)
        try:
            results[ready] = ray.get(ready)
        except Exception as first:  # noqa: BLE001 - re-raised (or a better one) below
            if telling(first) or not waiting:
                raise
            done, _ = ray.wait(waiting, num_returns=len(waiting), timeout=grace)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception as e:  # noqa: BLE001
                    if telling(e):
                        raise e from None
            raise
    return [results[r] for r in refs]


class ActorStartFailed(ApplianceError):
    """An actor's __init__ raised a user error (a worker that cannot read the data, say)."""


_RAISED = re.compile(r"^([A-Za-z_][\w.]*\.)?([A-Za-z_]\w*): ", re.MULTILINE)


def unrecoverable(error: BaseException) -> BaseException | None:
    """What to raise instead of retrying `error`: the user error in its chain, or the user error
    an actor's __init__ raised (Ray passes that one on only as text); None when a restart may
    help. Retrying either would fail the same way every time."""
    from ray.exceptions import RayActorError

    chain = cause_chain(error)
    user = next((c for c in chain if isinstance(c, ApplianceError)), None)
    if user is not None:
        return user
    died = next((c for c in chain if isinstance(c, RayActorError) and c.actor_init_failed), None)
    if died is None:
        return None
    text = str(died)
    for m in reversed(list(_RAISED.finditer(text))):  # the traceback's last "module.Error: "
        module, name = (m.group(1) or "").rstrip("."), m.group(2)
        try:
            cls = getattr(importlib.import_module(module), name) if module else None
        except ImportError:
            cls = None
        if isinstance(cls, type) and issubclass(cls, ApplianceError):
            return ActorStartFailed(text[m.end() :].strip())
        if isinstance(cls, type) and issubclass(cls, BaseException):
            break
    return died  # a bug in __init__: raise it with Ray's traceback text, don't retry
