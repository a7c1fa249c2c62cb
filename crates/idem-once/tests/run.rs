//! Run once and steps against every store, each real: memory, SQLite,
//! PostgreSQL, MySQL/MariaDB and Redis; the transactional variants on the
//! three SQL databases. Each test works in a schema, database, file or key
//! prefix of its own.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::Policy;
use idem_once::{Failure, Operation, Outcome, RunError, Runner, StepError};

/// A lease short enough for takeover tests, and the rest default.
fn short_lease(ms: u64) -> Policy {
    Policy::builder()
        .lease(Duration::from_millis(ms))
        .build()
        .unwrap()
}

/// Waits for an in-flight holder instead of refusing at once.
fn waiting() -> Policy {
    Policy::builder()
        .lease(Duration::from_secs(30))
        .wait_for_in_flight(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// Runs key `k` once through step `a` (completed), then fails: the run's
/// result.
async fn a_then_failed<S: idem_core::Store>(
    runner: &Runner<S>,
) -> Result<Outcome<u8>, RunError<String>> {
    runner
        .run("t", "k", &1, async |op| -> Result<u8, Failure<String>> {
            op.step("a", async |_| -> Result<u8, String> { Ok(1) })
                .await
                .map_err(|e| e.to_string())?;
            Err("then failed".to_owned())?
        })
        .await
}

/// Step `name`, which must be refused because the first step did not
/// complete (`called` counts it if it runs anyway): the refusal as the run's
/// final failure, naming that step.
async fn refused_as_unfinished<S: idem_core::Store + ?Sized>(
    op: &Operation<'_, S>,
    name: &str,
    called: &AtomicU32,
) -> Result<u8, Failure<String>> {
    let step = op
        .step(name, async |_| -> Result<u8, String> {
            called.fetch_add(1, Ordering::SeqCst);
            Ok(2)
        })
        .await;
    match step {
        Err(StepError::Unfinished { index: 0, name }) => Err(Failure::Final(name)),
        other => panic!("{other:?}"),
    }
}

/// Runs `$work` under key `k` three times, the first two cut off (their
/// work hangs): the first at once, the second half a [`STEP_RETENTION`]
/// later (a takeover, keeping the run's record until 1.5 retentions), the
/// third a tenth of a retention past the first's retention, while the
/// run's record is still there. The third's result.
macro_rules! across_the_retention {
    ($runner:expr, $work:expr) => {{
        let start = std::time::Instant::now();
        assert!(
            tokio::time::timeout(Duration::from_millis(100), $runner.run("t", "k", &1, $work))
                .await
                .is_err()
        );
        tokio::time::sleep(STEP_RETENTION / 2 - start.elapsed()).await;
        assert!(
            tokio::time::timeout(Duration::from_millis(300), $runner.run("t", "k", &1, $work))
                .await
                .is_err()
        );
        tokio::time::sleep((STEP_RETENTION + STEP_RETENTION / 10).saturating_sub(start.elapsed()))
            .await;
        let third = $runner.run("t", "k", &1, $work).await;
        assert!(
            start.elapsed() < STEP_RETENTION * 3 / 2,
            "the run's record expired before the test could look"
        );
        third
    }};
}

/// Cases every store passes. `$make` is an async expression giving
/// `(store, guard)`; the guard cleans up when dropped.
macro_rules! run_suite {
    ($make:expr) => {
        use crate::*;

        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn racing_callers_run_once_and_all_get_the_first_output() {
            let (store, _guard) = $make.await;
            let runner = Runner::new(store, waiting());
            let runs = Arc::new(AtomicU32::new(0));
            let mut tasks = Vec::new();
            for _ in 0..12 {
                let runner = runner.clone();
                let runs = runs.clone();
                tasks.push(tokio::spawn(async move {
                    runner
                        .run("tenant", "job-1", &("nightly", 1), async |op| -> Result<String, Failure<String>> {
                            runs.fetch_add(1, Ordering::SeqCst);
                            // Long enough that the others arrive while it runs.
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            Ok(op.id().to_string())
                        })
                        .await
                }));
            }
            let mut outputs = Vec::new();
            let mut fresh = 0;
            for t in tasks {
                match t.await.unwrap().unwrap() {
                    Outcome::Fresh(v) => {
                        fresh += 1;
                        outputs.push(v)
                    }
                    Outcome::Replayed(v) => outputs.push(v),
                }
            }
            assert_eq!(runs.load(Ordering::SeqCst), 1, "the work ran more than once");
            assert_eq!(fresh, 1);
            assert!(outputs.windows(2).all(|w| w[0] == w[1]), "{outputs:?}");
        }

        #[tokio::test]
        async fn a_repeat_is_replayed_and_other_input_under_the_key_is_refused() {
            let (store, _guard) = $make.await;
            let runner = Runner::new(store, Policy::default());
            let runs = AtomicU32::new(0);
            let work = async |_: &idem_once::Operation<'_, _>| -> Result<Vec<u32>, Failure<String>> {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok(vec![1, 2, 3])
            };
            let input = serde_json::json!({"amount": 1000, "currency": "EUR"});
            assert_eq!(runner.run("t", "k", &input, work).await.unwrap(), Outcome::Fresh(vec![1, 2, 3]));
            // The same input spelled otherwise is the same input.
            let same = serde_json::json!({"currency": "EUR", "amount": 1000.0});
            assert_eq!(runner.run("t", "k", &same, work).await.unwrap(), Outcome::Replayed(vec![1, 2, 3]));
            let other = serde_json::json!({"amount": 1001, "currency": "EUR"});
            assert!(matches!(runner.run("t", "k", &other, work).await, Err(RunError::KeyReused)));
            // Another scope is another key.
            assert!(matches!(runner.run("u", "k", &other, work).await, Ok(Outcome::Fresh(_))));
            assert_eq!(runs.load(Ordering::SeqCst), 2);
            // Keys follow the header's rules.
            assert!(matches!(runner.run("t", "a b", &1, work).await, Err(RunError::InvalidKey(_))));
            assert!(matches!(runner.run("t", "", &1, work).await, Err(RunError::InvalidKey(_))));
            assert!(matches!(runner.run("", "k", &1, work).await, Err(RunError::InvalidKey(_))));
        }

        #[tokio::test]
        async fn a_failure_releases_under_the_same_operation_and_a_final_one_is_stored() {
            let (store, _guard) = $make.await;
            let runner = Runner::new(store, Policy::default());
            let ids = Mutex::new(Vec::new());
            let failing = async |op: &idem_once::Operation<'_, _>| -> Result<u8, Failure<String>> {
                ids.lock().unwrap().push(op.id());
                Err("the mailer is down".to_owned())?
            };
            match runner.run("t", "k", &1, failing).await {
                Err(RunError::Failed(e)) => assert_eq!(e, "the mailer is down"),
                other => panic!("{other:?}"),
            }
            let ok = async |op: &idem_once::Operation<'_, _>| -> Result<u8, Failure<String>> {
                ids.lock().unwrap().push(op.id());
                assert!(op.is_takeover(), "a released key is taken over");
                Ok(7)
            };
            assert_eq!(runner.run("t", "k", &1, ok).await.unwrap(), Outcome::Fresh(7));
            let ids = ids.into_inner().unwrap();
            assert_eq!(ids.len(), 2);
            assert_eq!(ids[0], ids[1], "the operation id is kept across a release");

            let declined = async |_: &idem_once::Operation<'_, _>| -> Result<u8, Failure<String>> {
                Err(Failure::Final("card declined".to_owned()))
            };
            match runner.run("t", "final", &1, declined).await {
                Err(RunError::Final { error, replayed: false }) => assert_eq!(error, "card declined"),
                other => panic!("{other:?}"),
            }
            let never = async |_: &idem_once::Operation<'_, _>| -> Result<u8, Failure<String>> {
                panic!("a stored final error runs nothing")
            };
            match runner.run("t", "final", &1, never).await {
                Err(RunError::Final { error, replayed: true }) => assert_eq!(error, "card declined"),
                other => panic!("{other:?}"),
            }
        }

        #[tokio::test]
        async fn a_duplicate_while_the_first_runs_is_in_flight() {
            let (store, _guard) = $make.await;
            let runner = Runner::new(store, Policy::default());
            let (started_tx, started) = tokio::sync::oneshot::channel();
            let (finish, finish_rx) = tokio::sync::oneshot::channel::<()>();
            let first = {
                let runner = runner.clone();
                tokio::spawn(async move {
                    runner
                        .run("t", "k", &1, async |_| -> Result<u8, Failure<String>> {
                            started_tx.send(()).unwrap();
                            finish_rx.await.unwrap();
                            Ok(1)
                        })
                        .await
                })
            };
            started.await.unwrap();
            let dup = runner
                .run("t", "k", &1, async |_| -> Result<u8, Failure<String>> { panic!("ran twice") })
                .await;
            match dup {
                Err(RunError::InFlight { retry_after }) => assert!(retry_after >= Duration::from_secs(1)),
                other => panic!("{other:?}"),
            }
            finish.send(()).unwrap();
            assert_eq!(first.await.unwrap().unwrap(), Outcome::Fresh(1));
        }

        #[tokio::test]
        async fn a_zombie_past_its_lease_is_fenced_and_the_holder_stands() {
            let (store, _guard) = $make.await;
            let runner = Runner::new(store, short_lease(300));
            let zombie = {
                let runner = runner.clone();
                tokio::spawn(async move {
                    runner
                        .run("t", "k", &1, async |_| -> Result<String, Failure<String>> {
                            // Stalls past its lease (a GC pause, a partition).
                            tokio::time::sleep(Duration::from_millis(1500)).await;
                            Ok("zombie".to_owned())
                        })
                        .await
                })
            };
            // The retry comes after the lease and takes over.
            tokio::time::sleep(Duration::from_millis(600)).await;
            let holder = runner
                .run("t", "k", &1, async |op| -> Result<String, Failure<String>> {
                    assert!(op.is_takeover());
                    Ok("holder".to_owned())
                })
                .await
                .unwrap();
            assert_eq!(holder, Outcome::Fresh("holder".to_owned()));
            assert!(matches!(zombie.await.unwrap(), Err(RunError::LeaseLost)));
            let again = runner
                .run("t", "k", &1, async |_| -> Result<String, Failure<String>> { panic!("ran again") })
                .await
                .unwrap();
            assert_eq!(again, Outcome::Replayed("holder".to_owned()));
        }

        #[tokio::test]
        async fn a_crash_mid_step_resumes_under_the_same_operation_and_step_keys() {
            let (store, _guard) = $make.await;
            let runner = Runner::new(store, short_lease(400));
            let calls = Mutex::new(Vec::<(String, uuid::Uuid)>::new());
            let op_ids = Mutex::new(Vec::new());
            let work = async |op: &idem_once::Operation<'_, _>| -> Result<String, Failure<String>> {
                op_ids.lock().unwrap().push(op.id());
                let charge: String = op
                    .step("charge", async |s| -> Result<String, String> {
                        calls.lock().unwrap().push(("charge".into(), s.key()));
                        Ok(format!("ch-{}", s.key()))
                    })
                    .await
                    .map_err(|e| e.to_string())?;
                let receipt: String = op
                    .step("receipt", async |s| -> Result<String, String> {
                        calls.lock().unwrap().push(("receipt".into(), s.key()));
                        // The first run dies here: after the call, before
                        // its output is stored.
                        if calls.lock().unwrap().len() == 2 {
                            std::future::pending::<()>().await;
                        }
                        Ok("sent".into())
                    })
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(format!("{charge}/{receipt}"))
            };
            // The crash: the first run's future stops mid-step and is gone.
            let crashed = tokio::time::timeout(Duration::from_millis(100), runner.run("t", "k", &1, work)).await;
            assert!(crashed.is_err());
            tokio::time::sleep(Duration::from_millis(500)).await;
            let out = runner.run("t", "k", &1, work).await.unwrap();
            assert!(matches!(out, Outcome::Fresh(_)));
            let calls = calls.into_inner().unwrap();
            let names: Vec<&str> = calls.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names, ["charge", "receipt", "receipt"], "a completed step is not called again");
            assert_eq!(calls[1].1, calls[2].1, "the step is called again under the same key");
            assert_ne!(calls[0].1, calls[1].1, "each step has a key of its own");
            let op_ids = op_ids.into_inner().unwrap();
            assert_eq!(op_ids[0], op_ids[1], "resumed under the same operation id");
            assert_eq!(calls[0].1, idem_once::step_key(op_ids[0], "charge"));
            assert_eq!(out.into_inner(), format!("ch-{}/sent", calls[0].1));
        }

        #[tokio::test]
        async fn a_runs_steps_are_swept_with_it() {
            use idem_core::Store as _;
            let (store, _guard) = $make.await;
            let policy = Policy::builder()
                .lease(Duration::from_millis(200))
                .retention(Duration::from_millis(600))
                .build()
                .unwrap();
            let runner = Runner::new(store, policy);
            let ran = runner
                .run("t", "k", &1, async |op| -> Result<String, Failure<String>> {
                    op.step("a", async |_| -> Result<u8, String> { Ok(1) })
                        .await
                        .map_err(|e| e.to_string())?;
                    op.step("b", async |_| -> Result<u8, String> { Ok(2) })
                        .await
                        .map_err(|e| e.to_string())?;
                    Ok(op.id().to_string())
                })
                .await
                .unwrap();
            let op = idem_core::OperationId(ran.into_inner().parse().unwrap());
            let store = runner.store();
            for index in 0..2 {
                let key = idem_once::step_record_key(op, index);
                assert!(store.get("t", &key).await.unwrap().is_some(), "step {index} stored");
            }
            tokio::time::sleep(Duration::from_millis(900)).await;
            let swept = idem_core::sweep_all(store, 100).await.unwrap();
            if store.kind() == "redis" {
                // Redis expires them itself (each key has the record's TTL).
                assert_eq!(swept, 0);
            } else {
                assert_eq!(swept, 3, "the run's record and its two steps' went");
            }
            assert!(store.get("t", "k").await.unwrap().is_none());
            for index in 0..2 {
                let key = idem_once::step_record_key(op, index);
                assert!(store.get("t", &key).await.unwrap().is_none(), "step {index} swept");
            }
        }

        #[tokio::test]
        async fn steps_asked_for_in_another_order_are_refused() {
            let (store, _guard) = $make.await;
            let runner = Runner::new(store, Policy::default());
            let first = a_then_failed(&runner).await;
            assert!(matches!(first, Err(RunError::Failed(_))));
            let second = runner
                .run("t", "k", &1, async |op| -> Result<u8, Failure<String>> {
                    match op.step("b", async |_| -> Result<u8, String> { Ok(2) }).await {
                        Err(StepError::OutOfOrder { index: 0, name }) => Err(Failure::Final(name)),
                        other => panic!("{other:?}"),
                    }
                })
                .await;
            assert!(matches!(second, Err(RunError::Final { error, .. }) if error == "b"));
            // Names are checked, and unique per run.
            let third = runner
                .run("t", "k2", &1, async |op| -> Result<u8, Failure<String>> {
                    assert!(matches!(op.step("a b", async |_| -> Result<u8, String> { Ok(0) }).await, Err(StepError::InvalidName(_))));
                    op.step("x", async |_| -> Result<u8, String> { Ok(0) }).await.map_err(|e| e.to_string())?;
                    assert!(matches!(op.step("x", async |_| -> Result<u8, String> { Ok(0) }).await, Err(StepError::DuplicateName(_))));
                    Ok(3)
                })
                .await;
            assert_eq!(third.unwrap(), Outcome::Fresh(3));
        }

        /// A run retried for longer than its retention (each takeover
        /// keeps the run's record a retention more) outlives the records of
        /// the steps it did first. A step found without a record then may
        /// have run: it is refused, not called a second time, and stays
        /// refused on every later run.
        #[tokio::test]
        async fn a_step_whose_record_expired_in_a_run_kept_past_its_retention_is_refused() {
            let (store, _guard) = $make.await;
            let runner = Runner::new(store, step_retention());
            let charges = AtomicU32::new(0);
            let refusals = Mutex::new(Vec::new());
            let attempt = AtomicU32::new(0);
            let work = async |op: &idem_once::Operation<'_, _>| -> Result<u8, Failure<String>> {
                let n = attempt.fetch_add(1, Ordering::SeqCst);
                let charged = op
                    .step("charge", async |_| -> Result<u8, String> {
                        charges.fetch_add(1, Ordering::SeqCst);
                        Ok(1)
                    })
                    .await;
                let charged = match charged {
                    Err(StepError::Forgotten { index, name }) => {
                        refusals.lock().unwrap().push((index, name));
                        // Released: the next run comes back to the step.
                        return Err(Failure::Retry("forgotten".to_owned()));
                    }
                    other => other.map_err(|e| e.to_string())?,
                };
                if n < 2 {
                    // Crashes after the step: the run's record stays in
                    // progress until its lease ends.
                    std::future::pending::<()>().await;
                }
                Ok(charged)
            };
            // The first attempt charges and dies; the second, half a
            // retention later, finds the charge done and dies too; the third
            // comes past the charge's retention, the run's record still
            // there, the charge's not.
            let third = across_the_retention!(runner, work);
            assert!(matches!(third, Err(RunError::Failed(ref error)) if error == "forgotten"), "{third:?}");
            // And on every run after.
            let fourth = runner.run("t", "k", &1, work).await;
            assert!(matches!(fourth, Err(RunError::Failed(ref error)) if error == "forgotten"), "{fourth:?}");
            assert_eq!(charges.load(Ordering::SeqCst), 1, "the charge ran a second time");
            assert_eq!(*refusals.lock().unwrap(), [(0, "charge".to_owned()), (0, "charge".to_owned())]);
        }

        /// The retention raised between two attempts: the first kept its
        /// step's record for its own, shorter retention, and the second
        /// kept the run's record for its longer one. A third, past the
        /// first's retention, finds no record of the step: it may have
        /// run (it did), so it is refused, although the retention the
        /// third runs under has not passed.
        #[tokio::test]
        async fn a_step_kept_for_a_shorter_retention_than_the_run_is_not_run_again() {
            let (store, _guard) = $make.await;
            let store = Arc::new(store);
            let short = Runner::new(store.clone(), step_retention());
            let long = Runner::new(
                store,
                Policy::builder()
                    .lease(Duration::from_millis(200))
                    .retention(STEP_RETENTION * 30)
                    .build()
                    .unwrap(),
            );
            let charges = AtomicU32::new(0);
            let attempt = AtomicU32::new(0);
            let work = async |op: &idem_once::Operation<'_, _>| -> Result<u8, Failure<String>> {
                let n = attempt.fetch_add(1, Ordering::SeqCst);
                let charged = op
                    .step("charge", async |_| -> Result<u8, String> {
                        charges.fetch_add(1, Ordering::SeqCst);
                        Ok(1)
                    })
                    .await;
                let charged = match charged {
                    Err(StepError::Forgotten { .. }) => return Err(Failure::Final("forgotten".to_owned())),
                    other => other.map_err(|e| e.to_string())?,
                };
                if n < 2 {
                    // Dies after the step: the run stays in progress until
                    // its lease ends.
                    std::future::pending::<()>().await;
                }
                Ok(charged)
            };
            let start = std::time::Instant::now();
            assert!(tokio::time::timeout(Duration::from_millis(100), short.run("t", "k", &1, work)).await.is_err());
            // Half the short retention later, with the long one: a takeover
            // that keeps the run's record for the long retention.
            tokio::time::sleep(STEP_RETENTION / 2 - start.elapsed()).await;
            assert!(tokio::time::timeout(Duration::from_millis(100), long.run("t", "k", &1, work)).await.is_err());
            assert_eq!(charges.load(Ordering::SeqCst), 1);
            // Past the short retention: the charge's record is gone, the
            // run's is not.
            tokio::time::sleep((STEP_RETENTION + STEP_RETENTION / 4).saturating_sub(start.elapsed())).await;
            let third = long.run("t", "k", &1, work).await;
            assert_eq!(charges.load(Ordering::SeqCst), 1, "the charge ran a second time: {third:?}");
            assert!(matches!(third, Err(RunError::Final { ref error, .. }) if error == "forgotten"), "{third:?}");
        }

        /// In a run kept past its retention, a step whose record is absent
        /// is still run when the step before it was made less than a
        /// retention ago: had it run, its record would be there.
        #[tokio::test]
        async fn a_run_kept_past_its_retention_runs_the_steps_it_never_reached() {
            let (store, _guard) = $make.await;
            let runner = Runner::new(store, step_retention());
            let calls = Mutex::new(Vec::new());
            // 0: hangs before any step; 1: runs `a`, hangs; 2: finishes.
            let attempt = AtomicU32::new(0);
            let work = async |op: &idem_once::Operation<'_, _>| -> Result<u8, Failure<String>> {
                let n = attempt.fetch_add(1, Ordering::SeqCst);
                if n == 0 {
                    std::future::pending::<()>().await;
                }
                let a = op
                    .step("a", async |_| -> Result<u8, String> {
                        calls.lock().unwrap().push("a");
                        Ok(1)
                    })
                    .await
                    .map_err(|e| e.to_string())?;
                if n == 1 {
                    std::future::pending::<()>().await;
                }
                let b = op
                    .step("b", async |_| -> Result<u8, String> {
                        calls.lock().unwrap().push("b");
                        Ok(2)
                    })
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(a + b)
            };
            let out = across_the_retention!(runner, work);
            assert_eq!(out.unwrap(), Outcome::Fresh(3));
            assert_eq!(*calls.lock().unwrap(), ["a", "b"]);
        }

        /// A step that crashed on every attempt for longer than the
        /// retention (each takeover keeping its record) and then completed:
        /// the step after it never ran (no attempt got past it), so it runs,
        /// however old the run.
        #[tokio::test]
        async fn a_step_after_one_retried_past_the_retention_still_runs() {
            let (store, _guard) = $make.await;
            let runner = Runner::new(store, step_retention());
            let calls = Mutex::new(Vec::new());
            let attempt = AtomicU32::new(0);
            let work = async |op: &idem_once::Operation<'_, _>| -> Result<u8, Failure<String>> {
                let n = attempt.fetch_add(1, Ordering::SeqCst);
                let a = op
                    .step("a", async |_| -> Result<u8, String> {
                        calls.lock().unwrap().push("a");
                        if n < 2 {
                            // Dies inside the step, twice.
                            std::future::pending::<()>().await;
                        }
                        Ok(1)
                    })
                    .await
                    .map_err(|e| e.to_string())?;
                let b = op
                    .step("b", async |_| -> Result<u8, String> {
                        calls.lock().unwrap().push("b");
                        Ok(2)
                    })
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(a + b)
            };
            let out = across_the_retention!(runner, work);
            assert_eq!(out.unwrap(), Outcome::Fresh(3));
            assert_eq!(*calls.lock().unwrap(), ["a", "a", "a", "b"]);
        }

        /// A step refused as out of order keeps its position, and no step
        /// after it starts: nothing runs past a step that never ran.
        #[tokio::test]
        async fn no_step_starts_after_one_refused_as_out_of_order() {
            let (store, _guard) = $make.await;
            let runner = Runner::new(store, Policy::default());
            let first = a_then_failed(&runner).await;
            assert!(matches!(first, Err(RunError::Failed(_))), "{first:?}");
            let called = AtomicU32::new(0);
            let second = runner
                .run("t", "k", &1, async |op| -> Result<u8, Failure<String>> {
                    let x = op.step("x", async |_| -> Result<u8, String> { Ok(0) }).await;
                    assert!(matches!(x, Err(StepError::OutOfOrder { index: 0, .. })), "{x:?}");
                    refused_as_unfinished(op, "y", &called).await
                })
                .await;
            assert!(matches!(second, Err(RunError::Final { ref error, .. }) if error == "x"), "{second:?}");
            assert_eq!(called.load(Ordering::SeqCst), 0);
        }

        /// A step starts only once the one before it completed: after a
        /// failed step, the next is refused, nothing called.
        #[tokio::test]
        async fn a_step_after_a_failed_one_is_refused() {
            let (store, _guard) = $make.await;
            let runner = Runner::new(store, Policy::default());
            let called = AtomicU32::new(0);
            let out = runner
                .run("t", "k", &1, async |op| -> Result<u8, Failure<String>> {
                    let failed = op
                        .step("a", async |_| -> Result<u8, String> { Err("down".to_owned()) })
                        .await;
                    assert!(matches!(failed, Err(StepError::Failed(_))), "{failed:?}");
                    refused_as_unfinished(op, "b", &called).await
                })
                .await;
            assert!(matches!(out, Err(RunError::Final { ref error, .. }) if error == "a"), "{out:?}");
            assert_eq!(called.load(Ordering::SeqCst), 0);
        }
    };
}

