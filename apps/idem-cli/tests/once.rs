//! `idem once` against real stores (SQLite, PostgreSQL, MySQL, Redis):
//! racing "hosts" run the command once, a repeat replays its stdout and
//! status, another command line under the key exits 65, a run in flight
//! exits 75 (or is waited for), a failure releases the key unless stored,
//! and a run killed with `kill -9` is taken over after its lease under the
//! same operation id. `idem inspect` shows a run's steps.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn idem(url: &str, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_idem"));
    c.args(args)
        .env("DATABASE_URL", url)
        .env_remove("REDIS_URL")
        .env("IDEM_REDIS_PREFIX", prefix_for(url));
    // A Redis Cluster's nodes, comma-separated (`redis_cluster` below).
    if url.split('#').next().unwrap_or_default().contains(',') {
        c.env("IDEM_REDIS_CLUSTER", "true");
    } else {
        c.env_remove("IDEM_REDIS_CLUSTER");
    }
    c
}

/// Redis tests run under a prefix of their own, named in the URL's
/// fragment by [`redis_url`]; others under the default.
fn prefix_for(url: &str) -> String {
    url.split_once('#')
        .map_or_else(|| "idem".to_owned(), |(_, p)| p.to_owned())
}

fn once(url: &str, key: &str, extra: &[&str], command: &[&str]) -> Output {
    let url_only = url.split('#').next().unwrap();
    let mut args = vec!["once", "--scope", "cron", "--key", key];
    args.extend(extra);
    args.push("--");
    args.extend(command);
    idem(url, &args)
        .env("DATABASE_URL", url_only)
        .output()
        .unwrap()
}

/// A command that counts its runs in `dir/runs` and prints a line.
fn counting(dir: &Path, line: &str) -> Vec<String> {
    vec![
        "sh".into(),
        "-c".into(),
        format!(
            "echo \"$IDEM_OPERATION_ID\" >> '{}/runs'; sleep 0.3; echo '{line}'",
            dir.display()
        ),
    ]
}

