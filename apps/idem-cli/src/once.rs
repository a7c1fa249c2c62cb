//! `idem once`: run a command once per `(scope, key)`, across hosts.
//!
//! The first run executes the command (with `IDEM_OPERATION_ID` and
//! `IDEM_TAKEOVER` in its environment), streams its stdout and stderr through, stores its exit
//! status and its stdout, and exits with its status. A repeat prints the
//! stored stdout and exits with the stored status without running it.
//! Built on [`idem_once::Runner`]: the claim is fenced, and a run killed
//! with `kill -9` is taken over after its lease under the same operation id.

use std::ffi::OsString;
use std::io::Write;
use std::process::{ExitCode, Stdio};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use idem_core::{Policy, Store};
use idem_once::{Failure, Operation, Outcome, RunError, Runner};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;

/// The most stdout a run keeps for its replays.
pub(crate) const MAX_STDOUT: usize = 1 << 20;

/// How long stdout is still read once the command exited (a process it
/// left in the background may hold the pipe open for ever), not counting
/// the time spent writing it on to a slow reader: what the command wrote
/// before it exited is passed on and kept however slowly our own stdout is
/// read, never cut by that reader's pace.
const STDOUT_AFTER_EXIT: Duration = Duration::from_secs(1);

/// Exit statuses of `idem once` itself (sysexits.h), besides the command's.
pub(crate) mod exit {
    /// `--key` or `--scope` is malformed (EX_USAGE).
    pub(crate) const USAGE: u8 = 64;
    /// The key was used with another command line (EX_DATAERR).
    pub(crate) const KEY_REUSED: u8 = 65;
    /// The store cannot be reached (EX_UNAVAILABLE).
    pub(crate) const UNAVAILABLE: u8 = 69;
    /// Another host runs it, or this run lost its claim (EX_TEMPFAIL).
    pub(crate) const TEMPFAIL: u8 = 75;
    /// The command ran past its lease and was killed (as `timeout` does).
    pub(crate) const LEASE_RAN_OUT: u8 = 124;
    /// The command could not be started (as a shell says).
    pub(crate) const NOT_STARTED: u8 = 127;
}

/// `idem once`'s flags.
#[derive(Debug, Args)]
pub(crate) struct OnceArgs {
    /// `sqlite:FILE`, `postgres://…`, `mysql://…`, or `redis://…` (Redis
    /// alone). With a SQL URL, `--redis-url` puts Redis in front of it.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub(crate) database_url: String,
    /// PostgreSQL and MySQL: the schema (MySQL: the database) of the
    /// records table.
    #[arg(long)]
    pub(crate) schema: Option<String>,
    /// PostgreSQL and MySQL: the records table.
    #[arg(long, default_value = "idem_records")]
    pub(crate) table: String,
    /// Redis in front of the SQL database (tiered: the database decides).
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    pub(crate) redis_url: Option<String>,
    /// The prefix of idem's keys in Redis.
    #[arg(long, env = "IDEM_REDIS_PREFIX", default_value = "idem")]
    pub(crate) redis_prefix: String,
    /// The Redis URLs name a Redis Cluster (nodes comma-separated).
    #[arg(long, env = "IDEM_REDIS_CLUSTER")]
    pub(crate) redis_cluster: bool,
    /// Redis alone (`--database-url redis://…`): a claim counts only once
    /// this many replicas have it (`WAIT`), so that a failover does not
    /// forget a run and let another host start it again; fewer within
    /// `--redis-wait-timeout-ms` and nothing runs (exit 69). 0: do not
    /// wait.
    #[arg(long, env = "IDEM_REDIS_WAIT_REPLICAS", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=16))]
    pub(crate) redis_wait_replicas: u32,
    /// How long a claim waits for `--redis-wait-replicas`, in milliseconds.
    #[arg(long, env = "IDEM_REDIS_WAIT_TIMEOUT_MS", default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..=450))]
    pub(crate) redis_wait_timeout_ms: u64,
    /// The scope the key belongs to (a job family, a team).
    #[arg(long)]
    pub(crate) scope: String,
    /// The key: one per intended run, e.g. `nightly-report-2026-12-01`
    /// (1 to 255 visible ASCII characters).
    #[arg(long)]
    pub(crate) key: String,
    /// How long a run holds the key: a host that dies is taken over after
    /// it; a command still running when it ends is killed with its process
    /// group (exit 124). Set it above the longest run.
    #[arg(long, default_value_t = 600_000, value_parser = clap::value_parser!(u64).range(1..=86_400_000))]
    pub(crate) lease_ms: u64,
    /// How long a run's result is kept (and the key refused for others).
    #[arg(long, default_value_t = 86_400, value_parser = clap::value_parser!(u64).range(1..=31_536_000))]
    pub(crate) ttl_secs: u64,
    /// While another host runs it, wait up to this long for its result
    /// (then replay it); 0: exit 75 at once.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=86_400_000))]
    pub(crate) wait_ms: u64,
    /// Store a non-zero exit too: every repeat then gets it back instead
    /// of running again.
    #[arg(long)]
    pub(crate) store_failures: bool,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub(crate) command: Vec<OsString>,
}