/// The retention of the tests of runs kept past it: long enough that each
/// attempt lands in its window on a busy machine.
const STEP_RETENTION: Duration = Duration::from_secs(4);

fn step_retention() -> Policy {
    Policy::builder()
        .lease(Duration::from_millis(200))
        .retention(STEP_RETENTION)
        .build()
        .unwrap()
}

/// Cases for a store whose records live in a SQL database: the
/// transactional run and step. `$make` gives `(store, guard)`, `$effects`
/// names the business table (created by the test).
macro_rules! transactional_suite {
    ($make:expr, $effects:expr, one_writer: $one_writer:expr) => {
        async fn count(store: &Store_, table: &str) -> i64 {
            sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
                .fetch_one(store.pool())
                .await
                .unwrap()
        }

        async fn setup() -> (Store_, Guard_, String) {
            let (store, guard) = $make.await;
            let table: String = ($effects)(&guard);
            sqlx::query(&format!("CREATE TABLE {table} (k VARCHAR(64) NOT NULL)"))
                .execute(store.pool())
                .await
                .unwrap();
            (store, guard, table)
        }

        #[tokio::test]
        async fn a_transactional_run_commits_its_writes_with_its_output_or_neither() {
            let (store, _guard, table) = setup().await;
            let runner = Runner::new(store.clone(), Policy::default());
            let insert = format!("INSERT INTO {table} (k) VALUES ('x')");
            let failed = runner
                .run_in_transaction("t", "k", &1, async |_, tx| -> Result<u8, Failure<String>> {
                    sqlx::query(&insert)
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| e.to_string())?;
                    Err("refused after writing".to_owned())?
                })
                .await;
            assert!(matches!(failed, Err(RunError::Failed(_))));
            assert_eq!(
                count(&store, &table).await,
                0,
                "a failed run's writes roll back"
            );
            let ok = runner
                .run_in_transaction("t", "k", &1, async |_, tx| -> Result<u8, Failure<String>> {
                    sqlx::query(&insert)
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| e.to_string())?;
                    Ok(1)
                })
                .await;
            assert_eq!(ok.unwrap(), Outcome::Fresh(1));
            let again = runner
                .run_in_transaction("t", "k", &1, async |_, _| -> Result<u8, Failure<String>> {
                    panic!("ran twice")
                })
                .await;
            assert_eq!(again.unwrap(), Outcome::Replayed(1));
            assert_eq!(count(&store, &table).await, 1);
            // No steps inside one transaction.
            let inside = runner
                .run_in_transaction(
                    "t",
                    "k2",
                    &1,
                    async |op, _| -> Result<u8, Failure<String>> {
                        match op
                            .step("s", async |_| -> Result<u8, String> { Ok(1) })
                            .await
                        {
                            Err(StepError::InsideTransaction) => Ok(0),
                            other => panic!("{other:?}"),
                        }
                    },
                )
                .await;
            assert_eq!(inside.unwrap(), Outcome::Fresh(0));
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_zombie_transaction_commits_nothing() {
            let (store, _guard, table) = setup().await;
            let runner = Runner::new(store.clone(), short_lease(300));
            let insert = format!("INSERT INTO {table} (k) VALUES ('x')");
            let zombie = {
                let runner = runner.clone();
                let insert = insert.clone();
                tokio::spawn(async move {
                    runner
                        .run_in_transaction(
                            "t",
                            "k",
                            &1,
                            async |_, tx| -> Result<u8, Failure<String>> {
                                sqlx::query(&insert)
                                    .execute(&mut *tx)
                                    .await
                                    .map_err(|e| e.to_string())?;
                                tokio::time::sleep(Duration::from_millis(1200)).await;
                                Ok(0)
                            },
                        )
                        .await
                })
            };
            tokio::time::sleep(Duration::from_millis(500)).await;
            let holder = runner
                .run("t", "k", &1, async |op| -> Result<u8, Failure<String>> {
                    assert!(op.is_takeover());
                    Ok(1)
                })
                .await
                .unwrap();
            let zombie = zombie.await.unwrap();
            if $one_writer {
                // SQLite has one writer: no takeover can happen while the
                // stalled run's transaction holds the write lock, so it
                // completes, and the retry gets its answer.
                assert_eq!(holder, Outcome::Replayed(0));
                assert_eq!(zombie.unwrap(), Outcome::Fresh(0));
                assert_eq!(count(&store, &table).await, 1);
            } else {
                assert_eq!(holder, Outcome::Fresh(1));
                assert!(matches!(zombie, Err(RunError::LeaseLost)), "{zombie:?}");
                assert_eq!(
                    count(&store, &table).await,
                    0,
                    "the zombie's write rolled back"
                );
            }
        }

        #[tokio::test]
        async fn a_transactional_step_commits_its_output_with_its_writes() {
            let (store, _guard, table) = setup().await;
            let runner = Runner::new(store.clone(), short_lease(400));
            let insert = format!("INSERT INTO {table} (k) VALUES ('paid')");
            let marks = AtomicU32::new(0);
            let work =
                async |op: &idem_once::Operation<'_, Store_>| -> Result<u32, Failure<String>> {
                    let n = op
                        .step_in_transaction("mark-paid", async |_, tx| -> Result<u32, String> {
                            sqlx::query(&insert)
                                .execute(&mut *tx)
                                .await
                                .map_err(|e| e.to_string())?;
                            Ok(marks.fetch_add(1, Ordering::SeqCst) + 1)
                        })
                        .await
                        .map_err(|e| e.to_string())?;
                    // The first run fails after the step committed.
                    if marks.load(Ordering::SeqCst) == 1 && !op.is_takeover() {
                        Err("after the step".to_owned())?
                    }
                    Ok(n)
                };
            assert!(matches!(
                runner.run("t", "k", &1, work).await,
                Err(RunError::Failed(_))
            ));
            let resumed = runner.run("t", "k", &1, work).await.unwrap();
            assert_eq!(
                resumed,
                Outcome::Fresh(1),
                "the step's stored output, not a second run"
            );
            assert_eq!(marks.load(Ordering::SeqCst), 1);
            assert_eq!(count(&store, &table).await, 1);
            // A step whose work fails rolls back and runs again.
            let tries = AtomicU32::new(0);
            let flaky =
                async |op: &idem_once::Operation<'_, Store_>| -> Result<u32, Failure<String>> {
                    op.step_in_transaction("flaky", async |_, tx| -> Result<u32, String> {
                        sqlx::query(&insert)
                            .execute(&mut *tx)
                            .await
                            .map_err(|e| e.to_string())?;
                        if tries.fetch_add(1, Ordering::SeqCst) == 0 {
                            return Err("first try fails".into());
                        }
                        Ok(2)
                    })
                    .await
                    .map_err(|e| Failure::Retry(e.to_string()))
                };
            assert!(runner.run("t", "k3", &1, flaky).await.is_err());
            assert_eq!(
                runner.run("t", "k3", &1, flaky).await.unwrap(),
                Outcome::Fresh(2)
            );
            assert_eq!(
                count(&store, &table).await,
                2,
                "the failed try's write rolled back"
            );
        }
    };
}