fn runs(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("runs"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The PostgreSQL server's own URL (no schema).
fn postgres_base() -> String {
    idem_test_support::postgres::database_url()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The whole of `idem once`'s contract on the store `url` names.
fn exercise(url: &str) {
    a_background_process_does_not_hold_the_run(url);
    a_failed_commands_leftovers_do_not_outlive_its_key(url);
    a_stop_asks_the_command_to_end_first(url);
    a_signal_while_the_output_drains_keeps_the_result(url);
    let dir = tempfile::tempdir().unwrap();
    let cmd = counting(dir.path(), "report done");
    let cmd: Vec<&str> = cmd.iter().map(String::as_str).collect();

    // Three hosts start the same job at once: it runs once, and each
    // exits 0 with its stdout (the others wait for it).
    let url_only = url.split('#').next().unwrap().to_owned();
    let hosts: Vec<_> = (0..3)
        .map(|_| {
            let mut args = vec![
                "once",
                "--scope",
                "cron",
                "--key",
                "nightly",
                "--wait-ms",
                "20000",
                "--",
            ];
            args.extend(cmd.iter().copied());
            idem(url, &args)
                .env("DATABASE_URL", &url_only)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs: Vec<Output> = hosts
        .into_iter()
        .map(|h| h.wait_with_output().unwrap())
        .collect();
    for o in &outputs {
        assert!(o.status.success(), "{}", text(&o.stderr));
        assert_eq!(text(&o.stdout), "report done\n", "{}", text(&o.stderr));
    }
    assert_eq!(
        runs(dir.path()).len(),
        1,
        "the job ran once across the hosts"
    );
    let replayed = outputs
        .iter()
        .filter(|o| text(&o.stderr).contains("replayed"))
        .count();
    assert_eq!(replayed, 2);

    // A repeat replays, without running.
    let again = once(url, "nightly", &[], &cmd);
    assert!(again.status.success());
    assert_eq!(text(&again.stdout), "report done\n");
    assert!(
        text(&again.stderr).contains("replayed"),
        "{}",
        text(&again.stderr)
    );
    assert_eq!(runs(dir.path()).len(), 1);

    // Another command line under the key: 65, nothing ran.
    let other = once(url, "nightly", &[], &["sh", "-c", "echo other"]);
    assert_eq!(other.status.code(), Some(65), "{}", text(&other.stderr));
    assert!(text(&other.stderr).contains("another command line"));
    assert!(other.stdout.is_empty());

    // A failure releases the key: the next run executes again.
    let failing = ["sh", "-c", "echo attempt; exit 3"];
    let first = once(url, "flaky", &[], &failing);
    assert_eq!(first.status.code(), Some(3));
    assert_eq!(text(&first.stdout), "attempt\n");
    let second = once(url, "flaky", &[], &failing);
    assert_eq!(second.status.code(), Some(3));
    assert!(!text(&second.stderr).contains("replayed"));
    // ... unless stored: then every repeat gets the failure back.
    let stored = once(url, "final", &["--store-failures"], &failing);
    assert_eq!(stored.status.code(), Some(3));
    let replay = once(url, "final", &["--store-failures"], &failing);
    assert_eq!(replay.status.code(), Some(3));
    assert_eq!(text(&replay.stdout), "attempt\n");
    assert!(
        text(&replay.stderr).contains("replayed"),
        "{}",
        text(&replay.stderr)
    );

    // In flight on another host: 75 at once.
    let slow = counting(dir.path(), "slow done");
    let slow = [
        slow[0].as_str(),
        slow[1].as_str(),
        // It runs on for 5 s after it counted itself: the duplicate below
        // arrives while it runs, however slow the machine.
        &slow[2].replace("sleep 0.3", "sleep 5"),
    ];
    let mut holder = {
        let mut args = vec!["once", "--scope", "cron", "--key", "slow", "--"];
        args.extend(slow.iter().copied());
        idem(url, &args)
            .env("DATABASE_URL", &url_only)
            .stdout(Stdio::null())
            .spawn()
            .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while runs(dir.path()).len() < 2 {
        assert!(Instant::now() < deadline, "the slow job never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let busy = once(url, "slow", &[], &slow);
    assert_eq!(busy.status.code(), Some(75), "{}", text(&busy.stderr));
    assert!(text(&busy.stderr).contains("another run holds"));
    assert!(holder.wait().unwrap().success());

    // Bad input is refused before anything runs.
    let bad = once(url, "a key with spaces", &[], &["true"]);
    assert_eq!(bad.status.code(), Some(64));
    let missing = once(url, "nothing-to-run", &[], &["/no/such/program"]);
    assert_eq!(
        missing.status.code(),
        Some(127),
        "{}",
        text(&missing.stderr)
    );
    // More than 1 MiB of stdout: the run counts, its stdout is not kept,
    // and the replay says so.
    let big = ["sh", "-c", "head -c 1100000 /dev/zero"];
    let first = once(url, "big", &[], &big);
    assert!(first.status.success());
    assert_eq!(first.stdout.len(), 1_100_000, "streamed through whole");
    let replay = once(url, "big", &[], &big);
    assert!(replay.status.success());
    assert!(replay.stdout.is_empty());
    assert!(
        text(&replay.stderr).contains("over 1 MiB"),
        "{}",
        text(&replay.stderr)
    );
}

/// `kill -9` of a running `idem once`: after the lease, the next run takes
/// over and runs the command under the same operation id.
fn killed_run_is_taken_over(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let url_only = url.split('#').next().unwrap().to_owned();
    // The command outlives no lease: it stops by itself after 1 s.
    let cmd = format!(
        "echo \"$IDEM_OPERATION_ID $IDEM_TAKEOVER\" >> '{}/runs'; sleep 1",
        dir.path().display()
    );
    let args = [
        "once",
        "--scope",
        "cron",
        "--key",
        "deploy",
        "--lease-ms",
        "1500",
        "--",
        "sh",
        "-c",
        &cmd,
    ];
    let mut first = idem(url, &args)
        .env("DATABASE_URL", &url_only)
        .spawn()
        .unwrap();
    let claimed = Instant::now();
    let deadline = claimed + Duration::from_secs(20);
    while runs(dir.path()).is_empty() {
        assert!(Instant::now() < deadline, "the command never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    first.kill().unwrap();
    first.wait().unwrap();
    // Within the lease: in flight. (The lease began after `claimed`, when
    // the claim was sent: while less than the lease has passed since
    // `claimed`, it is certainly alive.)
    let busy = idem(url, &args)
        .env("DATABASE_URL", &url_only)
        .output()
        .unwrap();
    assert!(
        busy.status.code() == Some(75) || claimed.elapsed() >= Duration::from_millis(1500),
        "{:?}: {}",
        busy.status,
        text(&busy.stderr)
    );
    // The next run waits for the dead holder's lease to end (the policy's
    // margin, not the machine's speed), then takes over.
    let mut waiting = args.to_vec();
    waiting.splice(1..1, ["--wait-ms", "20000"]);
    let second = idem(url, &waiting)
        .env("DATABASE_URL", &url_only)
        .output()
        .unwrap();
    assert!(second.status.success(), "{}", text(&second.stderr));
    let seen = runs(dir.path());
    assert!((2..=3).contains(&seen.len()), "{seen:?}");
    let ids: Vec<&str> = seen.iter().map(|s| s.split(' ').next().unwrap()).collect();
    assert!(
        ids.iter().all(|s| *s == ids[0]),
        "taken over under the same operation id: {seen:?}"
    );
    assert!(uuid::Uuid::parse_str(ids[0]).is_ok(), "{seen:?}");
    // The command is told whether an earlier run may have begun its work.
    let takeovers: Vec<&str> = seen
        .iter()
        .map(|s| s.split(' ').nth(1).unwrap_or(""))
        .collect();
    assert_eq!(takeovers[0], "0", "{seen:?}");
    assert!(takeovers[1..].iter().all(|t| *t == "1"), "{seen:?}");
}

/// A command past its lease is killed with everything it started (exit
/// 124), and the key is released; SIGTERM to `idem once` kills the command
/// the same way, and the next run executes it again.
fn the_command_never_outlives_the_claim(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let url_only = url.split('#').next().unwrap().to_owned();
    let pidfile = dir.path().join("pid");
    let cmd = format!("sleep 30 & echo $! > '{}'; wait", pidfile.display());
    let started = Instant::now();
    let out = idem(
        url,
        &[
            "once",
            "--scope",
            "cron",
            "--key",
            "long",
            "--lease-ms",
            "1500",
            "--",
            "sh",
            "-c",
            &cmd,
        ],
    )
    .env("DATABASE_URL", &url_only)
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(124), "{}", text(&out.stderr));
    assert!(started.elapsed() < Duration::from_secs(20));
    let pid = std::fs::read_to_string(&pidfile).unwrap();
    assert_gone(pid.trim());

    // SIGTERM: the command is killed, the key released.
    let counting_cmd = format!("echo x >> '{}/runs'; sleep 30", dir.path().display());
    let running = idem(
        url,
        &[
            "once",
            "--scope",
            "cron",
            "--key",
            "term",
            "--",
            "sh",
            "-c",
            &counting_cmd,
        ],
    )
    .env("DATABASE_URL", &url_only)
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while runs(dir.path()).is_empty() {
        assert!(Instant::now() < deadline, "the command never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    let stopped = Command::new("kill")
        .args(["-TERM", &running.id().to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    let out = running.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(143), "{}", text(&out.stderr));
    let again = once(
        url,
        "term",
        &[],
        &["sh", "-c", &counting_cmd.replace("sleep 30", "true")],
    );
    // Another command line under the key (the sleep left out) is refused:
    // the key is still bound to its first command line, but free to run.
    assert_eq!(again.status.code(), Some(65), "{}", text(&again.stderr));
    let rerun = idem(
        url,
        &[
            "once",
            "--scope",
            "cron",
            "--key",
            "term",
            "--lease-ms",
            "1000",
            "--",
            "sh",
            "-c",
            &counting_cmd,
        ],
    )
    .env("DATABASE_URL", &url_only)
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while runs(dir.path()).len() < 2 {
        assert!(
            Instant::now() < deadline,
            "the released key did not run again"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = rerun.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(124), "{}", text(&out.stderr));

    // SIGQUIT (or any signal that would end `idem once`): the command is
    // killed too, never left running in its own process group.
    let pid_file = dir.path().join("quit.pid");
    let script = format!("echo $$ > '{}'; sleep 30", pid_file.display());
    let running = idem(
        url,
        &[
            "once", "--scope", "cron", "--key", "quit", "--", "sh", "-c", &script,
        ],
    )
    .env("DATABASE_URL", &url_only)
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let pid = pid_in(&pid_file);
    let quit = Command::new("kill")
        .args(["-QUIT", &running.id().to_string()])
        .status()
        .unwrap();
    assert!(quit.success());
    let out = running.wait_with_output().unwrap();
    assert_gone(&pid);
    assert_eq!(out.status.code(), Some(128 + 3), "{}", text(&out.stderr));
}

/// SIGTERM after the command exited, while `idem once` still reads what a
/// background process left in the pipe: the command's exit stands (stored,
/// `idem once` exits with it), rather than being taken for a command killed
/// (whose key is let go, so that the next run would run it again).
fn a_signal_while_the_output_drains_keeps_the_result(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (pid_file, shell) = (
        dir.path().join("background.pid"),
        dir.path().join("shell.pid"),
    );
    let script = format!(
        "sleep 60 2>/dev/null & echo $! > '{}'; echo started; echo $$ > '{}'",
        pid_file.display(),
        shell.display()
    );
    let url_only = url.split('#').next().unwrap();
    let args = [
        "once", "--scope", "cron", "--key", "drained", "--", "sh", "-c", &script,
    ];
    let run = idem(url, &args)
        .env("DATABASE_URL", url_only)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The shell's exit seen (reaped by `idem once`): it then reads the pipe
    // the background `sleep` holds, for a second.
    let deadline = Instant::now() + Duration::from_secs(30);
    let reaped = || {
        std::fs::read_to_string(&shell)
            .ok()
            .filter(|pid| pid.ends_with('\n'))
            .is_some_and(|pid| !Path::new(&format!("/proc/{}", pid.trim())).exists())
    };
    while !reaped() {
        assert!(Instant::now() < deadline, "the command never ended");
        std::thread::sleep(Duration::from_millis(2));
    }
    let _ = Command::new("kill")
        .args(["-TERM", &run.id().to_string()])
        .status();
    let out = run.wait_with_output().unwrap();
    if let Ok(pid) = std::fs::read_to_string(&pid_file) {
        let _ = Command::new("kill").arg(pid.trim()).status();
    }
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "started\n");
    let again = once(url, "drained", &[], &["sh", "-c", &script]);
    assert_eq!(again.status.code(), Some(0), "{}", text(&again.stderr));
    assert!(
        text(&again.stderr).contains("replayed"),
        "stored, not run again: {}",
        text(&again.stderr)
    );
}

/// A command that leaves a process running in the background, which
/// keeps its stdout open: `idem once` ends with the command (its status and
/// stdout stored), not with the background process.
fn a_background_process_does_not_hold_the_run(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("background.pid");
    // Its stderr is let go (the test reads `idem once`'s to its end); its
    // stdout is the pipe `idem once` reads.
    let script = format!(
        "sleep 60 2>/dev/null & echo $! > '{}'; echo started",
        pid_file.display()
    );
    let started = Instant::now();
    let out = once(url, "with-a-daemon", &[], &["sh", "-c", &script]);
    let took = started.elapsed();
    if let Ok(pid) = std::fs::read_to_string(&pid_file) {
        let _ = Command::new("kill").arg(pid.trim()).status();
    }
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "started\n");
    // The background `sleep` holds the pipe for a minute; the run ended
    // with the command.
    assert!(took < Duration::from_secs(30), "idem once waited {took:?}");
    let again = once(url, "with-a-daemon", &[], &["sh", "-c", &script]);
    assert_eq!(again.status.code(), Some(0), "{}", text(&again.stderr));
    assert_eq!(text(&again.stdout), "started\n");
    assert!(
        text(&again.stderr).contains("replayed"),
        "{}",
        text(&again.stderr)
    );
}

/// Whether `pid` still runs (gone, or a zombie no one reaped yet, is not).
fn alive(pid: &str) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
}

/// Field `n` of `/proc/{pid}/stat` after the command's name (0: its
/// state, 2: its process group).
fn stat_field(pid: &str, n: usize) -> String {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(") ").map_or("", |(_, rest)| rest);
    after.split(' ').nth(n).unwrap_or_default().to_owned()
}

/// The pid a command wrote to `file` (waiting for it, up to 20 s).
fn pid_in(file: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match std::fs::read_to_string(file) {
            Ok(pid) if pid.ends_with('\n') => return pid.trim().to_owned(),
            _ => {
                assert!(Instant::now() < deadline, "the command never started");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// A command that fails lets its key go (the next run executes again):
/// what it left running in its process group is killed first, so that it
/// does not run on beside the next run's.
fn a_failed_commands_leftovers_do_not_outlive_its_key(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("worker.pid");
    let script = format!(
        "sleep 60 >/dev/null 2>&1 & echo $! > '{}'; exit 3",
        pid_file.display()
    );
    let out = once(url, "leaves-a-worker", &[], &["sh", "-c", &script]);
    let pid = pid_in(&pid_file);
    assert_gone(&pid);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
}

/// Writes a shell script to `dir/{name}.sh` that runs `trap` (its signal
/// handling), writes its pid to `dir/{name}.pid` and loops until killed;
/// returns the two paths.
fn looping_worker(dir: &Path, name: &str, trap: &str) -> (PathBuf, PathBuf) {
    let (script, pid_file) = (
        dir.join(format!("{name}.sh")),
        dir.join(format!("{name}.pid")),
    );
    std::fs::write(
        &script,
        format!(
            "{trap}\necho $$ > '{}'\nwhile :; do sleep 0.05; done\n",
            pid_file.display()
        ),
    )
    .unwrap();
    (script, pid_file)
}

/// A [`looping_worker`] that, told to stop (SIGTERM), takes 300 ms to
/// clean up (as `docker run` stopping its container), says so in
/// `dir/{name}.cleaned`, and exits; returns the script, its pid file and
/// the file it cleans up into.
fn cleaning_worker(dir: &Path, name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let cleaned = dir.join(format!("{name}.cleaned"));
    let trap = format!(
        "trap 'sleep 0.3; echo yes > \"{}\"; exit 0' TERM",
        cleaned.display()
    );
    let (script, pid_file) = looping_worker(dir, name, &trap);
    (script, pid_file, cleaned)
}

/// Asserts the [`cleaning_worker`] that cleans up into `cleaned` was let
/// end.
fn assert_let_end(cleaned: &Path) {
    assert_eq!(
        std::fs::read_to_string(cleaned).unwrap_or_default(),
        "yes\n",
        "the worker was killed without acting on the SIGTERM"
    );
}

/// `idem once` under `key`, running the shell `script` in the background,
/// its stderr piped. The workers' stderr is not that pipe (the test reads
/// it to its end: a worker left alive would hang the test, not fail it).
fn once_in_background(url: &str, key: &str, workers: &[&Path]) -> std::process::Child {
    let url_only = url.split('#').next().unwrap().to_owned();
    let script: String = workers
        .iter()
        .map(|w| format!("sh '{}' 2>/dev/null & ", w.display()))
        .chain(["wait".to_owned()])
        .collect();
    idem(
        url,
        &[
            "once", "--scope", "cron", "--key", key, "--", "sh", "-c", &script,
        ],
    )
    .env("DATABASE_URL", url_only)
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap()
}

/// Waits until `done` (up to 20 s, then fails naming `what`).
fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "waited 20 s for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Asserts `pid`, a process of the command's group, is gone once `idem
/// once` exited (a SIGKILL it sent takes a moment to land; 5 s), killing
/// it if not.
fn assert_gone(pid: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while alive(pid) {
        if Instant::now() >= deadline {
            let _ = Command::new("kill").args(["-KILL", pid]).status();
            panic!("{pid}, of the command's group, outlived idem once");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `signal` (`-TERM`, …) to `pid`.
fn send(signal: &str, pid: &str) {
    let sent = Command::new("kill").args([signal, pid]).status().unwrap();
    assert!(sent.success(), "kill {signal} {pid}");
}

/// Told to stop, `idem once` asks the command's group to end (SIGTERM)
/// before it kills it, and waits for the group, not the command alone: a
/// script that dies of the signal at once leaves what it started (here a
/// worker that takes 300 ms to clean up, as `docker run` stopping its
/// container) the time to end.
///
/// A worker that writes as it stops (256 KiB, four times a pipe's buffer)
/// is read meanwhile: left unread, it blocked on the full pipe and was
/// killed at the grace's end, mid-cleanup.
fn a_stop_asks_the_command_to_end_first(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (worker, pid_file, cleaned) = cleaning_worker(dir.path(), "worker");
    let talked = dir.path().join("talker.cleaned");
    let (talker, talker_pid_file) = looping_worker(
        dir.path(),
        "talker",
        &format!(
            "trap 'head -c 262144 /dev/zero | tr \"\\\\000\" x; echo yes > \"{}\"; exit 0' TERM",
            talked.display()
        ),
    );
    let running = once_in_background(url, "graceful", &[&worker, &talker]);
    let pids = [pid_in(&pid_file), pid_in(&talker_pid_file)];
    send("-TERM", &running.id().to_string());
    let out = running.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(143), "{}", text(&out.stderr));
    for pid in &pids {
        assert_gone(pid);
    }
    assert_let_end(&cleaned);
    assert_let_end(&talked);
}

/// Told to stop, `idem once` reaches every member of the command's group:
/// one stopped (SIGSTOP, as a job that wrote to a terminal is) is
/// continued so that it acts on the SIGTERM, and one that ignores SIGTERM
/// is killed once the grace has passed, which is waited for (3 s).
#[test]
fn a_stop_continues_a_stopped_member_and_kills_one_that_ignores_it() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("once.db").display());
    let (paused, paused_pid, cleaned) = cleaning_worker(dir.path(), "paused");
    let (stubborn, stubborn_pid) = looping_worker(dir.path(), "stubborn", "trap '' TERM");
    let running = once_in_background(&url, "stubborn", &[&paused, &stubborn]);
    let (paused, stubborn) = (pid_in(&paused_pid), pid_in(&stubborn_pid));
    send("-STOP", &paused);
    // Stopped before the stop begins (a SIGCONT sent first would cancel it).
    wait_for("the member to stop", || stat_field(&paused, 0) == "T");
    let asked = Instant::now();
    send("-TERM", &running.id().to_string());
    let out = running.wait_with_output().unwrap();
    let took = asked.elapsed();
    assert_eq!(out.status.code(), Some(143), "{}", text(&out.stderr));
    assert_gone(&paused);
    assert_gone(&stubborn);
    assert_let_end(&cleaned);
    assert!(
        took >= Duration::from_secs(3),
        "the member that ignores SIGTERM was killed after {took:?}, before the grace"
    );
}

/// One stop delivered twice (`timeout` signals its child, then its own
/// process group), or followed by another signal, does not cut the grace
/// short: the group is still let end, and the first signal is the status.
#[test]
fn a_stop_delivered_twice_still_lets_the_group_end() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("once.db").display());
    let (worker, pid_file, cleaned) = cleaning_worker(dir.path(), "worker");
    let running = once_in_background(&url, "twice", &[&worker]);
    let pid = pid_in(&pid_file);
    let leader = stat_field(&pid, 2);
    send("-TERM", &running.id().to_string());
    // The stop begun: the group's leader (`sh -c`, which dies of SIGTERM)
    // gone, the worker cleaning up. Then the same stop again, and another.
    wait_for("the command to die of the SIGTERM", || !alive(&leader));
    send("-TERM", &running.id().to_string());
    send("-INT", &running.id().to_string());
    let out = running.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(143), "{}", text(&out.stderr));
    assert_gone(&pid);
    assert_let_end(&cleaned);
}

/// As PID 1 (a container's entrypoint: here of a PID namespace of its
/// own), `idem once` is handed the processes the command orphaned; one
/// that ended is its zombie until reaped. A stop reaps them, rather than
/// counting them as members still running until the grace ran out.
#[test]
fn as_pid_1_a_stop_does_not_wait_for_orphaned_zombies() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("once.db").display());
    let started = dir.path().join("started");
    // `(sleep 0.2 &)` orphans the sleep at once: PID 1 is its parent now,
    // and it ends (by itself, or of the stop's SIGTERM) as a zombie of it.
    let script = format!(
        "(sleep 0.2 &); echo up > '{}'; while :; do sleep 0.05; done",
        started.display()
    );
    let mut unshare = Command::new("unshare");
    unshare
        .args(["--pid", "--fork", "--"])
        .arg(env!("CARGO_BIN_EXE_idem"))
        .args([
            "once", "--scope", "cron", "--key", "pid-1", "--", "sh", "-c", &script,
        ])
        .env("DATABASE_URL", &url)
        .env_remove("REDIS_URL")
        .stderr(Stdio::piped());
    let running = unshare.spawn().expect("unshare (util-linux) runs");
    pid_in(&started);
    // `idem once` is unshare's child (PID 1 inside).
    let children = format!("/proc/{0}/task/{0}/children", running.id());
    let mut once_pid = String::new();
    wait_for("idem once under unshare", || {
        once_pid = std::fs::read_to_string(&children).unwrap_or_default();
        once_pid = once_pid.trim().to_owned();
        !once_pid.is_empty()
    });
    let asked = Instant::now();
    send("-TERM", &once_pid);
    let out = running.wait_with_output().unwrap();
    let took = asked.elapsed();
    assert_eq!(out.status.code(), Some(143), "{}", text(&out.stderr));
    // Over before the grace (3 s from the SIGTERM) would have ended.
    assert!(
        took < Duration::from_secs(3),
        "the stop waited {took:?}: for a zombie, as if it were a member still running"
    );
}

/// A store that cannot be reached exits 69 with nothing run; a malformed
/// key or URL exits 64 whether or not the store answers.
#[test]
fn an_unreachable_store_exits_69_and_a_bad_command_line_64() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ran");
    let touch = format!("touch '{}'", marker.display());
    for url in [
        format!("postgres://postgres@127.0.0.1:{port}/test"),
        format!("mysql://root@127.0.0.1:{port}/test"),
        format!("redis://127.0.0.1:{port}"),
    ] {
        let out = once(&url, "nightly", &[], &["sh", "-c", &touch]);
        assert_eq!(out.status.code(), Some(69), "{url}: {}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains("unavailable"),
            "{}",
            text(&out.stderr)
        );
        assert!(!marker.exists(), "{url}: the command ran");
        let out = once(&url, "two words", &[], &["sh", "-c", &touch]);
        assert_eq!(out.status.code(), Some(64), "{url}: {}", text(&out.stderr));
    }
    let out = once("ftp://example.com/x", "nightly", &[], &["true"]);
    assert_eq!(out.status.code(), Some(64), "{}", text(&out.stderr));
    assert!(!marker.exists());
}

/// SIGTERM once the command exited, while its result is being stored and
/// the store does not answer (another process holds SQLite's write lock):
/// `idem once` stops at once, 128 + 15, saying the result may not be
/// stored, and kills what the command left running (here the process that
/// holds the lock). It used to go on retrying until the store answered or
/// its lease ended, the signal swallowed.
#[test]
fn a_signal_while_the_result_is_stored_stops_it() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("once.db");
    let url = format!("sqlite:{}", db.display());
    // The records table made, by a first run.
    let warm = once(&url, "warm", &[], &["true"]);
    assert_eq!(warm.status.code(), Some(0), "{}", text(&warm.stderr));
    let locker = dir.path().join("locker.pid");
    // The command leaves a process behind that takes the database's write
    // lock for 20 s, and exits once it holds it.
    let script = format!(
        "python3 -c 'import os, sqlite3, sys, time; c = sqlite3.connect(sys.argv[1], isolation_level=None); \
         c.execute(\"BEGIN EXCLUSIVE\"); open(sys.argv[2], \"w\").write(str(os.getpid())); time.sleep(20)' \
         '{}' '{}' >/dev/null 2>&1 & while [ ! -s '{}' ]; do sleep 0.05; done; echo ran",
        db.display(),
        locker.display(),
        locker.display()
    );
    let mut running = idem(
        &url,
        &[
            "once",
            "--scope",
            "cron",
            "--key",
            "stored",
            "--lease-ms",
            "60000",
            "--",
            "sh",
            "-c",
            &script,
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::read_to_string(&locker)
        .unwrap_or_default()
        .is_empty()
    {
        assert!(Instant::now() < deadline, "the locker never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The command has exited (or is about to): `idem once` is storing.
    std::thread::sleep(Duration::from_millis(500));
    let stopped = Command::new("kill")
        .args(["-TERM", &running.id().to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(status) = running.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = running.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = running.wait_with_output().unwrap();
    let pid = std::fs::read_to_string(&locker).unwrap_or_default();
    // The result not stored, the key is left to its lease, after which
    // another run executes the command: what this one left running in its
    // group was killed.
    let said = text(&out.stderr);
    assert!(!pid.trim().is_empty(), "{said}");
    assert_gone(pid.trim());
    assert_eq!(status.and_then(|s| s.code()), Some(143), "{said}");
    assert!(said.contains("while its result was being stored"), "{said}");
    assert_eq!(text(&out.stdout), "ran\n");
}

mod sqlite {
    fn url(dir: &tempfile::TempDir) -> String {
        format!("sqlite:{}", dir.path().join("once.db").display())
    }
    #[test]
    fn once() {
        let dir = tempfile::tempdir().unwrap();
        super::exercise(&url(&dir));
    }
    #[test]
    fn kill9() {
        let dir = tempfile::tempdir().unwrap();
        super::killed_run_is_taken_over(&url(&dir));
    }
    #[test]
    fn lease_and_signals() {
        let dir = tempfile::tempdir().unwrap();
        super::the_command_never_outlives_the_claim(&url(&dir));
    }
}

/// A command's output read slowly by whoever reads `idem once`'s stdout
/// is passed on and kept whole, however long after the command exited it
/// takes that reader: before, what was still in the pipe a second after
/// the exit (time spent waiting on the reader included) was dropped, from
/// the stream and from the stored result, with exit status 0.
#[test]
fn output_read_slowly_after_the_command_exits_is_kept_whole() {
    use std::io::Read;
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("once.db").display());
    const BYTES: usize = 200_000;
    let script = format!("head -c {BYTES} /dev/zero | tr '\\0' x");
    let mut child = idem(
        &url,
        &[
            "once",
            "--scope",
            "cron",
            "--key",
            "slow-reader",
            "--",
            "sh",
            "-c",
            &script,
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut got = Vec::new();
    let mut chunk = vec![0u8; 8 * 1024];
    loop {
        let n = stdout.read(&mut chunk).unwrap();
        if n == 0 {
            break;
        }
        got.extend_from_slice(&chunk[..n]);
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(got.len(), BYTES, "passed on whole");
    assert!(got.iter().all(|b| *b == b'x'));
    let again = once(&url, "slow-reader", &[], &["sh", "-c", &script]);
    assert_eq!(again.status.code(), Some(0), "{}", text(&again.stderr));
    assert_eq!(again.stdout.len(), BYTES, "kept whole");
}

/// Ctrl-Z (SIGTSTP) does not stop `idem once`: its command, in a group of
/// its own, would go on running with nothing watching its lease. It keeps
/// running and ends with the command.
#[test]
fn a_terminal_stop_does_not_stop_idem_once() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("once.db").display());
    let started = dir.path().join("started");
    let script = format!("touch '{}'; sleep 1", started.display());
    let mut child = idem(
        &url,
        &[
            "once", "--scope", "cron", "--key", "tstp", "--", "sh", "-c", &script,
        ],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    wait_for("the command to start", || started.exists());
    let pid = child.id().to_string();
    send("-TSTP", &pid);
    std::thread::sleep(Duration::from_millis(200));
    let state = stat_field(&pid, 0);
    if state == "T" {
        send("-CONT", &pid);
        let _ = child.kill();
        panic!("idem once was stopped by a terminal signal");
    }
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
}

/// A release that fails (here: the record was deleted under the run) is
/// said on stderr: the key may stay held until its lease ends, and the
/// next run's `75` should not come unexplained. The library logs it; `idem
/// once` installed nothing that printed it.
#[test]
fn a_failed_release_is_said() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("once.db");
    let url = format!("sqlite:{}", db.display());
    let script = format!(
        "python3 -c \"import sqlite3; c = sqlite3.connect('{}'); c.execute('DELETE FROM idem_records'); c.commit()\"; exit 3",
        db.display()
    );
    let out = once(&url, "lost-record", &[], &["sh", "-c", &script]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("release failed"),
        "{}",
        text(&out.stderr)
    );
}

mod postgres {
    use idem_test_support::postgres::TestSchema;
    async fn url() -> (String, TestSchema) {
        let schema = TestSchema::create("idem_once_cli").await;
        (schema.url(), schema)
    }
    #[tokio::test(flavor = "multi_thread")]
    async fn once() {
        let (url, _schema) = url().await;
        tokio::task::spawn_blocking(move || super::exercise(&url))
            .await
            .unwrap();
    }
    #[tokio::test(flavor = "multi_thread")]
    async fn kill9() {
        let (url, _schema) = url().await;
        tokio::task::spawn_blocking(move || super::killed_run_is_taken_over(&url))
            .await
            .unwrap();
    }
    /// A claim that waits past half the lease (here on a lock the test
    /// holds on the records table) starts nothing, rather than a command
    /// that would be killed midway: exit 75, nothing ran, the key released,
    /// and the next run executes the command.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_slow_claim_starts_nothing() {
        use sqlx::{Connection, PgConnection};
        use std::time::{Duration, Instant};
        let (url, schema) = url().await;
        let dir = tempfile::tempdir().unwrap();
        let u = url.clone();
        let made = tokio::task::spawn_blocking(move || super::once(&u, "made", &[], &["true"]))
            .await
            .unwrap();
        assert!(made.status.success(), "{}", super::text(&made.stderr));
        let mut conn = PgConnection::connect(&url).await.unwrap();
        let mut lock = conn.begin().await.unwrap();
        sqlx::query("LOCK TABLE idem_records IN EXCLUSIVE MODE")
            .execute(&mut *lock)
            .await
            .unwrap();
        let (u, d) = (url.clone(), dir.path().to_owned());
        let run = tokio::task::spawn_blocking(move || {
            let command = super::counting(&d, "slow");
            let command: Vec<&str> = command.iter().map(String::as_str).collect();
            super::once(&u, "slow", &["--lease-ms", "2000"], &command)
        });
        // The claim waits on the lock; then more than half its lease goes by.
        let mut watch = PgConnection::connect(&super::postgres_base())
            .await
            .unwrap();
        let waiting = format!(
            "SELECT count(*) FROM pg_locks WHERE relation = '\"{}\".idem_records'::regclass AND NOT granted",
            schema.name()
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        while sqlx::query_scalar::<_, i64>(&waiting)
            .fetch_one(&mut watch)
            .await
            .unwrap()
            == 0
        {
            assert!(
                Instant::now() < deadline,
                "the claim never waited on the lock"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(1500)).await;
        lock.commit().await.unwrap();
        let slow = run.await.unwrap();
        let said = super::text(&slow.stderr);
        assert_eq!(slow.status.code(), Some(75), "{said}");
        assert!(said.contains("not started"), "{said}");
        assert!(super::runs(dir.path()).is_empty(), "the command ran");
        let u = url.clone();
        let d = dir.path().to_owned();
        let next = tokio::task::spawn_blocking(move || {
            let command = super::counting(&d, "slow");
            let command: Vec<&str> = command.iter().map(String::as_str).collect();
            super::once(&u, "slow", &["--lease-ms", "2000"], &command)
        })
        .await
        .unwrap();
        assert!(next.status.success(), "{}", super::text(&next.stderr));
        assert_eq!(super::text(&next.stdout), "slow\n");
        assert_eq!(super::runs(dir.path()).len(), 1);
    }
    #[tokio::test(flavor = "multi_thread")]
    async fn lease_and_signals() {
        let (url, _schema) = url().await;
        tokio::task::spawn_blocking(move || super::the_command_never_outlives_the_claim(&url))
            .await
            .unwrap();
    }
}

mod mysql {
    use idem_test_support::mysql::TestDatabase;
    #[tokio::test(flavor = "multi_thread")]
    async fn once() {
        let db = TestDatabase::create("idem_once_cli").await;
        let url = db.url();
        tokio::task::spawn_blocking(move || super::exercise(&url))
            .await
            .unwrap();
    }
    #[tokio::test(flavor = "multi_thread")]
    async fn kill9() {
        let db = TestDatabase::create("idem_once_cli").await;
        let url = db.url();
        tokio::task::spawn_blocking(move || super::killed_run_is_taken_over(&url))
            .await
            .unwrap();
    }
}

mod redis {
    use idem_test_support::redis::{redis_url, TestPrefix};

    /// The test's Redis, its prefix in the fragment (see `prefix_for`).
    struct Prefixed {
        url: String,
        /// Deletes the test's keys when dropped.
        _prefix: TestPrefix,
    }

    impl Prefixed {
        fn new() -> Self {
            let prefix = TestPrefix::new("idem-once-cli");
            Self {
                url: format!("{}#{}", redis_url(), prefix.name()),
                _prefix: prefix,
            }
        }
    }

    #[test]
    fn once() {
        let url = Prefixed::new();
        super::exercise(&url.url);
    }
    #[test]
    fn kill9() {
        let url = Prefixed::new();
        super::killed_run_is_taken_over(&url.url);
    }
}

/// `idem once` on a Redis Cluster (`--redis-cluster`, here from
/// `IDEM_REDIS_CLUSTER`): the whole contract, as on one server.
mod redis_cluster {
    /// The cluster `bash scripts/test` starts (three primaries, no
    /// replicas).
    fn nodes() -> String {
        std::env::var("IDEM_TEST_REDIS_CLUSTER").unwrap_or_else(|_| {
            "redis://127.0.0.1:7000,redis://127.0.0.1:7001,redis://127.0.0.1:7002".to_owned()
        })
    }

    /// The test's prefix, in the URL's fragment; its keys deleted from
    /// every node when dropped.
    struct Prefixed {
        url: String,
        prefix: String,
    }

    impl Prefixed {
        fn new() -> Self {
            let prefix = format!("idem-once-cluster-{}", uuid::Uuid::new_v4().simple());
            Self {
                url: format!("{}#{prefix}", nodes()),
                prefix,
            }
        }
    }

    impl Drop for Prefixed {
        fn drop(&mut self) {
            for node in nodes().split(',') {
                idem_test_support::redis::clear_prefix(node, &self.prefix);
            }
        }
    }

    #[test]
    fn once() {
        let url = Prefixed::new();
        super::exercise(&url.url);
    }

    /// `--redis-wait-replicas 1` on a cluster whose primaries have no
    /// replica: no claim counts, so nothing runs (69), and the next run
    /// without the flag finds the key free.
    #[test]
    fn a_claim_no_replica_acknowledged_runs_nothing() {
        let url = Prefixed::new();
        let dir = tempfile::tempdir().unwrap();
        let cmd = super::counting(dir.path(), "ran");
        let cmd: Vec<&str> = cmd.iter().map(String::as_str).collect();
        let waited = super::once(&url.url, "acked", &["--redis-wait-replicas", "1"], &cmd);
        assert_eq!(
            waited.status.code(),
            Some(69),
            "{}",
            super::text(&waited.stderr)
        );
        assert!(super::runs(dir.path()).is_empty(), "the command ran");
        let plain = super::once(&url.url, "acked", &[], &cmd);
        assert!(plain.status.success(), "{}", super::text(&plain.stderr));
        assert_eq!(super::runs(dir.path()).len(), 1);
    }
}

/// `--redis-wait-replicas` names Redis alone: with a SQL database it is a
/// usage error (64), before anything connects or runs.
#[test]
fn redis_wait_replicas_needs_redis_alone() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("once.db").display());
    let refused = once(&url, "k", &["--redis-wait-replicas", "1"], &["true"]);
    assert_eq!(refused.status.code(), Some(64), "{}", text(&refused.stderr));
    assert!(
        text(&refused.stderr).contains("applies to Redis alone"),
        "{}",
        text(&refused.stderr)
    );
}

/// `idem inspect` lists a run's steps (idem-once), in order, by name.
#[tokio::test]
async fn inspect_shows_a_runs_steps() {
    use idem_once::{Failure, Runner};
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("steps.db").display());
    let store = idem_sqlite::SqliteStore::connect(&url).await.unwrap();
    let runner = Runner::new(store, idem_core::Policy::default());
    runner
        .run(
            "shop",
            "checkout-1",
            &1,
            async |op| -> Result<u8, Failure<String>> {
                op.step("charge", async |_| -> Result<u8, String> { Ok(1) })
                    .await
                    .map_err(|e| e.to_string())?;
                op.step("mark-paid", async |_| -> Result<u8, String> { Ok(2) })
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(3)
            },
        )
        .await
        .unwrap();
    let shown = idem(&url, &["inspect", "--scope", "shop", "--key", "checkout-1"])
        .output()
        .unwrap();
    let out = text(&shown.stdout);
    assert!(shown.status.success(), "{}", text(&shown.stderr));
    let charge = out.find("step 0:").expect(&out);
    let paid = out.find("step 1:").expect(&out);
    assert!(charge < paid);
    assert!(
        out[charge..].starts_with("step 0:       charge: completed"),
        "{out}"
    );
    assert!(
        out[paid..].starts_with("step 1:       mark-paid: completed"),
        "{out}"
    );
    let json = idem(
        &url,
        &[
            "inspect",
            "--scope",
            "shop",
            "--key",
            "checkout-1",
            "--json",
        ],
    )
    .output()
    .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["steps"][0]["name"], "charge");
    assert_eq!(v["steps"][1]["name"], "mark-paid");
    assert_eq!(v["steps"][1]["state"], "completed");
    assert_eq!(v["steps"].as_array().unwrap().len(), 2);
}
