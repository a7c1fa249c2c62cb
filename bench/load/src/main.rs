//! `idem-load`: drives `POST /payments` (or any JSON endpoint) with a mix of
//! new keys, replays of completed keys, collisions with in-flight keys, and
//! requests without a key, at a fixed concurrency, and prints throughput
//! and latency percentiles as a table line and as JSON.
//!
//! ```text
//! idem-load --url http://127.0.0.1:8080/payments --concurrency 32 --requests 20000 --mix replay=100
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use serde_json::json;

/// Load for idem benchmarks.
#[derive(Debug, Parser)]
struct Args {
    /// The endpoint to POST to.
    #[arg(long)]
    url: String,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Requests to send in all (after warm-up).
    #[arg(long, default_value_t = 10_000)]
    requests: u64,
    /// Send at this fixed rate (requests per second, open loop; latency is
    /// counted from each request's scheduled time) instead of as fast as
    /// the concurrency allows.
    #[arg(long)]
    rate: Option<f64>,
    /// Stop after this many seconds even if requests remain.
    #[arg(long)]
    duration_secs: Option<f64>,
    /// Percentages of each kind: new, replay, inflight, nokey (summing to 100).
    #[arg(long, default_value = "new=100")]
    mix: String,
    /// Completed keys prepared before the run, for replays.
    #[arg(long, default_value_t = 200)]
    replay_keys: usize,
    /// The request body.
    #[arg(
        long,
        default_value = r#"{"account_id":"acc_bench","amount":100,"currency":"EUR"}"#
    )]
    body: String,
    /// The bearer token sent.
    #[arg(long, default_value = "bench")]
    token: String,
    /// A label for the output.
    #[arg(long, default_value = "run")]
    label: String,
    /// Extra header for in-flight collisions (makes the original slow).
    #[arg(long, default_value = "x-simulate: bank-delay=200")]
    inflight_header: String,
    /// A header every request carries, `NAME: VALUE` (repeatable): e.g. a
    /// session cookie for a peer that keys records by session.
    #[arg(long = "header")]
    headers: Vec<String>,
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    New,
    Replay,
    InFlight,
    NoKey,
}

fn parse_mix(mix: &str) -> Result<Vec<(Kind, u32)>, String> {
    let mut out = Vec::new();
    for part in mix.split(',') {
        let (name, pct) = part
            .split_once('=')
            .ok_or_else(|| format!("bad mix part {part:?}"))?;
        let pct: u32 = pct
            .parse()
            .map_err(|_| format!("bad percentage in {part:?}"))?;
        let kind = match name {
            "new" => Kind::New,
            "replay" => Kind::Replay,
            "inflight" => Kind::InFlight,
            "nokey" => Kind::NoKey,
            other => return Err(format!("unknown kind {other:?}")),
        };
        out.push((kind, pct));
    }
    if out.iter().map(|(_, p)| p).sum::<u32>() != 100 {
        return Err("the mix must sum to 100".into());
    }
    Ok(out)
}