/// One argument of the command line, as the fingerprint sees it: text, or
/// its bytes when it is not UTF-8 (never a lossy spelling, which could
/// make two command lines one).
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum Arg {
    Text(String),
    Bytes(Vec<u8>),
}

/// A command's stdout as stored: text, or bytes when it is not UTF-8.
#[derive(Debug, Serialize, Deserialize)]
#[serde(untagged)]
enum Captured {
    Text(String),
    Bytes(Vec<u8>),
}

/// What a run stores: its exit status and its stdout.
#[derive(Debug, Serialize, Deserialize)]
struct Ran {
    /// The exit status (a signal `n` is `128 + n`, as shells say).
    status: u8,
    /// Its stdout, if it was at most 1 MiB.
    stdout: Option<Captured>,
    /// How many bytes it wrote to stdout.
    stdout_bytes: u64,
}

impl Ran {
    fn stdout(&self) -> &[u8] {
        match &self.stdout {
            Some(Captured::Text(s)) => s.as_bytes(),
            Some(Captured::Bytes(b)) => b,
            None => &[],
        }
    }
}

/// Why the command did not give a result of its own.
#[derive(Debug, Serialize, Deserialize)]
enum NotRun {
    /// It could not be started.
    NotStarted(String),
    /// It ran past its lease and was killed.
    LeaseRanOut,
    /// `idem once` was told to stop (this signal): the command was killed.
    Stopped(i32),
    /// The claim took so long (a slow store) that less than half the lease
    /// was left (this many milliseconds): the command was not started,
    /// rather than be killed midway.
    ClaimSlow(u64),
}

/// The work's failure: a run that ended non-zero, or one that never gave
/// an exit status of its own.
#[derive(Debug, Serialize, Deserialize)]
enum Failed {
    Exited(Ran),
    NotRun(NotRun),
}