mod memory {
    run_suite!(async { (Arc::new(idem_memory::MemoryStore::new()), (),) });
}

mod sqlite {
    async fn make() -> (idem_sqlite::SqliteStore, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite:{}", dir.path().join("run.db").display());
        (idem_sqlite::SqliteStore::connect(&url).await.unwrap(), dir)
    }
    mod suite {
        run_suite!(super::make());
    }
    mod tx {
        use crate::*;
        type Store_ = idem_sqlite::SqliteStore;
        type Guard_ = tempfile::TempDir;
        transactional_suite!(super::make(), |_: &Guard_| "effects".to_owned(), one_writer: true);
    }
}

mod postgres {
    use idem_test_support::postgres::{database_url, TestSchema};
    async fn make() -> (idem_postgres::PostgresStore, TestSchema) {
        let schema = TestSchema::create("idem_once").await;
        let table = idem_postgres::TableName::new(Some(schema.name()), "idem_records").unwrap();
        let store = idem_postgres::PostgresStore::connect_with(&database_url(), table)
            .await
            .unwrap();
        (store, schema)
    }
    mod suite {
        run_suite!(super::make());
    }
    mod tx {
        use crate::*;
        type Store_ = idem_postgres::PostgresStore;
        type Guard_ = idem_test_support::postgres::TestSchema;
        transactional_suite!(super::make(), |g: &Guard_| format!("\"{}\".effects", g.name()), one_writer: false);
    }
}

