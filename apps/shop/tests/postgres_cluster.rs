//! Several `shop` processes sharing one PostgreSQL database.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{account, pay, read, Answer, Db, Shop, BODY};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_instances_200_racing_duplicates_of_20_keys_charge_20_times() {
    let db = Db::postgres().await;
    let shops = [
        Shop::start(&db, &[]).await,
        Shop::start(&db, &[]).await,
        Shop::start(&db, &[]).await,
    ];
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for i in 0..200 {
        let key = format!("cluster-key-{}", i % 20);
        let shop = &shops[i % 3];
        let r = pay(&client, shop, Some(&key), BODY).header("x-simulate", "bank-delay=200");
        tasks.push((key, tokio::spawn(read(r))));
    }
    let mut by_key: HashMap<String, Vec<Answer>> = HashMap::new();
    for (key, t) in tasks {
        by_key.entry(key).or_default().push(t.await.unwrap());
    }
    assert_eq!(by_key.len(), 20);
    for (key, answers) in &by_key {
        let fresh: Vec<_> = answers
            .iter()
            .filter(|a| a.status == 201 && !a.replayed)
            .collect();
        assert_eq!(
            fresh.len(),
            1,
            "{key}: exactly one request ran: {answers:?}"
        );
        for a in answers {
            match a.status {
                201 => assert_eq!(a.body, fresh[0].body, "{key}: replays are byte-identical"),
                409 => assert!(a.problem_type().ends_with("idempotency-key-in-use")),
                other => panic!("{key}: unexpected status {other}: {a:?}"),
            }
        }
        // every instance replays the same bytes afterwards
        for shop in &shops {
            let again = read(pay(&client, shop, Some(key), BODY)).await;
            assert!(again.replayed, "{key}: {again:?}");
            assert_eq!(again.body, fresh[0].body);
        }
    }
    let acc = account(&client, &shops[0], "acc_1").await;
    assert_eq!(acc["payments"], 20, "{acc}");
    assert_eq!(acc["bank_charges"], 20, "{acc}");
    assert_eq!(acc["charged_total"], 20_000, "{acc}");
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