/// Runs `idem once`.
pub(crate) async fn once(args: OnceArgs) -> Result<ExitCode, crate::Failure> {
    // The library's warnings (a release that failed, so the key stays held
    // until its lease ends) reach stderr, plain (cron mails it), without
    // sqlx's slow-statement notes; `RUST_LOG` widens them.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,sqlx=error")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .without_time()
        .try_init();
    // Every message goes out with the URLs' secrets masked: a store's
    // error may quote what it was given.
    let secrets = args.secrets();
    let say = |message: String| eprintln!("idem once: {}", crate::scrub(&message, &secrets));
    // What is wrong with the command line is said before any connection,
    // whether or not the store answers.
    if let Err(why) = idem_once::check_run_key(&args.scope, &args.key) {
        say(format!("invalid --key or --scope: {why}"));
        return Ok(ExitCode::from(exit::USAGE));
    }
    if let Some(problem) = crate::target_problem(&target(&args)) {
        say(problem);
        return Ok(ExitCode::from(exit::USAGE));
    }
    let mut policy = Policy::builder()
        .lease(Duration::from_millis(args.lease_ms))
        .retention(crate::retention_above_lease(
            "idem once",
            args.ttl_secs,
            args.lease_ms,
        ));
    if args.wait_ms > 0 {
        policy = policy.wait_for_in_flight(Duration::from_millis(args.wait_ms));
    }
    let policy = policy.build()?;
    let store = match open(&args).await {
        Ok(store) => store,
        Err(e) => {
            say(format!("the store is unavailable; nothing ran: {e}"));
            return Ok(ExitCode::from(exit::UNAVAILABLE));
        }
    };
    // A store that stops answering (a partition) fails each call within
    // the policy's time limit, rather than hanging the run.
    let store: Arc<dyn Store> =
        Arc::new(idem_once::BoundedStore::new(store, policy.store_timeout()));
    let runner = Runner::new(store, policy);
    let input: Vec<Arg> = args
        .command
        .iter()
        .map(|a| match a.to_str() {
            Some(s) => Arg::Text(s.to_owned()),
            None => Arg::Bytes(a.as_encoded_bytes().to_vec()),
        })
        .collect();
    let store_failures = args.store_failures;
    let command = &args.command;
    let lease = Duration::from_millis(args.lease_ms);
    let signals = match Signals::watch() {
        Ok(signals) => signals,
        Err(e) => {
            say(format!("cannot watch signals, so nothing is run: {e}"));
            return Ok(ExitCode::from(exit::NOT_STARTED));
        }
    };
    let progress = Progress::default();
    let run = runner.run(&args.scope, &args.key, &input, async |op| {
        execute(op, command, store_failures, &progress, lease).await
    });
    let result = match until_stopped(run, &progress, signals).await {
        Ok(result) => result,
        Err(number) => {
            let status = progress.status.load(Ordering::SeqCst);
            let stopped = u8::try_from(128 + number).unwrap_or(1);
            progress.kill_leftovers(stopped);
            say(match progress.phase.load(Ordering::SeqCst) {
                Progress::BEFORE => format!(
                    "stopped by signal {number} before the command started; nothing ran (a claim already made frees after its lease, {} ms)",
                    args.lease_ms
                ),
                _ => format!(
                    "stopped by signal {number} after the command ended (exit status {status}), while its result was being stored or its key released: neither may be done, and then a run after the lease ({} ms) runs the command again (what it left running in its process group was killed)",
                    args.lease_ms
                ),
            });
            return Ok(ExitCode::from(stopped));
        }
    };
    if let Err(RunError::NotStored(_) | RunError::LeaseLost) = &result {
        progress.kill_leftovers(exit::TEMPFAIL);
    }
    Ok(ExitCode::from(match result {
        Ok(Outcome::Fresh(ran)) => ran.status,
        Ok(Outcome::Replayed(ran)) => replay(&args, &ran, "succeeded"),
        Err(RunError::Final {
            error: Failed::Exited(ran),
            replayed: true,
        }) => replay(&args, &ran, "failed (stored with --store-failures)"),
        Err(RunError::Final {
            error: Failed::Exited(ran),
            replayed: false,
        }) => ran.status,
        Err(RunError::Failed(Failed::Exited(ran))) => {
            say(format!(
                "the command exited {}; the key is released, so the next run executes it again (--store-failures keeps a failure)",
                ran.status
            ));
            ran.status
        }
        Err(RunError::Failed(Failed::NotRun(NotRun::NotStarted(e))))
        | Err(RunError::Final {
            error: Failed::NotRun(NotRun::NotStarted(e)),
            ..
        }) => {
            say(format!("cannot start {:?}: {e}", command[0]));
            exit::NOT_STARTED
        }
        Err(RunError::Failed(Failed::NotRun(NotRun::LeaseRanOut)))
        | Err(RunError::Final {
            error: Failed::NotRun(NotRun::LeaseRanOut),
            ..
        }) => {
            say(format!(
                "the command ran past its lease ({} ms) and was killed, so that no other host runs it beside this one; raise --lease-ms above its longest run",
                args.lease_ms
            ));
            exit::LEASE_RAN_OUT
        }
        Err(RunError::Failed(Failed::NotRun(NotRun::Stopped(number))))
        | Err(RunError::Final {
            error: Failed::NotRun(NotRun::Stopped(number)),
            ..
        }) => {
            say(format!(
                "stopped by signal {number}: the command's process group was killed and the key released"
            ));
            u8::try_from(128 + number).unwrap_or(1)
        }
        Err(RunError::Failed(Failed::NotRun(NotRun::ClaimSlow(left))))
        | Err(RunError::Final {
            error: Failed::NotRun(NotRun::ClaimSlow(left)),
            ..
        }) => {
            say(format!(
                "the store took so long to claim the key that {left} ms of the lease ({} ms) were left, less than half: the command was not started, and the key is released for the next run",
                args.lease_ms
            ));
            exit::TEMPFAIL
        }
        Err(RunError::KeyReused) => {
            say(format!(
                "refused: key {:?} (scope {:?}) was used with another command line; nothing ran",
                args.key, args.scope
            ));
            exit::KEY_REUSED
        }
        Err(RunError::InFlight { retry_after }) => {
            say(format!(
                "another run holds key {:?} (scope {:?}); nothing ran. Retry in {} s, or wait for it with --wait-ms",
                args.key,
                args.scope,
                retry_after.as_secs().max(1)
            ));
            exit::TEMPFAIL
        }
        Err(RunError::LeaseLost) => {
            say("this run's lease ran out and another run took the key over; its result stands, not this one's".to_owned());
            exit::TEMPFAIL
        }
        Err(RunError::InvalidKey(why)) => {
            say(format!("invalid --key or --scope: {why}"));
            exit::USAGE
        }
        Err(RunError::Unavailable(e)) => {
            say(format!(
                "the store is unavailable; nothing ran: {}",
                crate::chain(&e)
            ));
            exit::UNAVAILABLE
        }
        Err(RunError::NotStored(why)) => {
            say(format!(
                "the command ran but its result was not stored ({why}); a run after the lease ({} ms) takes it over",
                args.lease_ms
            ));
            exit::TEMPFAIL
        }
        Err(RunError::Decode(why)) => {
            say(format!(
                "the record under key {:?} is not an `idem once` result: {why}",
                args.key
            ));
            exit::KEY_REUSED
        }
        Err(other) => {
            say(format!("{other:?}"));
            exit::TEMPFAIL
        }
    }))
}

