"""Ray, and the processes around it.

    start.py    start embedded Ray or join a cluster (the object store sized to /dev/shm and RAM:
                hardware/host.py measures them),
                where trainers go (trainer_slots, on_node), a shared --output check
    auth.py     Ray's token authentication: what a user is told about it
    exit.py     how an `appliance` process exits safely while Ray's threads still run
    jobstop.py  the Kubernetes preStop hook (`python -m appliance.cluster.jobstop`): stop the
                head's jobs gracefully before the pod goes

Nothing is imported here: `appliance` imports exit.py first thing, before torch, and Ray is
imported only inside the functions that start or join it.
"""

__all__ = ["auth", "exit", "jobstop", "start"]
