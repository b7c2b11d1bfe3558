"""Stop a Ray cluster's jobs gracefully and wait until they have stopped.

On Kubernetes, `appliance train` runs as a Ray job on the chart's RayCluster. Ray's job supervisor
stops a job by sending SIGTERM to its driver, which finishes the step in flight, writes a
checkpoint and exits 130; the supervisor SIGKILLs the driver `RAY_JOB_STOP_WAIT_TIME_S` after the
SIGTERM (Ray's default: 3 s, far too short for a step of a large model; the chart sets it to
`gracefulStopSeconds`). Two things need more than that setting:

- A pod being deleted (a redeploy that recreates the pods, a node drain, `make destroy`) signals
  no driver: the driver is a child of the job supervisor, not the container's PID 1. Each pod's
  preStop hook runs this module, which asks the head to stop every running job and waits until
  they have stopped; Kubernetes keeps the pod (and so the run's trainers and weight store) up
  meanwhile, for up to the pod's terminationGracePeriodSeconds.
- `make deploy REPLACE_RUNNING=1` and `make destroy` run it in the head pod before they delete
  the RayJob or the release, so the run's last steps are checkpointed first.

    python -m appliance.cluster.jobstop [--address http://127.0.0.1:8265] [--timeout SECONDS]
                                [--say-every SECONDS]

Exit status: 0 when no job is left running (none was, or each has stopped; a dashboard that does
not answer means there is no cluster left to stop), 1 when the timeout passed first, 2 when
Ray's token authentication stops it: the dashboard refused this process's token, or
RAY_AUTH_MODE=token here with no token set (KubeRay's `authOptions: {mode: token}` sets
RAY_AUTH_MODE and RAY_AUTH_TOKEN in every Ray container, so the pods' hooks and `kubectl exec`
into a Ray pod have them).
Uses Ray's job REST API only (ray.job_submission): it never joins the cluster.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from appliance.cluster.auth import HOW, local_token_problem, what_was_sent

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
# Ray's own default for RAY_JOB_STOP_WAIT_TIME_S (ray/dashboard/modules/job/job_supervisor.py)
RAY_DEFAULT_STOP_WAIT_S = 3
# beyond the supervisor's wait: the driver's exit and the job's status reaching the dashboard
MARGIN_S = 30
POLL_S = 2.0
# a line at least this often while waiting: `kubectl exec` (make deploy, make destroy) shows
# progress, and its stream never sits idle long enough for a load balancer to drop it
SAY_EVERY_S = 30.0


def default_timeout() -> float:
    """The supervisor's wait before it SIGKILLs a stopped driver, plus a margin: past that no
    job can still be stopping."""
    wait = os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", "")
    try:
        seconds = float(wait) if wait else RAY_DEFAULT_STOP_WAIT_S
    except ValueError:
        seconds = RAY_DEFAULT_STOP_WAIT_S
    return seconds + MARGIN_S


def stop_jobs(address: str, timeout: float, say=print, say_every: float = SAY_EVERY_S) -> bool:
    """Ask the cluster at `address` to stop each job that has not ended, then wait (up to
    `timeout` seconds, saying which jobs it waits for every `say_every` seconds) until every job
    has ended. True when none is left running."""
    from ray.job_submission import JobSubmissionClient

    try:
        client = JobSubmissionClient(address)
        jobs = client.list_jobs()
    except (ConnectionError, RuntimeError) as e:
        say(f"no Ray dashboard answers at {address} ({e}): no job to stop")
        return True
    waiting = set()
    for job in jobs:
        if job.status.is_terminal():
            continue
        if not job.submission_id:
            # a driver that connected by itself (`ray.init(address=...)`), not a submitted job:
            # the job API can neither stop it nor tell when it would
            say(f"job {job.job_id}: {job.status.value}, not a submitted job: left alone")
            continue
        say(f"job {job.submission_id}: {job.status.value}; stopping it ({job.entrypoint})")
        try:
            client.stop_job(job.submission_id)
        except RuntimeError as e:  # it ended meanwhile, or the dashboard went away
            say(f"job {job.submission_id}: stop refused ({e})")
        waiting.add(job.submission_id)
    if not waiting:
        say(f"no submitted job is running on the cluster at {address}")
        return True
    start = said = time.monotonic()
    while waiting:
        try:
            left = {
                j.submission_id: j.status.value
                for j in client.list_jobs()
                if j.submission_id in waiting and not j.status.is_terminal()
            }
        except (ConnectionError, RuntimeError) as e:
            say(f"the dashboard at {address} stopped answering ({e}): nothing left to wait for")
            return True
        for name in sorted(waiting - left.keys()):
            say(f"job {name}: ended after {time.monotonic() - start:.0f} s")
        waiting = set(left)
        if waiting and time.monotonic() - start >= timeout:
            still = ", ".join(f"{name} ({state})" for name, state in sorted(left.items()))
            say(f"still running after {timeout:.0f} s: {still}")
            return False
        if waiting and time.monotonic() - said >= say_every:
            still = ", ".join(f"{name} ({state})" for name, state in sorted(left.items()))
            say(f"waiting for {still}: {time.monotonic() - start:.0f} s so far")
            said = time.monotonic()
        if waiting:
            time.sleep(POLL_S)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m appliance.cluster.jobstop",
        description="Stop every running Ray job of a cluster (SIGTERM to its driver: the step in "
        "flight finishes and a checkpoint is written) and wait until they have ended.",
    )
    parser.add_argument(
        "--address",
        default=DEFAULT_ADDRESS,
        help=f"the Ray dashboard's address (default: {DEFAULT_ADDRESS}, the head's own)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for the jobs to end (default: RAY_JOB_STOP_WAIT_TIME_S + "
        f"{MARGIN_S}, the supervisor's wait before it kills a stopped driver)",
    )
    parser.add_argument(
        "--say-every",
        type=float,
        default=SAY_EVERY_S,
        help=f"seconds between the lines that say what it waits for (default: {SAY_EVERY_S:.0f})",
    )
    args = parser.parse_args(argv)
    timeout = default_timeout() if args.timeout is None else args.timeout
    say = lambda line: print(line, flush=True)  # noqa: E731 - a line at a time, to kubectl exec
    from ray.exceptions import AuthenticationError

    problem = local_token_problem()
    if problem:  # Ray's client would fail on it before asking the dashboard anything
        say(f"{problem}: {HOW} (kubectl exec into a Ray pod has them)")
        return 2
    try:
        ok = stop_jobs(args.address, timeout, say, args.say_every)
    except AuthenticationError:
        say(
            f"the Ray dashboard at {args.address} uses Ray's token authentication and refused "
            f"this process, which sent {what_was_sent()}: {HOW} (kubectl exec into a Ray pod "
            "has them)"
        )
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