/// Where a run stands, for the signals `until_stopped` watches, and the
/// signal it passes on to the command's watch.
#[derive(Default)]
struct Progress {
    /// [`Self::BEFORE`], [`Self::RUNNING`] or [`Self::AFTER`].
    phase: AtomicU8,
    /// The command's exit status, once it ended (killed: the status said).
    status: AtomicU8,
    /// A signal passed on while the command ran and not acted on yet (0:
    /// none).
    signal: AtomicI32,
    stop: tokio::sync::Notify,
    /// Told when the phase becomes [`Self::AFTER`].
    after: tokio::sync::Notify,
    /// The command's process group, once it started (0: none).
    group: AtomicU32,
}

impl Progress {
    /// The command has not started: stopping drops the run.
    const BEFORE: u8 = 0;
    /// The command runs: a signal is passed on to it (killed, the key
    /// released).
    const RUNNING: u8 = 1;
    /// The command ended (by itself or killed): its result is stored or
    /// its key released.
    const AFTER: u8 = 2;

    /// The command ended with `status`.
    fn ended(&self, status: u8) {
        self.status.store(status, Ordering::SeqCst);
        self.phase.store(Self::AFTER, Ordering::SeqCst);
        self.after.notify_one();
    }

    /// Kills what the command left running in its process group (once:
    /// the group is forgotten), when its key is let go, or left to its
    /// lease with its result not stored: another run then executes the
    /// command, and nothing of this one may run beside it. (A stored result
    /// ends the key: what the command left running then is its own
    /// business.)
    fn kill_leftovers(&self, status: u8) {
        match self.group.swap(0, Ordering::SeqCst) {
            0 => {}
            group => kill_group(Some(group), status),
        }
    }

    /// The signal passed on, once one is, taken (acted on).
    async fn stopped(&self) -> i32 {
        loop {
            let number = self.signal.swap(0, Ordering::SeqCst);
            if number != 0 {
                return number;
            }
            self.stop.notified().await;
        }
    }
}