fn pick(mix: &[(Kind, u32)], n: u64) -> Kind {
    let r = (n.wrapping_mul(2_654_435_761) % 100) as u32;
    let mut acc = 0;
    for (k, p) in mix {
        acc += p;
        if r < acc {
            return *k;
        }
    }
    mix.last().map_or(Kind::New, |(k, _)| *k)
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1000.0
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let mix = parse_mix(&args.mix)?;
    let mut defaults = reqwest::header::HeaderMap::new();
    for h in &args.headers {
        let (name, value) = h
            .split_once(':')
            .ok_or_else(|| format!("--header {h:?} must be NAME: VALUE"))?;
        defaults.append(
            reqwest::header::HeaderName::from_bytes(name.trim().as_bytes())?,
            reqwest::header::HeaderValue::from_str(value.trim())?,
        );
    }
    let client = reqwest::Client::builder()
        .default_headers(defaults)
        .pool_max_idle_per_host(args.concurrency)
        .timeout(Duration::from_secs(30))
        .build()?;
    let run_id = uuid::Uuid::new_v4().simple().to_string();
    let (ih_name, ih_value) = args
        .inflight_header
        .split_once(':')
        .map(|(a, b)| (a.trim().to_owned(), b.trim().to_owned()))
        .ok_or("--inflight-header must be NAME: VALUE")?;

    // Warm up: complete the keys that replays will use.
    let replay_keys: Vec<String> = (0..args.replay_keys)
        .map(|i| format!("{run_id}-r{i}"))
        .collect();
    for k in &replay_keys {
        let r = client
            .post(&args.url)
            .bearer_auth(&args.token)
            .header("content-type", "application/json")
            .header("idempotency-key", k)
            .body(args.body.clone())
            .send()
            .await?;
        if !r.status().is_success() {
            return Err(format!("warm-up request failed: {}", r.status()).into());
        }
    }
    // A slow in-flight original for collisions to hit.
    let inflight_key = format!("{run_id}-inflight");
    if mix.iter().any(|(k, _)| matches!(k, Kind::InFlight)) {
        let (c, url, token, body, key) = (
            client.clone(),
            args.url.clone(),
            args.token.clone(),
            args.body.clone(),
            inflight_key.clone(),
        );
        let (n, v) = (ih_name.clone(), ih_value.replace("200", "600000"));
        tokio::spawn(async move {
            let _ = c
                .post(url)
                .bearer_auth(token)
                .header("content-type", "application/json")
                .header("idempotency-key", key)
                .header(n, v)
                .body(body)
                .send()
                .await;
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let next = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..args.concurrency {
        let (client, next, errors) = (client.clone(), next.clone(), errors.clone());
        let (url, token, body, mix, replay_keys, run_id, inflight_key) = (
            args.url.clone(),
            args.token.clone(),
            args.body.clone(),
            mix.clone(),
            replay_keys.clone(),
            run_id.clone(),
            inflight_key.clone(),
        );
        let total = args.requests;
        let rate = args.rate;
        let until = args
            .duration_secs
            .map(|d| started + Duration::from_secs_f64(d));
        workers.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= total || until.is_some_and(|u| Instant::now() >= u) {
                    return latencies;
                }
                // Open loop: each request has its slot; latency counts from it.
                let scheduled = match rate {
                    Some(r) => {
                        let at = started + Duration::from_secs_f64(n as f64 / r);
                        tokio::time::sleep_until(at.into()).await;
                        at
                    }
                    None => Instant::now(),
                };
                let mut r = client
                    .post(&url)
                    .bearer_auth(&token)
                    .header("content-type", "application/json");
                r = match pick(&mix, n) {
                    Kind::New => r.header("idempotency-key", format!("{run_id}-n{n}")),
                    Kind::Replay => r.header(
                        "idempotency-key",
                        &replay_keys[(n as usize) % replay_keys.len().max(1)],
                    ),
                    Kind::InFlight => r.header("idempotency-key", &inflight_key),
                    Kind::NoKey => r,
                };
                let t = scheduled;
                match r.body(body.clone()).send().await {
                    Ok(resp) => {
                        let status = resp.status().as_u16();
                        let _ = resp.bytes().await;
                        if status >= 500 {
                            errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
                latencies.push(t.elapsed());
            }
        }));
    }
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await?);
    }
    let elapsed = started.elapsed();
    all.sort();
    let rps = all.len() as f64 / elapsed.as_secs_f64();
    let (p50, p99, p999) = (
        percentile(&all, 0.50),
        percentile(&all, 0.99),
        percentile(&all, 0.999),
    );
    let errors = errors.load(Ordering::Relaxed);
    println!(
        "{:<28} {:>10.0} req/s   p50 {:>7.2} ms   p99 {:>7.2} ms   p99.9 {:>7.2} ms   errors {}",
        args.label, rps, p50, p99, p999, errors
    );
    eprintln!(
        "{}",
        json!({"label": args.label, "mix": args.mix, "concurrency": args.concurrency, "requests": all.len(),
               "seconds": elapsed.as_secs_f64(), "rps": rps, "p50_ms": p50, "p99_ms": p99, "p999_ms": p999, "errors": errors})
    );
    Ok(())
}
