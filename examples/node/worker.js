#!/usr/bin/env node
// An external job worker for pg_outbox, in Node.js (18 or later) with node-postgres (pg 8).
//
//   DATABASE_URL=postgresql://app@db.example.com/app node worker.js QUEUE [--exit-after N] [--poll SECONDS]
//
// It claims the jobs of one queue, ten at a time, runs handle() on each and completes it, or
// fails it when handle() throws (pg_outbox retries it later with back-off, up to its
// max_attempts). When the queue is empty it sleeps until a pg_outbox background worker says that
// the queue has jobs (NOTIFY outbox_jobs, '<queue>'), or for --poll seconds at most, in case a
// notification was missed. On SIGTERM or SIGINT it finishes the job in hand and exits 0.
//
// DATABASE_URL is a postgresql:// URL (for a unix socket: postgresql://user@/db?host=/run/postgresql);
// without it pg reads PGHOST, PGPORT, PGUSER, PGDATABASE and PGPASSWORD.
'use strict';

const { parseArgs } = require('node:util');
const { Client } = require('pg');

const BATCH = 10;
// The lease: a job that is neither completed nor failed within it (the worker died) is claimed
// again. handle() must finish well within it, or extend it with outbox.extend(id, interval).
const CLAIM = "SELECT id, queue, payload, attempts FROM outbox.claim($1, $2, '30 seconds')";

// Does one job's work: replace this with yours. Throw (or reject) to fail the job.
async function handle(job) {
  // job.id is a bigint, which pg returns as a string so that it stays exact.
  const line = JSON.stringify({ queue: job.queue, job: Number(job.id), payload: job.payload });
  // Resolves once the line is written out.
  await new Promise((resolve, reject) => {
    process.stdout.write(line + '\n', (err) => (err ? reject(err) : resolve()));
  });
}

// Runs handle(job), then completes or fails the job. Resolves to whether it completed.
async function run(client, job) {
  try {
    await handle(job);
  } catch (err) {
    const error = err instanceof Error ? err.message : String(err);
    const { rows } = await client.query('SELECT outbox.fail($1, $2) AS state', [job.id, error]);
    // state is 'waiting' (to be retried) or 'dead' (out of attempts: see outbox.dead_jobs).
    console.error(`job ${job.id} failed (${rows[0].state}): ${error}`);
    return false;
  }
  const { rows } = await client.query('SELECT outbox.complete($1) AS done', [job.id]);
  if (!rows[0].done) {
    console.error(`job ${job.id} was not completed: its lease had lapsed`);
  }
  return rows[0].done;
}

const USAGE = 'usage: node worker.js QUEUE [--exit-after N] [--poll SECONDS]';

// The queue, --exit-after (null when not given) and --poll; throws on a bad command line.
function parseCommandLine(argv) {
  const { values, positionals } = parseArgs({
    args: argv,
    allowPositionals: true,
    options: {
      'exit-after': { type: 'string' }, // exit 0 after completing N jobs
      poll: { type: 'string', default: '60' }, // claim at least this often, even without a notification
    },
  });
  const exitAfter = values['exit-after'] === undefined ? null : Number(values['exit-after']);
  const pollSeconds = Number(values.poll);
  if (positionals.length !== 1) {
    throw new Error('one queue name expected');
  }
  if (exitAfter !== null && !(Number.isInteger(exitAfter) && exitAfter >= 1)) {
    throw new Error('--exit-after must be a whole number of jobs, at least 1');
  }
  if (!(pollSeconds > 0)) {
    throw new Error('--poll must be a number of seconds above 0');
  }
  return { queue: positionals[0], exitAfter, pollSeconds };
}

async function main() {
  let queue, exitAfter, pollSeconds;
  try {
    ({ queue, exitAfter, pollSeconds } = parseCommandLine(process.argv.slice(2)));
  } catch (err) {
    console.error(`${err.message}\n${USAGE}`);
    process.exitCode = 2;
    return;
  }

  let stopping = false;
  let notified = false;
  let wake = null; // ends the current wait, while there is one

  // A signal only sets `stopping`: the job in hand runs to its end; an idle worker stops at once.
  const stop = () => {
    stopping = true;
    if (wake) wake();
  };
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);

  // Resolves on a notification for our queue, a signal, or after `seconds`.
  const waitForNotification = (seconds) => {
    if (notified || stopping) {
      return Promise.resolve(); // it came in while we were claiming
    }
    return new Promise((resolve) => {
      const done = () => {
        clearTimeout(timer);
        wake = null;
        resolve();
      };
      const timer = setTimeout(done, seconds * 1000);
      wake = done;
    });
  };

  // One connection, not a pool: LISTEN belongs to a session. pg runs in autocommit unless told
  // BEGIN, so the claim commits at once and no transaction stays open while a job runs.
  const client = new Client({ connectionString: process.env.DATABASE_URL });
  client.on('error', (err) => {
    // The connection broke while idle. Exit non-zero: the supervisor restarts the worker.
    console.error(`connection lost: ${err.message}`);
    process.exit(1);
  });
  // pg emits notifications whenever they arrive, during a query or not.
  client.on('notification', (msg) => {
    if (msg.channel === 'outbox_jobs' && msg.payload === queue) { // other queues' are not ours
      notified = true;
      if (wake) wake();
    }
  });
  await client.connect();
  try {
    await client.query('LISTEN outbox_jobs');
    let completed = 0;
    while (!stopping) {
      // Cleared before the claim: a notification that comes in from here on may be for jobs
      // this claim does not see, so it must cut the wait below short.
      notified = false;
      const { rows: jobs } = await client.query(CLAIM, [queue, BATCH]);
      for (const job of jobs) {
        if (await run(client, job)) {
          completed += 1;
        }
        if (exitAfter !== null && completed >= exitAfter) {
          return;
        }
        if (stopping) {
          break; // the jobs claimed but not started are claimed again when their lease lapses
        }
      }
      if (jobs.length === 0) {
        await waitForNotification(pollSeconds);
      }
    }
  } finally {
    await client.end();
  }
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