mod mysql {
    use idem_test_support::mysql::TestDatabase;
    async fn make() -> (idem_mysql::MySqlStore, TestDatabase) {
        let db = TestDatabase::create("idem_once").await;
        (
            idem_mysql::MySqlStore::connect(&db.url()).await.unwrap(),
            db,
        )
    }
    mod suite {
        run_suite!(super::make());
    }
    mod tx {
        use crate::*;
        type Store_ = idem_mysql::MySqlStore;
        type Guard_ = idem_test_support::mysql::TestDatabase;
        transactional_suite!(super::make(), |_: &Guard_| "effects".to_owned(), one_writer: false);
    }
}

mod redis {
    use idem_redis::{RedisConfig, RedisStore};
    use idem_test_support::redis::{redis_url, TestPrefix};

    async fn make() -> (RedisStore, TestPrefix) {
        let prefix = TestPrefix::new("idem-once");
        let store = RedisStore::connect(RedisConfig::new(redis_url()).prefix(prefix.name()))
            .await
            .expect("Redis must be running for these tests");
        (store, prefix)
    }
    mod suite {
        run_suite!(super::make());
    }
}

/// Two steps started at once on one run: the one refused lets go of any
/// step claim it made, so a retry of the run starts that step at once
/// rather than waiting for it as if it were still running.
mod steps_at_once {
    use idem_core::ClaimRequest;
    use idem_memory::MemoryStore;
    use idem_test_support::stores::{ClaimDelay, SlowClaimAnswers};