/// How long a run whose command ended is let finish (a result stored, a
/// key released: a store call or two) once a signal says stop.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// The signals that stop a job (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1,
/// SIGUSR2, SIGALRM), watched from before the claim to the end: `idem once`
/// does not die of one with the command still running in its own process
/// group (another host would start it beside it once the lease ran out).
/// Others that end a process (SIGKILL, which cannot be watched; SIGPROF,
/// SIGXCPU and their kind) are not.
///
/// The terminal's stop (SIGTSTP, Ctrl-Z) is caught and not acted on:
/// `idem once` stopped, its command (in a group of its own, so not stopped
/// with it) would run on past the lease with nothing watching it, beside
/// the run another host then starts. (SIGTTIN and SIGTTOU are left alone:
/// caught, a background write to a terminal with `tostop` would be
/// restarted and signalled again for ever.)
struct Signals {
    watched: Vec<(tokio::signal::unix::Signal, i32)>,
    _not_stopped: Vec<tokio::signal::unix::Signal>,
}

impl Signals {
    fn watch() -> std::io::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        // Caught (a handler replaces the default, which would stop this
        // process), never read: nothing happens. A command started after
        // gets the default back (handlers do not survive `exec`).
        let not_stopped = vec![signal(SignalKind::from_raw(
            rustix::process::Signal::TSTP.as_raw(),
        ))?];
        let kinds = [
            SignalKind::terminate(),
            SignalKind::interrupt(),
            SignalKind::hangup(),
            SignalKind::quit(),
            SignalKind::user_defined1(),
            SignalKind::user_defined2(),
            SignalKind::alarm(),
        ];
        let watched = kinds
            .into_iter()
            .map(|kind| Ok((signal(kind)?, kind.as_raw_value())))
            .collect::<std::io::Result<_>>()?;
        Ok(Self {
            watched,
            _not_stopped: not_stopped,
        })
    }

    /// The next one's number.
    async fn next(&mut self) -> i32 {
        std::future::poll_fn(|cx| {
            for (signal, number) in &mut self.watched {
                if signal.poll_recv(cx).is_ready() {
                    return std::task::Poll::Ready(*number);
                }
            }
            std::task::Poll::Pending
        })
        .await
    }
}

/// Runs `run` to its end, the only watcher of `signals`, each acted on
/// once: before the command starts, `run` is dropped (nothing ran) and the
/// signal's number returned; while it runs, the signal is passed on to
/// `execute`, which kills the command and lets the run release the key;
/// after it ended, `run` gets [`STOP_GRACE`] to finish (its result stored
/// or its key released), then is dropped.
async fn until_stopped<F: std::future::Future>(
    run: F,
    progress: &Progress,
    mut signals: Signals,
) -> Result<F::Output, i32> {
    let mut run = std::pin::pin!(run);
    loop {
        let number = tokio::select! {
            output = &mut run => return Ok(output),
            number = signals.next() => number,
            // The command ended just as a signal was passed on to it,
            // which it did not act on: that signal is this one's now.
            () = progress.after.notified() => match progress.signal.swap(0, Ordering::SeqCst) {
                0 => continue,
                number => number,
            },
        };
        match progress.phase.load(Ordering::SeqCst) {
            Progress::BEFORE => return Err(number),
            Progress::RUNNING => {
                // The first signal not yet acted on stands (its number is
                // the exit status); a later one adds nothing.
                let _ =
                    progress
                        .signal
                        .compare_exchange(0, number, Ordering::SeqCst, Ordering::SeqCst);
                progress.stop.notify_one();
            }
            _ => {
                return tokio::time::timeout(STOP_GRACE, &mut run)
                    .await
                    .map_err(|_| number)
            }
        }
    }
}

/// Prints a stored run's stdout and says on stderr that it was replayed.
fn replay(args: &OnceArgs, ran: &Ran, how: &str) -> u8 {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(ran.stdout()).and_then(|()| out.flush());
    let kept = if ran.stdout.is_none() && ran.stdout_bytes > 0 {
        format!(
            "; its stdout ({} bytes, over 1 MiB) was not kept and is not replayed",
            ran.stdout_bytes
        )
    } else {
        String::new()
    };
    eprintln!(
        "idem once: replayed: key {:?} (scope {:?}) already ran and {how}; not run again, exit status {}{kept}",
        args.key, args.scope, ran.status
    );
    ran.status
}

