#!/usr/bin/env python3
"""An external job worker for pg_outbox, in Python with psycopg 3 (3.1 or later).

    DATABASE_URL=postgresql://app@db.example.com/app python3 worker.py QUEUE [--exit-after N] [--poll SECONDS]

It claims the jobs of one queue, ten at a time, runs handle() on each and completes it, or fails
it when handle() raises (pg_outbox retries it later with back-off, up to its max_attempts). When
the queue is empty it sleeps until a pg_outbox background worker says that the queue has jobs
(NOTIFY outbox_jobs, '<queue>'), or for --poll seconds at most, in case a notification was missed.
On SIGTERM or SIGINT it finishes the job in hand and exits 0.

DATABASE_URL is a libpq connection string, URL or key=value; without it the PG* environment
variables apply (PGHOST, PGPORT, PGUSER, PGDATABASE, ...).
"""

import argparse
import json
import os
import select
import signal
import socket
import sys
import time

import psycopg
from psycopg.rows import dict_row

BATCH = 10
# The lease: a job that is neither completed nor failed within it (the worker died) is claimed
# again. handle() must finish well within it, or extend it with outbox.extend(id, interval).
CLAIM = "SELECT id, queue, payload, attempts FROM outbox.claim(%s, %s, '30 seconds')"

stopping = False


def handle(job):
    """Does one job's work: replace this with yours. Raise to fail the job."""
    line = {"queue": job["queue"], "job": job["id"], "payload": job["payload"]}
    print(json.dumps(line), flush=True)


def on_signal(signum, frame):
    global stopping
    stopping = True


def run(conn, job):
    """Runs handle(job), then completes or fails the job. Returns whether it completed."""
    try:
        handle(job)
    except Exception as error:
        state = conn.execute("SELECT outbox.fail(%s, %s) AS state", (job["id"], str(error))).fetchone()["state"]
        # state is 'waiting' (to be retried) or 'dead' (out of attempts: see outbox.dead_jobs).
        print(f"job {job['id']} failed ({state}): {error!r}", file=sys.stderr, flush=True)
        return False
    done = conn.execute("SELECT outbox.complete(%s) AS done", (job["id"],)).fetchone()["done"]
    if not done:
        print(f"job {job['id']} was not completed: its lease had lapsed", file=sys.stderr, flush=True)
    return done


def main():
    parser = argparse.ArgumentParser(description="Works the jobs of a pg_outbox queue.")
    parser.add_argument("queue")
    parser.add_argument("--exit-after", type=int, metavar="N", help="exit 0 after completing N jobs")
    parser.add_argument("--poll", type=float, default=60.0, metavar="SECONDS",
                        help="claim at least this often, even without a notification (default 60)")
    args = parser.parse_args()
    if args.exit_after is not None and args.exit_after < 1:
        parser.error("--exit-after must be at least 1")
    if not args.poll > 0:
        parser.error("--poll must be above 0")

    # A signal only sets `stopping`: the job in hand runs to its end. Python restarts a select()
    # that a signal interrupts, so the signal also writes a byte to `wakeup`, which the wait below
    # watches: the worker stops at once when it is idle.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    wakeup, wakeup_writer = socket.socketpair()
    wakeup_writer.setblocking(False)
    signal.set_wakeup_fd(wakeup_writer.fileno())

    # Autocommit: the claim commits at once, and no transaction stays open while a job runs.
    with psycopg.connect(os.environ.get("DATABASE_URL", ""), autocommit=True, row_factory=dict_row) as conn:
        notified = False

        def on_notify(notification):
            nonlocal notified
            if notification.payload == args.queue:  # other queues' notifications are not ours
                notified = True

        # psycopg 3.1 passes the notifications that arrive while it runs a query (any query) to
        # this handler, and only there: conn.notifies() would never see them.
        conn.add_notify_handler(on_notify)
        conn.execute("LISTEN outbox_jobs")

        def wait_for_notification(seconds):
            deadline = time.monotonic() + seconds
            while not notified and not stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                readable, _, _ = select.select([conn, wakeup], [], [], left)
                if conn in readable:
                    # Something arrived. psycopg reads it, and calls on_notify, when it runs a
                    # query: a trivial one will do (conn.notifies() of psycopg 3.1 has no timeout).
                    conn.execute("SELECT 1")

        completed = 0
        while not stopping:
            # Cleared before the claim: a notification that comes in from here on may be for jobs
            # this claim does not see, so it must cut the wait below short.
            notified = False
            jobs = conn.execute(CLAIM, (args.queue, BATCH)).fetchall()
            for job in jobs:
                if run(conn, job):
                    completed += 1
                if args.exit_after is not None and completed >= args.exit_after:
                    return 0
                if stopping:
                    # The jobs claimed but not started are claimed again when their lease lapses.
                    break
            if not jobs:
                # Returns at once if a notification for our queue came in during the claim.
                wait_for_notification(args.poll)
    return 0


if __name__ == "__main__":
    sys.exit(main())