    use crate::*;

    /// The memory store, but the first step claim (a key other than the
    /// run's) answers only after a while: made at once, heard of late, so
    /// that the step started beside it is decided first.
    type FirstStepAnswersLate = SlowClaimAnswers<MemoryStore, FirstStep>;

    #[derive(Debug, Default)]
    struct FirstStep(std::sync::atomic::AtomicUsize);

    impl ClaimDelay for FirstStep {
        fn delay(&self, r: &ClaimRequest) -> Duration {
            if r.key != "k" && self.0.fetch_add(1, Ordering::SeqCst) == 0 {
                Duration::from_millis(300)
            } else {
                Duration::ZERO
            }
        }
    }

    #[tokio::test]
    async fn the_step_refused_lets_its_claim_go() {
        let store: FirstStepAnswersLate = SlowClaimAnswers {
            inner: MemoryStore::new(),
            delay: FirstStep::default(),
        };
        let runner = Runner::new(store, Policy::default());
        let first = runner
            .run("t", "k", &1, async |op| -> Result<u8, Failure<String>> {
                let (a, b) = tokio::join!(
                    op.start_step::<u8, String>("a"),
                    op.start_step::<u8, String>("b")
                );
                assert!(
                    matches!(a, Err(StepError::OutOfOrder { index: 0, .. })),
                    "{a:?}"
                );
                assert!(
                    matches!(b, Err(StepError::OutOfOrder { index: 0, .. })),
                    "{b:?}"
                );
                Err("steps at once".to_owned())?
            })
            .await;
        assert!(matches!(first, Err(RunError::Failed(_))), "{first:?}");
        // The retry runs "a" (the claim the first attempt made and let go),
        // where it would wait for it and then be told it is in flight.
        let second = runner
            .run("t", "k", &1, async |op| -> Result<u8, Failure<String>> {
                let v = op
                    .step("a", async |_| -> Result<u8, String> { Ok(7) })
                    .await
                    .map_err(|e| format!("{e:?}"))?;
                Ok(v)
            })
            .await;
        assert_eq!(second.unwrap(), Outcome::Fresh(7));
    }
}