/// Runs the command under `op`, streaming its output through.
///
/// The command runs in a process group of its own. At the end of its lease
/// (less a margin, on this process's clock), or when `idem once` is told to
/// stop (one of the signals [`Signals`] watches), the whole group is killed
/// before the key is let go: no host runs it beside another.
async fn execute(
    op: &Operation<'_, Arc<dyn Store>>,
    command: &[OsString],
    store_failures: bool,
    progress: &Progress,
    lease: Duration,
) -> Result<Ran, Failure<Failed>> {
    use tokio::io::AsyncWriteExt;

    let fail = |f: Failed| {
        if store_failures {
            Failure::Final(f)
        } else {
            Failure::Retry(f)
        }
    };
    let not_run = |n: NotRun| Failure::Retry(Failed::NotRun(n));
    let Some((program, rest)) = command.split_first() else {
        return Err(not_run(NotRun::NotStarted("no command".into())));
    };
    // A claim that took most of the lease (a store slow to answer, a lock
    // waited on) leaves the command too little time: it would be killed
    // midway, its work half done. It is not started, and the key is let go
    // for the next run.
    let left = op.lease_left();
    if left < lease / 2 {
        return Err(not_run(NotRun::ClaimSlow(
            u64::try_from(left.as_millis()).unwrap_or(u64::MAX),
        )));
    }
    // From here a signal is passed on to this function (which kills the
    // command, then lets the key go) rather than dropping the run.
    progress.phase.store(Progress::RUNNING, Ordering::SeqCst);
    // The command runs in a process group of its own, which is not the
    // terminal's foreground group: reading a terminal would stop it (until
    // its lease ran out). A terminal is not passed on: reading stdin, it
    // finds the end at once.
    let stdin = if std::io::IsTerminal::is_terminal(&std::io::stdin()) {
        Stdio::null()
    } else {
        Stdio::inherit()
    };
    let mut child = tokio::process::Command::new(program)
        .args(rest)
        .env("IDEM_OPERATION_ID", op.id().to_string())
        // 1 when an earlier run of this key was killed, ran out of its
        // lease, failed or let the key go unstarted: the command may find
        // its work begun.
        .env("IDEM_TAKEOVER", if op.is_takeover() { "1" } else { "0" })
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| not_run(NotRun::NotStarted(e.to_string())))?;
    let group = child.id();
    progress.group.store(group.unwrap_or(0), Ordering::SeqCst);
    let margin = (op.lease_left() / 10).min(Duration::from_secs(1));
    let lease = op.lease_left().saturating_sub(margin);
    let mut stdout = child.stdout.take();
    let mut captured = Vec::new();
    let mut total: u64 = 0;
    // The time the copy has spent writing on to our stdout: the write
    // under way since when, and the writes done, in all.
    let writes = std::sync::Mutex::new((None::<tokio::time::Instant>, Duration::ZERO));
    let mark = |writing: bool| {
        let now = tokio::time::Instant::now();
        let mut w = writes.lock().unwrap_or_else(|e| e.into_inner());
        match (writing, w.0.take()) {
            (true, _) => w.0 = Some(now),
            (false, Some(since)) => w.1 += now - since,
            (false, None) => {}
        }
    };
    let written_for = || {
        let w = writes.lock().unwrap_or_else(|e| e.into_inner());
        w.1 + w.0.map_or(Duration::ZERO, |since| since.elapsed())
    };
    let copy = async {
        let Some(pipe) = stdout.as_mut() else {
            return;
        };
        let mut out = tokio::io::stdout();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match pipe.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            mark(true);
            let chunk = &buf[..n];
            // A reader that went away does not stop the command's output
            // from being kept.
            let _ = out.write_all(chunk).await;
            let _ = out.flush().await;
            mark(false);
            total += n as u64;
            if captured.len() <= MAX_STDOUT {
                captured.extend_from_slice(chunk);
            }
        }
    };
    let deadline = tokio::time::Instant::now() + lease;
    let status = {
        let mut copy = std::pin::pin!(copy);
        let mut copied = false;
        // Until the command exits, its lease and a stop are watched; the
        // end of its stdout alone ends nothing (a process it left running
        // in the background may hold the pipe open long after).
        let status = loop {
            tokio::select! {
                // The exit first: one seen as the lease ends stands.
                biased;
                status = child.wait() => break status,
                () = &mut copy, if !copied => copied = true,
                () = tokio::time::sleep_until(deadline) => {
                    progress.kill_leftovers(exit::LEASE_RAN_OUT);
                    progress.ended(exit::LEASE_RAN_OUT);
                    return Err(not_run(NotRun::LeaseRanOut));
                }
                number = progress.stopped() => {
                    let status = u8::try_from(128 + number).unwrap_or(1);
                    // Its output is still read while the group ends: a
                    // command that writes as it stops would otherwise
                    // block on a full pipe and be killed mid-cleanup.
                    // Not past the stop: a process that left the group
                    // may hold the pipe open for long after.
                    let mut stop = std::pin::pin!(stop_group(&mut child, group, status, deadline));
                    loop {
                        tokio::select! {
                            () = &mut stop => break,
                            () = &mut copy, if !copied => copied = true,
                        }
                    }
                    progress.group.store(0, Ordering::SeqCst);
                    progress.ended(status);
                    return Err(not_run(NotRun::Stopped(number)));
                }
            }
        };
        let status = status.map_err(|e| {
            // Its status unknown, the key let go: nothing it started may
            // run on.
            progress.kill_leftovers(exit::NOT_STARTED);
            progress.ended(exit::NOT_STARTED);
            not_run(NotRun::NotStarted(e.to_string()))
        })?;
        // It exited: its status stands, whatever comes now (a signal is
        // then given the time to store it). What is already in the pipe is
        // read for a moment more, never past the lease, then the pipe is
        // let go.
        progress.ended(exit_status(status));
        // Until the pipe ends, or `STDOUT_AFTER_EXIT` has passed beside
        // the time spent writing to a slow reader; never into the part of
        // the lease kept for storing the result (a quarter of it, at most
        // 10 s): a reader that never reads must not leave the result too
        // little time to be stored before another host may take the key.
        let (exited, written_before) = (tokio::time::Instant::now(), written_for());
        let reserve = (lease / 4).min(Duration::from_secs(10));
        let read_until = deadline.checked_sub(reserve).unwrap_or(exited);
        while !copied {
            let used = exited
                .elapsed()
                .saturating_sub(written_for().saturating_sub(written_before));
            let left = STDOUT_AFTER_EXIT.saturating_sub(used);
            let now = tokio::time::Instant::now();
            if left.is_zero() || now >= read_until {
                break;
            }
            tokio::select! {
                () = &mut copy => copied = true,
                () = tokio::time::sleep_until((now + left).min(read_until)) => {}
            }
        }
        status
    };
    let code = exit_status(status);
    let stdout = (captured.len() <= MAX_STDOUT).then(|| match String::from_utf8(captured) {
        Ok(text) => Captured::Text(text),
        Err(e) => Captured::Bytes(e.into_bytes()),
    });
    let ran = Ran {
        status: code,
        stdout,
        stdout_bytes: total,
    };
    if code == 0 {
        Ok(ran)
    } else {
        // The key is let go (unless failures are stored): whatever the
        // command left running in its group (`worker &`) must not run on
        // beside the next run's.
        if !store_failures {
            progress.kill_leftovers(code);
        }
        Err(fail(Failed::Exited(ran)))
    }
}

