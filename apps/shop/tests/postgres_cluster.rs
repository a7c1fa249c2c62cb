//! Several `shop` processes sharing one PostgreSQL database.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{account, pay, read, Db, Shop, BODY};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_instances_200_racing_duplicates_of_20_keys_charge_20_times() {
    common::three_instances_race(&[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_on_one_instance_is_taken_over_by_another_after_the_lease() {
    let db = Db::postgres().await;
    let lease = ["--lease-ms", "3000"];
    let mut a = Shop::start(&db, &lease).await;
    let b = Shop::start(&db, &lease).await;
    let client = reqwest::Client::new();

    let lost = pay(&client, &a, Some("x-crash"), BODY)
        .header("x-simulate", "crash-after-bank")
        .send()
        .await;
    assert!(lost.is_err(), "instance A died before answering: {lost:?}");
    assert!(!a.wait_exit(Duration::from_secs(10)).success());
    let crashed_at = Instant::now();

    let busy = read(pay(&client, &b, Some("x-crash"), BODY)).await;
    assert!(crashed_at.elapsed() < Duration::from_millis(2500));
    assert_eq!(busy.status, 409, "B sees the claim A still holds: {busy:?}");
    assert!(busy.headers.contains_key("retry-after"));

    tokio::time::sleep(Duration::from_millis(3200).saturating_sub(crashed_at.elapsed())).await;
    let retry = read(pay(&client, &b, Some("x-crash"), BODY)).await;
    assert_eq!(retry.status, 201, "B takes over after the lease: {retry:?}");
    let acc = account(&client, &b, "acc_1").await;
    assert_eq!(acc["payments"], 1, "{acc}");
    assert_eq!(acc["bank_charges"], 1, "the bank charged once: {acc}");
}