/// A step whose claim is answered after the run's lease has ended (it
/// waited for a connection, for SQLite's writer, or the process paused)
/// does not start: the run may be another's by then. The step is told
/// `LeaseLost`, its work never runs, and its claim is let go. Before, the
/// work ran past the run's lease, beside the run's new holder.
mod a_step_claimed_late {
    use idem_core::ClaimRequest;
    use idem_memory::MemoryStore;
    use idem_test_support::stores::{ClaimDelay, SlowClaimAnswers};

    use crate::*;

    #[derive(Debug)]
    struct StepClaims(Duration);

    impl ClaimDelay for StepClaims {
        fn delay(&self, r: &ClaimRequest) -> Duration {
            if r.key == "k" {
                Duration::ZERO
            } else {
                self.0
            }
        }
    }

    #[tokio::test]
    async fn does_not_start_past_the_runs_lease() {
        let lease = Duration::from_millis(300);
        let store = SlowClaimAnswers {
            inner: MemoryStore::new(),
            delay: StepClaims(lease * 2),
        };
        let runner = Runner::new(store, short_lease(300));
        let ran = AtomicU32::new(0);
        let outcome = runner
            .run("t", "k", &1, async |op| -> Result<u8, Failure<String>> {
                let step = op
                    .step("a", async |_| -> Result<u8, String> {
                        ran.fetch_add(1, Ordering::SeqCst);
                        Ok(1)
                    })
                    .await;
                assert!(matches!(step, Err(StepError::LeaseLost)), "{step:?}");
                Err("lease lost".to_owned())?
            })
            .await;
        assert!(outcome.is_err(), "{outcome:?}");
        assert_eq!(ran.load(Ordering::SeqCst), 0, "the step's work ran");
    }
}