/// How long the command's group is given to end once `idem once` is told
/// to stop, between SIGTERM and SIGKILL: time for a command that passes the
/// signal on (`docker run` to its container) to do so, well within the
/// stop time-outs of supervisors (`docker stop`'s 10 s).
const TERM_GRACE: Duration = Duration::from_secs(3);

/// Stops the command's process group: SIGTERM (after SIGCONT, so that a
/// stopped member acts on it), then, once the whole group has ended or
/// [`TERM_GRACE`] (never past `deadline`, the lease's end less its margin)
/// has passed, SIGKILL to whatever is left of it. The group, not the
/// command alone: a script dies of the SIGTERM at once, while what it
/// started (`docker run` passing the signal on to its container) is still
/// ending. A signal that comes during the grace does not cut it short: one
/// stop is often delivered twice (`timeout` signals its child, then its own
/// process group).
async fn stop_group(
    child: &mut tokio::process::Child,
    group: Option<u32>,
    status: u8,
    deadline: tokio::time::Instant,
) {
    if let Some(pid) = group
        .and_then(|g| i32::try_from(g).ok())
        .and_then(rustix::process::Pid::from_raw)
    {
        use rustix::process::{kill_process_group, Signal};
        // A failure here is met by the SIGKILL below, which says so.
        // SIGCONT first: a member still stopped when the command (the
        // group's leader) dies of the SIGTERM would make the group an
        // orphaned one with a stopped member, which the kernel sends
        // SIGHUP, killing it before it acts on the SIGTERM.
        let _ = kill_process_group(pid, Signal::CONT);
        let _ = kill_process_group(pid, Signal::TERM);
        let until = deadline.min(tokio::time::Instant::now() + TERM_GRACE);
        let ended = async {
            // The command reaped as it exits (a zombie still counts as one
            // of the group), then the rest of the group watched until
            // none is left (`ESRCH`). Another answer (`EPERM`: a member
            // this user may not signal) is left to the SIGKILL, which says
            // so.
            let _ = child.wait().await;
            loop {
                match rustix::process::test_kill_process_group(pid) {
                    Ok(()) => reap_orphans(pid),
                    Err(rustix::io::Errno::SRCH) => return true,
                    Err(_) => return false,
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        if matches!(tokio::time::timeout_at(until, ended).await, Ok(true)) {
            // None is left: nothing to kill, and the group's id may be a
            // new process's by now.
            return;
        }
    }
    kill_group(group, status);
}

/// Reaps the members of the command's group `pid` that ended and are this
/// process's children: none, unless `idem once` is PID 1 (a container's
/// entrypoint) or a subreaper, to which the members the command orphaned
/// (`(worker &)`) are handed. Unreaped, their zombies would count as
/// members still running until the grace ran out. (The command itself is
/// reaped by its own wait, before this is called.)
fn reap_orphans(pid: rustix::process::Pid) {
    use rustix::process::{waitid, WaitId, WaitIdOptions};
    let ended = WaitIdOptions::EXITED | WaitIdOptions::NOHANG;
    while let Ok(Some(_)) = waitid(WaitId::Pgid(Some(pid)), ended) {}
}

/// The exit status a shell would report: the command's code, or 128 plus
/// the signal that ended it.
fn exit_status(status: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    let code = status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
    u8::try_from(code & 0xff).unwrap_or(1)
}

/// Kills the command's process group (the command and whatever it
/// started). If that fails, `idem once` exits with `status` at once,
/// without letting the key go: the key is left to its lease, as after a
/// crash, so that no other host starts the command beside what may still
/// run here.
fn kill_group(group: Option<u32>, status: u8) {
    let Some(pid) = group
        .and_then(|g| i32::try_from(g).ok())
        .and_then(rustix::process::Pid::from_raw)
    else {
        return;
    };
    match rustix::process::kill_process_group(pid, rustix::process::Signal::KILL) {
        // ESRCH: no process is left in the group; nothing runs.
        Ok(()) | Err(rustix::io::Errno::SRCH) => {}
        Err(e) => {
            eprintln!(
                "idem once: could not kill process group {pid} ({e}); the key is left held until its lease ends. Kill the group by hand"
            );
            std::process::exit(i32::from(status));
        }
    }
}

impl OnceArgs {
    /// The secrets of its URLs, for [`crate::scrub`].
    pub(crate) fn secrets(&self) -> Vec<String> {
        target(self).secrets()
    }
}

/// The store `args` name.
fn target(args: &OnceArgs) -> crate::Target {
    crate::Target {
        database_url: args.database_url.clone(),
        schema: args.schema.clone(),
        table: args.table.clone(),
        redis_url: args.redis_url.clone(),
        redis_cluster: args.redis_cluster,
        redis_prefix: args.redis_prefix.clone(),
        connections: 2,
        wait_replicas: (args.redis_wait_replicas > 0).then(|| idem_redis::WaitReplicas {
            replicas: args.redis_wait_replicas,
            timeout: Duration::from_millis(args.redis_wait_timeout_ms),
        }),
        sqlite_synchronous_normal: false,
    }
}

/// The store `args` name, its table made if missing.
async fn open(args: &OnceArgs) -> Result<Arc<dyn Store>, crate::Failure> {
    crate::open_store(&target(args)).await
}
